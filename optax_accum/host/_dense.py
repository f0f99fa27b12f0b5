"""The dense host accumulator: `ConditionalAccumulator` and its device kernels.

The aggregate lives on a JAX device and is updated by jitted kernels that donate its
buffer; up to `_MAX_PENDING` accepted gradients wait to be added in one pass (which
reads and writes the aggregate once per batch instead of once per gradient, with the
rounding of one add at a time), and the take adds the rest and divides in the same
pass. That pass is dispatched by the thread that hands the batch to the take (under
the lock, as the last gradient comes), so the device is on it before the taker wakes;
and while a take waits, the queued gradients are added as soon as it is one short,
so the hand-off is left with one gradient to add. Weights travel as one float32
vector per kernel (or none), so each kernel compiles in two forms. Nothing recompiles
for same-shape gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _sums
from optax_accum.host import _args
from optax_accum.host._core import Batch, Core, HostAccumulator, Take
from optax_accum.host._device import OnDevice

_MAX_PENDING = 4  # dense gradients added per kernel at most


# --------------------------------------------------------------------------- kernels
# Module-level jits: every accumulator shares their compilation caches.


def _weight(weights: jax.Array | None, i: int) -> jax.Array | None:
    return None if weights is None else weights[i]


def _summed(grads: tuple[jax.Array, ...], weights: jax.Array | None, dtype: Any) -> jax.Array:
    """A fresh buffer holding the sum of `weights[i] * grads[i]` (no `weights`: 1 each),
    added left to right, in `dtype`."""
    if weights is None:
        total = jnp.array(grads[0], dtype, copy=True)  # never aliases an input
    else:
        total = _sums.weighted(grads[0], weights[0], dtype)
    for i, grad in enumerate(grads[1:], 1):
        total = total + _sums.weighted(grad, _weight(weights, i), dtype)
    return total


_sum_as = jax.jit(_summed, static_argnames="dtype")


def _added(
    aggregate: jax.Array, grads: tuple[jax.Array, ...], weights: jax.Array | None
) -> jax.Array:
    """`aggregate` plus each `weights[i] * grads[i]` (no `weights`: 1 each) in turn: the
    rounding of one add at a time, as the functional accumulator's."""
    for i, grad in enumerate(grads):
        aggregate = aggregate + _sums.weighted(grad, _weight(weights, i), aggregate.dtype)
    return aggregate


_add = jax.jit(_added, donate_argnums=0)


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def _finish(
    aggregate: jax.Array | None,
    grads: tuple[jax.Array, ...],
    weights: jax.Array | None,
    divisor: jax.Array | None,
    *,
    acc_dtype: Any,
    dtype: Any,
) -> jax.Array:
    """The take's answer in one pass: the last pending gradients added, then divided by
    `divisor` (MEAN; None: SUM)."""
    if aggregate is None:  # a fresh buffer: the answer must not alias a (pooled) input
        total = _summed(grads, weights, acc_dtype)
    else:
        total = _added(aggregate, grads, weights)
    if divisor is not None:
        total = total / divisor.astype(acc_dtype)
    return total.astype(dtype)


_FINISH_STATIC = ("acc_dtype", "dtype")
_finish_in_place = jax.jit(_finish, donate_argnums=0, static_argnames=_FINISH_STATIC)
_finish_copy = jax.jit(_finish, static_argnames=_FINISH_STATIC)


# --------------------------------------------------------------------------- state


class DenseBatch(Batch):
    """The aggregate (None until the first add) and up to `_MAX_PENDING - 1` accepted
    gradients not added yet, each `(array, staging buffer or None, weight or None)`;
    `in_flight` are the staging buffers the kernel that made `aggregate` reads.
    `grad_shape` is fixed by the first gradient until the take. `weight_sum` is the
    float32 sum of the accepted gradients' weights (1 each without one), and `weighted`
    whether any came with a weight."""

    __slots__ = (
        "aggregate",
        "answer",
        "grad_shape",
        "in_flight",
        "pending",
        "weight_sum",
        "weighted",
    )

    def __init__(self) -> None:
        super().__init__()
        self.aggregate: jax.Array | None = None
        self.pending: tuple[tuple[Any, np.ndarray | None, float | None], ...] = ()
        self.in_flight: tuple[np.ndarray, ...] = ()
        self.grad_shape: tuple[int, ...] | None = None
        self.weight_sum = 0.0
        self.weighted = False
        self.answer: jax.Array | None = None  # the take's result, once dispatched


