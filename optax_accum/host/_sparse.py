"""The sparse host accumulator: `SparseConditionalAccumulator` (its kernels: `_row_kernels`).

Rows live on a JAX device in slots, in arrival order, in a buffer that grows by powers
of two (no fixed capacity); the row id and count of each slot are NumPy on the host,
in the slot table of `_slots`, whose hints (row id to slot) find a gradient's slots in
O(nnz). TF's checks of a gradient are in `_args`. A gradient's rows are scattered into
their slots by one jitted kernel that donates the buffer; its row count is padded to a
power of two, so compilations stay bounded however the sizes vary. The first gradient
after a take, sorted and unique as TF expects, becomes the buffer itself. When a batch
is handed to a take, the thread handing it over sorts the slots by row id and
dispatches the gather (so it runs right after the batch's scatters, not behind the
next batch's); the taker then only waits for it. A take whose slots are already in row
order and need no division returns the buffer as it is; otherwise the buffer is kept
for a later batch (no fresh, zeroed allocation per batch: a slot is zeroed when it is
assigned). Likewise a NumPy gradient is copied into a pooled staging buffer, not a
fresh one (a page fault per page), handed back once the scatters that read it are
done: when an apply waits for them, or at the take.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.host import _args, _row_kernels
from optax_accum.host._core import Batch, Core, HostAccumulator, Take
from optax_accum.host._device import OnDevice, aligned_empty
from optax_accum.host._slots import SlotHints, bucket, sorted_slots, unique_ids
from optax_accum.indexed_slices import IndexedSlices

_MAX_UNSETTLED = 4  # scatters in flight at most
# Seconds an apply waits at most for the taker of a batch just handed over to wake. All
# threads share the GIL: a woken taker otherwise queues behind the appliers for it (a
# mean of 1-3 ms under 4 applying threads), and takes per second hinge on that taker.
_YIELD_TO_TAKER = 0.002


# --------------------------------------------------------------------------- state


class _Rows(NamedTuple):
    """One accepted gradient's rows: its sorted unique ids, where each value goes among
    them (None when the ids came sorted and unique), the values (padded to a bucketed
    count), how many of them are real, and its weight (None: 1)."""

    unique: np.ndarray
    inverse: np.ndarray | None
    values: Any
    nnz: int
    weight: float | None


class SparseBatch(Batch):
    """Rows since the last take. `rows` (None until the first row) is the device buffer
    of `rows.shape[0]` slots, of which the first `len(slot_ids)` are used, in arrival
    order: `slot_ids[s]` is the row id in slot `s`, `row_counts[s]` how many accepted
    gradients touched it and `row_weights[s]` the float32 sum of their weights, kept
    once a gradient with rows came with a weight (None before). MEAN divides by the
    count, or then by the weight sum. `values_shape` is fixed by the first gradient
    until the take."""

    __slots__ = (
        "answer",
        "in_flight",
        "row_counts",
        "row_weights",
        "rows",
        "slot_ids",
        "unsettled",
        "values_shape",
    )

    def __init__(self) -> None:
        super().__init__()
        self.rows: jax.Array | None = None
        self.values_shape: tuple[int, ...] | None = None
        self.slot_ids = np.zeros(0, np.int64)
        self.row_counts = np.zeros(0, np.int64)
        self.row_weights: np.ndarray | None = None  # while unweighted: the counts
        self.unsettled = 0  # scatters dispatched since the last wait
        self.in_flight: tuple[np.ndarray, ...] = ()  # staging buffers scatters may still read
        self.answer: tuple | None = None  # (row ids, rows, n) once the take's gather is dispatched


class SparseCore(OnDevice, Core):
    kind = "SparseConditionalAccumulator"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.capacity_hint = 0  # the largest buffer so far: later batches start there
        self.spare: jax.Array | None = None  # a taken batch's buffer, for the next batch
        self.hints = SlotHints()
        self.taker_awake = threading.Event()  # cleared at a hand-off, set when its taker runs
        self.taker_awake.set()

    def new_batch(self) -> SparseBatch:
        return SparseBatch()

    def finite(self, values: Any) -> bool:
        """Whether `values` is finite; only asked under `skip_nonfinite` (it syncs)."""
        return bool(np.isfinite(np.asarray(jax.device_get(values), np.float32)).all())

    def apply(
        self, indices: Any, values: Any, grad_shape: Any, local_step: Any, weight: Any = None
    ) -> bool:
        if not self.taker_awake.is_set():  # let the taker of the last hand-off run first
            self.taker_awake.wait(_YIELD_TO_TAKER)
        step = _args.check_step("local_step", local_step)
        weight = _args.check_weight(weight)
        ids, values = _args.check_sparse_grad(indices, values, grad_shape, self.shape, self.dtype)
        nnz = ids.shape[0]
        finite = self.finite(values) if self.skip_nonfinite else True
        unique, inverse = unique_ids(ids)
        values, staged, callers = self._own_rows(values, nnz)
        accepted = False
        try:
            with self.lock, self.device.precision():
                batch = self.batch
                _args.check_rows_like(values, batch.values_shape)
                accepted = self.admit(step, finite)
                if accepted:
                    grad = _Rows(unique, inverse, values, nnz, weight)
                    self._add_rows(batch, grad, staged, ours=not callers)
                    self.serve()
        finally:
            if not accepted:  # nothing reads it
                self.device.recycle([staged])
        return accepted

    def _own_rows(self, values: Any, nnz: int) -> tuple[Any, np.ndarray | None, bool]:
        """The values, their rows padded to a bucketed count, as an array a kernel may
        read (a device array, or on a CPU device the staging buffer itself, which the
        jitted call adopts as it is); with the staging buffer, if any, and whether it is
        the caller's. A caller's JAX array on our device that needs no padding is used as
        it is (read by a kernel now, never kept); other values are copied, on a CPU
        device into a pooled staging buffer (a fresh megabyte costs a page fault per
        page)."""
        padded = bucket(nnz) if nnz else 0
        if nnz == padded and self.device.is_callers(values):
            return values, None, True
        if self.device.is_cpu and nnz and (nnz != padded or not isinstance(values, jax.Array)):
            # No `device_put` here: its Python costs 0.1-0.2 ms an apply, under the GIL.
            staged = self.device.stage(np.asarray(values), padded)
            return staged, staged, False
        if nnz != padded:  # rows padded to a bucketed count
            grown = np.zeros((padded, *values.shape[1:]), values.dtype)
            grown[:nnz] = np.asarray(values)
            values = grown
        return self.device.own(values), None, False

    def _add_rows(
        self, batch: SparseBatch, grad: _Rows, staged: np.ndarray | None, ours: bool
    ) -> None:
        """Adds one accepted gradient's rows to `batch` (lock held, in the accumulator's
        precision), changing it in one assignment once the kernel is dispatched."""
        unique, _, values, nnz, _ = grad
        values_shape = (0, *values.shape[1:])
        if nnz == 0:
            batch.values_shape, batch.count = values_shape, batch.count + 1
            return
        count, new, settled = batch.count + 1, None, ()
        try:
            if self._becomes_buffer(batch, grad, ours):  # no kernel
                if isinstance(values, np.ndarray):  # a staging buffer: adopted, for good
                    values = jax.device_put(values, may_alias=True)
                self.hints.remember(unique, np.arange(nnz, dtype=np.int32), unique)
                weights = None if grad.weight is None else np.ones(nnz, np.float32)
                first = (values, unique, np.ones(nnz, np.int64), weights)
                new = (*first, values_shape, 0, batch.in_flight)
            else:
                out, slot_ids, counts, weights, unsettled, waited = self._scatter(batch, grad)
                in_flight = batch.in_flight
                if waited:  # the earlier scatters are done: their staging buffers are free
                    settled, in_flight = in_flight, ()
                in_flight += (staged,) if staged is not None else ()
                new = (out, slot_ids, counts, weights, values_shape, unsettled, in_flight)
            self._commit(batch, (*new, count))
        except BaseException:  # finish an update whose kernel ran, or drop a consumed batch
            if new is not None and batch.count != count:
                self._commit(batch, (*new, count))
            self.discard_if_consumed(batch, batch.rows)
            raise
        self.device.recycle(settled)

    def _becomes_buffer(self, batch: SparseBatch, grad: _Rows, ours: bool) -> bool:
        """Whether the gradient's values become the batch's buffer as they are: the
        first rows since the take, sorted and unique, unweighted (or of weight 1), our
        own copy (its staging buffer, if any, goes with it: never recycled) in the
        accumulator's dtype, and no taken batch's buffer to fill. With a spare they go
        into it instead: a second gradient would grow a buffer of exactly their rows, in
        a kernel that XLA:CPU runs inline (0.6-0.9 ms under the lock)."""
        return (
            batch.rows is None
            and self.spare is None
            and grad.inverse is None
            and _args.kernel_weight(grad.weight) is None
            and ours
            and grad.values.dtype == self.acc_dtype
        )

    def _scatter(self, batch: SparseBatch, grad: _Rows) -> tuple:
        """Dispatches the kernel adding a gradient's rows to the batch's buffer, growing
        it if they do not fit; returns the new buffer and bookkeeping, and whether the
        batch's earlier scatters are done (it found them done, or waited for them when
        too many were in flight), so that their staging buffers are free (lock held)."""
        unique, inverse, values, nnz, weight = grad
        rows, known = batch.rows, batch.slot_ids.shape[0]
        ids, counts, weights, slot_of = self.hints.place(
            batch.slot_ids, batch.row_counts, batch.row_weights, unique, inverse, weight
        )
        grow = rows is None or ids.shape[0] > rows.shape[0]
        target = self._buffer(ids.shape[0], values.shape[1:]) if grow else rows
        # Index vectors as long as the (bucketed) values: padding points past the end.
        per_value = slot_of
        if nnz != values.shape[0]:
            per_value = np.full(values.shape[0], target.shape[0], np.int32)
            per_value[:nnz] = slot_of
        unsettled, waited = (0 if grow else batch.unsettled + 1), False
        if unsettled > _MAX_UNSETTLED:  # a few scatters in flight at most
            rows.block_until_ready()
            unsettled, waited = 0, True
        elif batch.in_flight and rows is not None and rows.is_ready():  # done: no wait
            unsettled, waited = 0, True
        scale = _args.kernel_weight(weight)
        args = (np.int32(known), per_value, values, scale)  # slots from `known` on are new
        # Distinct slots: no repeated row id (a kernel for each case at most, per bucket).
        distinct = scale is None and unique.shape[0] == nnz
        if not grow:
            out = _row_kernels.scatter_add(rows, *args, distinct=distinct)
        elif rows is None:
            out = _row_kernels.scatter_add(target, *args, distinct=distinct)
        else:
            out = _row_kernels.scatter_grow(target, rows, *args, distinct=distinct)
        return out, ids, counts, weights, unsettled, waited

    def _buffer(self, n: int, row_shape: tuple[int, ...]) -> jax.Array:
        """A buffer of at least `n` slots of `row_shape` for a batch: a taken batch's, or
        a new one as large as the largest so far (lock held)."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.shape[0] >= n and spare.shape[1:] == row_shape:
            return spare
        self.capacity_hint = max(self.capacity_hint, bucket(n))
        return jnp.zeros((self.capacity_hint, *row_shape), self.acc_dtype)

    def _recycle(self, rows: jax.Array | None) -> None:
        """Keeps a taken batch's buffer, once its gather is dispatched, for a later batch
        (no lock: a race at worst drops a buffer)."""
        if rows is None:  # a batch of gradients with no rows has no buffer
            return
        spare = self.spare
        if spare is None or spare.shape[0] <= rows.shape[0]:
            self.spare = rows

    @staticmethod
    def _commit(batch: SparseBatch, new: tuple) -> None:
        """Sets every field of `batch` at once (no interruption can land in between)."""
        (
            batch.rows,
            batch.slot_ids,
            batch.row_counts,
            batch.row_weights,
            batch.values_shape,
            batch.unsettled,
            batch.in_flight,
            batch.count,
        ) = new

    def seal(self, batch: SparseBatch, take: Take) -> None:
        """Dispatches the take's gather as the batch is handed over, so it runs right
        after the batch's own scatters, not behind the next batch's (lock held). New
        applies hold back until the taker runs (see `_YIELD_TO_TAKER`)."""
        self.taker_awake.clear()
        if batch.rows is None:
            return
        try:
            with self.device.precision():
                answer = self._answer(batch)
        except Exception:  # left for the taker's `reduce` to meet again
            return
        batch.answer = answer
        if answer[1] is not batch.rows:
            self._recycle(batch.rows)

    def reduce(self, batch: SparseBatch) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        self.taker_awake.set()  # the taker runs: applies may go on
        dims = (self.shape[0] if self.shape and self.shape[0] is not None else -1,)
        dims += tuple(batch.values_shape[1:])
        if batch.answer is None:
            batch.answer = self._answer(batch)
            if batch.answer[1] is not batch.rows:
                self._recycle(batch.rows)
        ids, taken, n = batch.answer
        if taken.shape[0] == n:  # no cut
            if batch.in_flight:  # the scatters that read them are done once the answer is
                jax.block_until_ready(taken)
                self.device.recycle(batch.in_flight)
            if self.device.is_cpu:
                return jax.device_put(ids, may_alias=True), taken, dims
            return self.device.own(ids), taken, dims
        # Cut to the n real rows on the host: a device slice compiles once per n. On a
        # CPU device the cut is a view of `taken`, which nothing writes again; it goes
        # to the device with the row ids in one call (each JAX call gives the GIL away).
        cut = np.asarray(taken)[:n]  # waits for the gather, so for the scatters
        if batch.in_flight:
            self.device.recycle(batch.in_flight)
        if self.device.is_cpu:
            indices, values = jax.device_put((ids, cut), may_alias=True)
            return indices, values, dims
        return self.device.own(ids), self.device.own(cut), dims

    def _answer(self, batch: SparseBatch) -> tuple[np.ndarray, jax.Array, int]:
        """The sorted row ids (int32 NumPy, aligned: JAX can adopt them on a CPU device),
        the rows (at least as many, dispatched), and their count. No JAX call but the
        gather's: at the hand-off this runs under the lock."""
        sorted_ids, order, segments = sorted_slots(batch.slot_ids)
        n = sorted_ids.shape[0]
        ids = aligned_empty((n,), np.dtype(np.int32))
        np.copyto(ids, sorted_ids, casting="unsafe")  # row ids are checked to fit int32
        if n == 0:
            return ids, jnp.zeros((0, *batch.values_shape[1:]), self.dtype), 0
        return (
            ids,
            self._gather_rows(batch.rows, order, segments, self._divisors(batch, order, segments)),
            n,
        )

    @staticmethod
    def _divisors(batch: SparseBatch, order: np.ndarray, segments: np.ndarray | None) -> np.ndarray:
        """What MEAN divides each row of the answer by: the number of gradients that
        touched it (int64), or with weights their weight sum (float32; 1 where it is 0,
        the row's sum being 0 too)."""
        weighted = batch.row_weights is not None  # else every row's weights are its count
        per_slot = batch.row_weights if weighted else batch.row_counts
        divisors = per_slot[order]
        if segments is not None:  # a row id in several slots: their counts add up
            divisors = np.bincount(segments, weights=divisors).astype(per_slot.dtype)
        if weighted:
            divisors = np.where(divisors > 0, divisors, np.float32(1))
        return divisors

    def _gather_rows(
        self, rows: jax.Array, order: np.ndarray, segments: np.ndarray | None, counts: np.ndarray
    ) -> jax.Array:
        """The rows of the answer, at least `len(counts)` of them: `rows[order]` (with
        the slots of one `segments` entry added together), divided by `counts` under
        MEAN. The buffer itself when nothing needs doing."""
        n = order.shape[0]
        if (
            segments is None
            and (order == np.arange(n)).all()
            and (not self.mean or (counts == 1).all())
            and rows.dtype == self.dtype
        ):
            return rows  # slots already sorted, nothing to divide: no kernel
        # Gather a bucketed n rows, not the whole buffer (compiles once per bucket).
        size = bucket(n)
        padded_order = np.zeros(size, np.int32)
        padded_order[:n] = order
        padded_counts = np.ones(size, np.float32 if counts.dtype == np.float32 else np.int32)
        padded_counts[: counts.shape[0]] = counts
        how = {"mean": self.mean, "dtype": self.dtype}
        if segments is None:
            taken = _row_kernels.gather_copy(rows, padded_order, padded_counts, **how)
        else:
            padded_segments = np.full(size, size, np.int32)  # padding: dropped
            padded_segments[:n] = segments
            taken = _row_kernels.merge_copy(
                rows, padded_order, padded_segments, padded_counts, **how
            )
        return taken


