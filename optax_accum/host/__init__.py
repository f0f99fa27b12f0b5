"""TF-compatible host accumulators: threads apply gradients, a learner blocks on a take.

TF1's `tf.ConditionalAccumulator` and `tf.sparse.SparseConditionalAccumulator` are
stateful objects shared by threads: actors call `apply_grad(grad, local_step)`, and a
learner calls `take_grad(num_required)`, which blocks until that many up-to-date
gradients have arrived and returns their mean. `ConditionalAccumulator` and
`SparseConditionalAccumulator` are the same objects in Python. The bookkeeping (step,
counter, the queue of waiting takes) is plain Python under one lock; the aggregate
lives on a JAX device and is updated by jitted kernels, and nothing recompiles for
same-shape gradients.

Rules shared by both (TF's):

- A gradient is accepted iff `local_step >= global_step`; a stale one is dropped
  silently. Every gradient is validated first, stale or not, and a rejected one
  (ValueError/TypeError) leaves the accumulator exactly as it was.
- Takes are served first come, first served, with head-of-line blocking: a waiting
  `take_grad(3)` holds back a later `take_grad(1)`. A take (without a grace period)
  completes inside the apply that brings the count to its `num_required`:
  `global_step` advances at once, and the gradients accepted so far (ALL of them; MEAN
  divides by their number, or their weight sum) go to the waiting thread, which
  reduces them while the counter and aggregate start again.
- `take_grad(..., timeout=t)` raises `TimeoutError` after `t` seconds and leaves no
  trace: the abandoned take never consumes gradients later. `timeout=None` or
  `float("inf")` waits forever. `cancel_waiting_takes()` (TF's session close) makes
  every waiting take raise `concurrent.futures.CancelledError`.

Beyond TF (asked for in tensorflow issue #11660, and by Decoupled DiLoCo, arXiv
2604.21428, whose syncer merges learners' updates weighted by tokens once a minimum
quorum is in and a grace window has passed):

- `apply_grad` returns True when the gradient was accepted, False when dropped.
- `apply_grad(..., weight=w)` weighs a gradient (a non-negative, finite real scalar;
  None means 1): MEAN takes `sum(w * g) / sum(w)` (per row for the sparse object: the
  weights of the gradients that touched it), SUM `sum(w * g)`, as the functional
  accumulators' `weight`. Weights summing to 0 give zeros; a weight-0 gradient counts
  towards `num_required` and adds nothing, not even a NaN.
- `take_grad(n, timeout, grace_period=g)` waits for the quorum `n` (bounded by
  `timeout`), then `g` seconds more at the head of the queue, still accepting
  gradients of the current step, and takes everything accepted by then. Later takes
  wait behind it; cancellation or an exception in the taker (KeyboardInterrupt
  included) during the window withdraws it, consuming nothing; `set_global_step`
  during the window drops older gradients from then on, and the take advances the
  step from the value set.
- A non-empty `shared_name` returns the same underlying accumulator for every object
  built with that name while one of them is alive; a different kind, dtype, shape,
  reduction or `skip_nonfinite` under that name is a ValueError.

Threads: the objects belong to no thread. Any thread may build, apply, take or
cancel (as the methods of a Ray actor run on a pool of threads), and a `shared_name`
finds the same accumulator from any thread of the process.

Faults: an accumulator never keeps a caller's array past `apply_grad` (NumPy input is
copied; a JAX array is copied or read by a kernel dispatched before the apply
returns), so callers may reuse, donate or delete their arrays at once. An exception
in any call, KeyboardInterrupt included, leaves the counter and the aggregate
consistent and every other waiting take served or timing out at its deadline.

Modules: `_takes` (the queue of takes and its deadlines), `_core` (step, counters,
hand-off, shared names), `_dense` and `_sparse` (the two accumulators), `_slots` (the
sparse one's slot table: which row id each slot holds), `_args` and `_device`
(argument checks, buffers the accumulator owns). `_core`, `_takes`, `_slots` and
`_args` are NumPy and Python only: the Ray actor shares them without importing JAX,
so the two classes are imported on first use.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optax_accum.host._dense import ConditionalAccumulator
    from optax_accum.host._sparse import SparseConditionalAccumulator

_LAZY = {
    "ConditionalAccumulator": "optax_accum.host._dense",
    "SparseConditionalAccumulator": "optax_accum.host._sparse",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'optax_accum.host' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ConditionalAccumulator", "SparseConditionalAccumulator"]
