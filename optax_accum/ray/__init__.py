"""TF's host accumulators shared across the processes and machines of a Ray cluster.

`ConditionalAccumulator` and `SparseConditionalAccumulator` here take the in-process
classes' arguments and methods (`optax_accum.ConditionalAccumulator` and
`optax_accum.SparseConditionalAccumulator`), plus `namespace=`, `checkpoint_dir=`,
`max_restarts=` and `lifetime=`. The accumulator lives in a Ray actor, named by
`shared_name`, that holds one in-process accumulator: as TF's `shared_name` placed one
accumulator on a parameter server for workers on other machines, every process of
the cluster that builds a handle with that name reaches the same accumulator. Install
with `pip install "optax-accum[ray]"`.

Who can reach it: any process that can join the Ray cluster can reach the
accumulator, apply gradients to it and take them, and Ray runs whatever code the
cluster's members send it. Keep the cluster private: start it on a private address
(`ray start --head --node-ip-address=<private ip>`, behind a firewall that admits only
your machines) and keep Ray's token authentication on: `ray.init()` turns it on for
the local clusters it starts; for `ray start`, set `RAY_AUTH_MODE=token` on every
machine (never `disabled`), create the token with `ray get-auth-token --generate`, and
give every node and driver the token (`~/.ray/auth_token` or `RAY_AUTH_TOKEN`). Inside the
actor, every gradient and step is checked by the in-process object before it touches
the sum: an array of another dtype or shape, or a `local_step` that is not an int, is
the in-process TypeError or ValueError, raised in the caller.

Faults: a worker that dies mid-apply loses nothing already accepted (an apply is
accepted whole or not at all); a chief that dies while blocked in a take consumes
nothing (the actor hands a batch over only to a live caller: checked exactly on
the actor's machine, by a 10 s lease from other machines); if the actor dies, every
blocked or later call raises `AccumulatorUnavailableError`; with `checkpoint_dir` and
`max_restarts`, a restarted actor resumes with its global step and pending gradients.

Modules: `_handle` (what both handles share: the actor, calls, takes), `_dense` and
`_sparse` (the two handles), `_actor` (the actor: the in-process object and the queue
of takes), `_callers` (whether a take's caller is alive), `_checkpoint` (the actor's
checkpoint), `_payload` (how arrays travel).
"""

from optax_accum.ray._dense import ConditionalAccumulator
from optax_accum.ray._handle import AccumulatorUnavailableError
from optax_accum.ray._sparse import SparseConditionalAccumulator

__all__ = ["AccumulatorUnavailableError", "ConditionalAccumulator", "SparseConditionalAccumulator"]
