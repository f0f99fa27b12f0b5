"""TF's host accumulators shared across the processes and machines of a Ray cluster.

`ConditionalAccumulator` and `SparseConditionalAccumulator` here take the in-process
classes' arguments and methods (`optax_accum.ConditionalAccumulator` and
`optax_accum.SparseConditionalAccumulator`), plus `namespace=`, `checkpoint_dir=`,
`max_restarts=` and `lifetime=`, and a tree of arrays where those take one. The
accumulator lives in a Ray actor, named by `shared_name`, that runs the in-process
objects' own core (their checks, rules and queue of takes), summing in NumPy: the
actor imports no JAX. As TF's `shared_name` placed one accumulator on a parameter
server for workers on other machines, every process of the cluster that builds a
handle with that name reaches the same accumulator. `ParameterBoard` is where a
chief publishes each step's parameters and workers wait for the next step (TF's sync
tokens). Install with `pip install "optax-accum[ray]"`.

Who owns it: a named accumulator is a detached actor in the Ray namespace
"optax_accum", owned by no process: dropping a handle, or killing any worker or the
chief, loses nothing; it lives until `kill()` (or the cluster's end). A handle never
starts a second accumulator under a live name: it finds it, and refuses it if its
kind or its options differ; it warns where another namespace holds the name.

Exactly once: every apply and take carries an identity (the handle in its thread,
and a number), so a call repeated after an ambiguous failure, by the caller or by Ray
on a restarted actor, counts once and gets its first answer.

Who can reach it: any process that can join the Ray cluster can reach the
accumulator, apply gradients to it and take them, and Ray runs whatever code the
cluster's members send it. Keep the cluster private: start it on a private address
(`ray start --head --node-ip-address=<private ip>`, behind a firewall that admits only
your machines) and keep Ray's token authentication on: `ray.init()` turns it on for
the local clusters it starts; for `ray start`, set `RAY_AUTH_MODE=token` on every
machine (never `disabled`), create the token with `ray get-auth-token --generate`, and
give every node and driver the token (`~/.ray/auth_token` or `RAY_AUTH_TOKEN`). Inside the
actor, every gradient and step is checked as in-process before it touches the sum:
an array of another dtype or shape, or a `local_step` that is not an int, is the
in-process TypeError or ValueError, raised in the caller.

Faults: a worker that dies mid-apply loses nothing already accepted (an apply is
accepted whole or not at all); a chief that dies while blocked in a take consumes
nothing (the actor hands a batch over only to a live caller: checked exactly on the
actor's machine, by a lease from other machines, whose lapse the caller is told of);
if the actor dies, every blocked or later call raises `AccumulatorUnavailableError`;
with `checkpoint_dir` and `max_restarts`, Ray restarts it, it resumes with its global
step and pending gradients, and the calls in flight are answered once each.

Modules: `_handle` (what both handles share: the actor, identities, calls, takes),
`_dense` and `_sparse` (the two handles), `_payload` (specs, trees, how arrays
travel), `_actor` (the actor), `_kinds` (its NumPy accumulators on the host core),
`_callers` (whether a take's caller is alive), `_checkpoint` (the actor's log),
`_spec` (what an accumulator is, how it was created), `_board` (`ParameterBoard`).
"""

from optax_accum.ray._board import ParameterBoard
from optax_accum.ray._dense import ConditionalAccumulator
from optax_accum.ray._handle import AccumulatorUnavailableError
from optax_accum.ray._sparse import SparseConditionalAccumulator

__all__ = [
    "AccumulatorUnavailableError",
    "ConditionalAccumulator",
    "ParameterBoard",
    "SparseConditionalAccumulator",
]