# --------------------------------------------------------------------------- public object


class SparseConditionalAccumulator(HostAccumulator):
    """A thread-safe accumulator of step-tagged row-sparse gradients (TF's object).

    The sparse sibling of `ConditionalAccumulator`, with the same step, take-queue,
    timeout, cancellation and `shared_name` rules. A gradient is
    `(indices, values, dense_shape)`: `values[i]` is a row of the gradient at row id
    `indices[i]`. MEAN is per row: each row of the answer is divided by the number of
    accepted gradients that touched that row. The answer's indices are sorted and
    unique; its shape is the accumulator's `shape[0]` (or -1 when unknown) followed
    by the values' row dims.

    The rows live on a JAX device in a buffer that grows by powers of two (no fixed
    capacity); gradients' row counts are padded to powers of two, so compilations
    stay bounded however the sizes vary. Row bookkeeping is NumPy on the host. The
    thread that completes a take's count dispatches its gather (sorted rows, divided
    under MEAN); the taker waits for it.

    Differences from TF: a gradient means its dense tensor, so duplicate indices
    within one gradient are summed into one row that counts once, and unsorted input
    is fine (TF returns duplicate rows there); negative indices are rejected; a values
    dtype other than the accumulator's is a TypeError (TF crashes the process); every
    gradient is validated, stale or not; plus the dense object's differences.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the dense shape of the gradients; None dims (or -1) are unknown. Indices
        must be below `shape[0]` when it is known.
      shared_name: as for `ConditionalAccumulator`.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: as for `ConditionalAccumulator`.

    Raises:
      TypeError / ValueError: as for `ConditionalAccumulator`.

    Example:
      >>> import numpy as np, optax_accum
      >>> acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
      >>> acc.apply_grad([0, 1], np.array([[1, 0], [0, 2]], np.float32))
      True
      >>> acc.apply_grad([2, 0], np.array([[3, 0], [0, 1]], np.float32))
      True
      >>> indices, values, shape = acc.take_grad(2, timeout=10.0)
      >>> indices.tolist(), values.tolist(), shape
      ([0, 1, 2], [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]], (4, 2))
    """

    _core_type = SparseCore

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, skip_nonfinite)

    def apply_grad(
        self,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Any = None,
        local_step: int = 0,
        *,
        weight: Any = None,
    ) -> bool:
        """Offers a sparse gradient computed at `local_step`; returns whether accepted.

        Checked in TF's order (indices a vector; values at least 1-D with one row per
        index; `grad_shape` against the accumulator's known dims; indices within
        `shape[0]` and not negative; values' rows against the accumulator and the
        gradients since the last take). An empty gradient (no rows) is accepted and
        counts. Duplicate indices are summed and count once.

        Args:
          grad_indices: an integer vector of row ids (NumPy, JAX or a list).
          grad_values: `[len(grad_indices), ...]` rows of the accumulator's dtype;
            never kept: the caller may reuse, donate or delete them once this returns.
          grad_shape: the gradient's dense shape (a sequence, or a NumPy or JAX
            integer vector), or None / empty.
          local_step: the global step the gradient was computed at.
          weight: how much the gradient counts (not in TF): a non-negative, finite
            real scalar; None means 1. Each of its rows adds `weight * row`, and MEAN
            divides each row of the answer by the weight sum of the gradients that
            touched it, as the functional `sparse_conditional_accumulator` does. A row
            touched only by gradients of weight 0 comes back as zeros.

        Returns:
          True if accepted, False if dropped (stale, or non-finite under
          `skip_nonfinite`).

        Raises:
          TypeError: for a wrong values dtype, non-integer indices or `local_step`, a
            non-real `weight`.
          ValueError: for any shape or index check above, or a negative, infinite or
            NaN `weight`. Nothing changes.
        """
        return self._core.apply(grad_indices, grad_values, grad_shape, local_step, weight)

    def apply_indexed_slices_grad(
        self, grad: IndexedSlices, local_step: int = 0, *, weight: Any = None
    ) -> bool:
        """`apply_grad` for an `IndexedSlices` gradient.

        Rows at the padding index (`grad.padding_index`: `dense_shape[0]`, or the
        int32 maximum when the row count is unknown, as the functional
        `sparse_conditional_accumulator` pads) are left out; every other index is
        checked as in `apply_grad`.

        Args:
          grad: the gradient.
          local_step: the global step the gradient was computed at.
          weight: as for `apply_grad`.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError: if `grad` is not an `IndexedSlices`; otherwise as `apply_grad`.
        """
        if not isinstance(grad, IndexedSlices):
            raise TypeError(f"grad must be an optax_accum.IndexedSlices, got {type(grad).__name__}")
        indices, values = grad.indices, grad.values
        if hasattr(indices, "shape") and len(indices.shape) == 1:
            keep = np.asarray(jax.device_get(indices)) != grad.padding_index
            if not keep.all():
                indices, values = np.asarray(indices)[keep], np.asarray(values)[keep]
        return self._core.apply(indices, values, grad.dense_shape, local_step, weight)

    def take_grad(
        self,
        num_required: int,
        timeout: float | None = None,
        *,
        grace_period: float | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        """Blocks until `num_required` gradients are in; returns their aggregate rows.

        Served first come, first served, as `ConditionalAccumulator.take_grad`, with
        the same `grace_period`.

        Args:
          num_required: a positive int, or a 0-d integer NumPy or JAX array.
          timeout: seconds to wait for `num_required` gradients at most; None or
            `float("inf")` waits forever.
          grace_period: seconds to wait on once `num_required` gradients are in,
            taking every gradient accepted by then; None or 0: none.

        Returns:
          `(indices, values, shape)`: sorted unique int32 row ids, their rows (MEAN
          per row, or SUM) in the accumulator's dtype, and the dense shape as a tuple
          of ints (dim 0 is -1 when the accumulator's is unknown).

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return self._core.take(num_required, timeout, grace_period)

    def take_indexed_slices_grad(
        self,
        num_required: int,
        timeout: float | None = None,
        *,
        grace_period: float | None = None,
    ) -> IndexedSlices:
        """`take_grad`, returning an `IndexedSlices`.

        Args:
          num_required: a positive int, or a 0-d integer NumPy or JAX array.
          timeout: seconds to wait for `num_required` gradients at most; None or
            `float("inf")` waits forever.
          grace_period: as for `take_grad`.

        Returns:
          `IndexedSlices(indices, values, shape)` as `take_grad` returns them.

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return IndexedSlices(*self.take_grad(num_required, timeout, grace_period=grace_period))