class DenseCore(OnDevice, Core):
    kind = "ConditionalAccumulator"
    staging_keep = 2 * _MAX_PENDING

    def new_batch(self) -> DenseBatch:
        return DenseBatch()

    def finite(self, x: Any) -> bool:
        """Whether `x` is finite; only asked under `skip_nonfinite` (it syncs)."""
        if isinstance(x, np.ndarray):
            return bool(np.isfinite(x).all())
        with self.device.precision():
            return bool(_all_finite(x))

    def apply(self, grad: Any, local_step: Any, weight: Any = None) -> bool:
        step = _args.check_step("local_step", local_step)
        weight = _args.check_weight(weight)
        grad = _args.as_array(grad, self.dtype, "grad")
        if not _args.compatible(tuple(grad.shape), self.shape):
            raise ValueError(
                f"grad must have a shape compatible with the accumulator's shape "
                f"{_args.fmt(self.shape)}, got {tuple(grad.shape)}"
            )
        finite = self.finite(grad) if self.skip_nonfinite else True
        callers = self.device.is_callers(grad)  # read now, never kept
        array = buffer = None
        if weight == 0:  # adds nothing (not even a NaN): never read
            callers = False
        elif callers:
            array = grad
        elif self.device.is_cpu and not isinstance(grad, jax.Array):
            array = buffer = self.device.stage(np.asarray(grad))
        else:
            array = self.device.own(grad)
        accepted = False
        try:
            with self.lock, self.device.precision():
                batch = self.batch
                if batch.grad_shape is not None and tuple(grad.shape) != batch.grad_shape:
                    raise ValueError(
                        f"grad shape mismatch: expected {batch.grad_shape} (fixed by the first "
                        f"gradient since the last take), got {tuple(grad.shape)}"
                    )
                accepted = self.admit(step, finite)
                if accepted:
                    self._add(batch, tuple(grad.shape), (array, buffer, weight), flush=callers)
                    self.serve()
        finally:
            if not accepted:  # nothing reads it
                self.device.recycle([buffer])
        return accepted

    def _add(self, batch: DenseBatch, shape: tuple[int, ...], entry: tuple, flush: bool) -> None:
        """Adds one accepted gradient `(array, staging buffer, weight)` to `batch` (lock
        held, in the accumulator's precision): queued, or with the queued ones in one
        kernel when the queue is full or `flush` (a caller's array). A gradient of weight
        0 (array None) only counts."""
        array, _, weight = entry
        pending = batch.pending if array is None else (*batch.pending, entry)
        count, new = batch.count + 1, None
        weight_sum = float(
            np.float32(batch.weight_sum) + np.float32(1 if weight is None else weight)
        )
        weighted = batch.weighted or weight is not None
        tail = (shape, count, weight_sum, weighted)
        try:
            if pending and (flush or len(pending) == _MAX_PENDING or self._one_short(count)):
                grads = tuple(g for g, _, _ in pending)
                weights = _args.kernel_weights([w for _, _, w in pending])
                in_flight = tuple(b for _, b, _ in pending if b is not None)
                if batch.aggregate is None:
                    total = _sum_as(grads, weights, dtype=self.acc_dtype)
                else:
                    # Once the last add is done its inputs are free, and waiting for it
                    # keeps one kernel in flight at most: applies never outrun the device.
                    jax.block_until_ready(batch.aggregate)
                    total = _add(batch.aggregate, grads, weights)
                new, freed = (total, (), in_flight, *tail), batch.in_flight
            else:
                new, freed = (batch.aggregate, pending, batch.in_flight, *tail), ()
            self._commit(batch, new)
        except BaseException:  # finish an update whose kernel ran, or drop a consumed batch
            if new is not None and batch.count != count:
                self._commit(batch, new)
            self.discard_if_consumed(batch, batch.aggregate)
            raise
        self.device.recycle(freed)

    @staticmethod
    def _commit(batch: DenseBatch, new: tuple) -> None:
        """Sets every field of `batch` at once (no interruption can land in between)."""
        (
            batch.aggregate,
            batch.pending,
            batch.in_flight,
            batch.grad_shape,
            batch.count,
            batch.weight_sum,
            batch.weighted,
        ) = new

    def _divisor(self, batch: DenseBatch) -> np.ndarray | None:
        """What the take divides the sum by: None under SUM or when it is 1; else the
        count, or with weights their sum (1 when it is 0: the sum is 0 too)."""
        if not self.mean:
            return None
        if batch.weighted:
            weight_sum = np.float32(batch.weight_sum)
            return None if weight_sum in (0, 1) else weight_sum
        # float32, as the weight sum (exact to 2**24 gradients): one form to compile
        return None if batch.count == 1 else np.float32(batch.count)

    def _one_short(self, count: int) -> bool:
        """Whether a waiting take needs just one gradient more than `count`: the queued
        gradients are then added at once, so that its hand-off is left with one pass,
        adding the last gradient and dividing (lock held)."""
        head = self.takes.head()
        return head is not None and count == head.num_required - 1

    def seal(self, batch: DenseBatch, take: Take) -> None:
        """Dispatches the take's answer as the batch is handed over (lock held), so the
        device starts on it before the taker's thread wakes."""
        try:
            with self.device.precision():
                batch.answer = self._answer(batch)
        except Exception:  # left for `reduce` to meet again, in the taker's thread
            return

    def _answer(self, batch: DenseBatch) -> jax.Array:
        """Dispatches the take's result: the pending gradients added, then divided."""
        aggregate, pending = self._adopted(batch)
        if aggregate is not None and aggregate.is_deleted():  # see Core.serve
            raise RuntimeError(
                "take_grad was interrupted at its hand-off after its answer was dispatched "
                "and before it was kept; the take completed and its gradients are lost"
            )
        divisor = self._divisor(batch)
        if aggregate is None and not pending:  # every gradient weighed 0
            return self.device.own(np.zeros(batch.grad_shape, self.dtype))
        if not pending and divisor is None and aggregate.dtype == self.dtype:
            return aggregate  # nothing to add, divide or cast
        finish = _finish_in_place if self.acc_dtype == self.dtype else _finish_copy
        return finish(
            aggregate,
            tuple(g for g, _, _ in pending),
            _args.kernel_weights([w for _, _, w in pending]),
            divisor,
            acc_dtype=self.acc_dtype,
            dtype=self.dtype,
        )

    def reduce(self, batch: DenseBatch) -> jax.Array:
        buffers = (*batch.in_flight, *(b for _, b, _ in batch.pending))
        result = batch.answer if batch.answer is not None else self._answer(batch)
        jax.block_until_ready(result)  # the staging buffers it read are free now
        self.device.recycle(buffers)
        return result

    def _adopted(self, batch: DenseBatch) -> tuple[jax.Array | None, tuple]:
        """The batch's aggregate and pending gradients, with a lone unweighted pending
        gradient that is our own copy in the accumulator's dtype adopted as the
        aggregate."""
        aggregate, pending = batch.aggregate, batch.pending
        if aggregate is None and len(pending) == 1:
            only, buffer, weight = pending[0]
            if buffer is None and weight is None and only.dtype == self.acc_dtype:  # ours
                return only, ()
        return aggregate, pending


# --------------------------------------------------------------------------- public object


class ConditionalAccumulator(HostAccumulator):
    """A thread-safe accumulator of step-tagged dense gradients (TF's object).

    Threads call `apply_grad(grad, local_step)`; a gradient is accepted iff
    `local_step >= global_step`, and a stale one is dropped silently. A learner calls
    `take_grad(num_required)`, which blocks until that many gradients have been
    accepted, then returns their mean (or sum), advances `global_step` by one, and
    resets the counter and aggregate. Takes queue first come, first served. See the
    module docstring for the shared rules (timeouts, cancellation, `shared_name`).

    The aggregate is a JAX array on the default device, updated in place by jitted,
    buffer-donating adds (up to four accepted gradients wait to be added in one pass;
    the take adds the rest and divides in the same pass, dispatched as the last
    gradient comes);
    `take_grad` returns a `jax.Array` of `dtype`. NumPy gradients are copied at once,
    so actors may reuse their buffers; on a CPU device the copies go to a pool of
    aligned host buffers that is reused, so memory holds the aggregate plus up to
    eight gradient-sized buffers. A JAX gradient is added by a kernel dispatched
    before `apply_grad` returns, so the caller may donate or delete it right after.

    Differences from TF: every gradient is validated, stale or not; float16 and
    bfloat16 accumulate in float32 (returned in `dtype`); bfloat16 is supported and
    integer dtypes are a TypeError; an array gradient must already have `dtype`
    (Python numbers and lists are converted); float64 stays float64 even when
    `jax_enable_x64` is off; `reduction_type` may be lower case; `take_grad` takes a
    `timeout`; `skip_nonfinite` is new.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the gradients' shape; None dims (or -1) are unknown, and `shape=None`
        means any shape. The first gradient accepted after a take fixes the shape
        until the next take.
      shared_name: if non-empty, every accumulator built with this name (while one is
        alive) is the same accumulator.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: if True, a fresh gradient holding NaN or Inf is skipped and
        counted in `num_nonfinite` instead of accepted (costs one device sync per
        apply). Default False: accumulated as given, as TF does.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; ValueError when
        `shared_name` is in use by an accumulator of another kind, dtype, shape,
        reduction or `skip_nonfinite`.

    Example:
      >>> import threading, numpy as np, optax_accum
      >>> acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
      >>> workers = [
      ...     threading.Thread(target=acc.apply_grad, args=(np.full(2, x, np.float32),))
      ...     for x in (1.0, 2.0, 6.0)
      ... ]
      >>> for w in workers:
      ...     w.start()
      >>> acc.take_grad(3, timeout=10.0)  # blocks until three gradients are in
      Array([3., 3.], dtype=float32)
      >>> for w in workers:
      ...     w.join()
      >>> acc.apply_grad(np.ones(2, np.float32), local_step=0)  # stale now: dropped
      False
      >>> acc.global_step, acc.num_accumulated()
      (1, 0)
    """

    _core_type = DenseCore

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, skip_nonfinite)

    def apply_grad(self, grad: Any, local_step: int = 0, *, weight: Any = None) -> bool:
        """Offers a gradient computed at `local_step`; returns whether it was accepted.

        A stale gradient (`local_step < global_step`) is dropped silently (returns
        False). If the apply brings the count to the `num_required` of the oldest
        waiting take, that take completes here and `global_step` advances at once
        (unless it has a `grace_period` to wait out first).

        Args:
          grad: a NumPy or JAX array of the accumulator's dtype (or Python numbers);
            never kept: the caller may reuse, donate or delete it once this returns.
          local_step: the global step the gradient was computed at.
          weight: how much the gradient counts (not in TF), e.g. the tokens its batch
            held: a non-negative, finite real scalar; None means 1. MEAN then takes
            `sum(weight * grad) / sum(weight)` over the accepted gradients (zeros when
            the weights sum to 0), SUM `sum(weight * grad)`, as the functional
            `conditional_accumulator`'s `weight` does. A gradient of weight 0 adds
            nothing, not even a NaN, but counts towards `num_required`.

        Returns:
          True if accepted, False if dropped (stale, or non-finite under
          `skip_nonfinite`).

        Raises:
          TypeError: for a wrong dtype, a non-int `local_step` or a non-real `weight`.
          ValueError: for a shape incompatible with the accumulator's, or differing
            from the gradients accumulated since the last take, a deleted JAX array,
            or a negative, infinite or NaN `weight`. Nothing changes.
        """
        return self._core.apply(grad, local_step, weight)

    def take_grad(
        self,
        num_required: int,
        timeout: float | None = None,
        *,
        grace_period: float | None = None,
    ) -> jax.Array:
        """Blocks until `num_required` gradients are in, then returns their aggregate.

        Takes are served in the order they were called: a waiting take holds back
        every later one. On completion the global step advances by one and the counter
        and aggregate reset. MEAN divides by every accepted gradient (or their weight
        sum), which can be more than `num_required`.

        With `grace_period` (not in TF), `num_required` is a quorum: once it is
        reached the take waits up to that many seconds more, still at the head of the
        queue, and then takes every gradient accepted by then. Gradients computed at
        the current step keep being accepted meanwhile (the global step advances only
        when the take completes), so a straggler that arrives within the window is
        used instead of being dropped as stale: the minimum quorum and grace window
        of Decoupled DiLoCo (arXiv 2604.21428). `timeout` bounds the wait for the
        quorum only; once it is reached the take completes after the grace period.
        Later takes wait behind it; `cancel_waiting_takes` or an exception in the
        taker's thread (KeyboardInterrupt included) withdraws it during the window too,
        consuming nothing.

        Args:
          num_required: a positive int, or a 0-d integer NumPy or JAX array (as TF
            takes a tensor).
          timeout: seconds to wait for `num_required` gradients at most; None or
            `float("inf")` waits forever.
          grace_period: seconds to wait on once `num_required` gradients are in (a
            non-negative, finite number); None or 0 takes them at once, as TF does.

        Returns:
          A `jax.Array` of the accumulator's dtype.

        Raises:
          ValueError / TypeError: for a bad `num_required`, `timeout` or
            `grace_period` (no change).
          TimeoutError: when `timeout` passed before `num_required` gradients were
            in; the take is withdrawn.
          concurrent.futures.CancelledError: if `cancel_waiting_takes` was called.
          Any device error while reducing: the take had completed (the global step
            advanced, the counter reset), and its gradients are lost with it; the
            accumulator goes on, consistent and usable.

        Example:
          >>> import threading, time, numpy as np, optax_accum
          >>> acc = optax_accum.ConditionalAccumulator(np.float32, shape=())
          >>> acc.apply_grad(np.float32(1.0), weight=3)  # e.g. 3 tokens
          True
          >>> late = threading.Timer(0.01, acc.apply_grad, (np.float32(5.0),))
          >>> late.start()  # a straggler, still at step 0
          >>> acc.take_grad(1, timeout=10.0, grace_period=1.0)  # (3 * 1 + 5) / 4
          Array(2., dtype=float32)
          >>> late.join()
        """
        return self._core.take(num_required, timeout, grace_period)
