"""The sparse host accumulator: `SparseConditionalAccumulator` and its device kernels.

Rows live on a JAX device in slots, in arrival order, in a buffer that grows by
powers of two (no fixed capacity); the row ids, the slot of each and how many
gradients touched it are NumPy on the host. A gradient's rows are scattered into
their slots by one jitted kernel that donates the buffer; its row count is padded to
a power of two, so compilations stay bounded however the sizes vary. The first
gradient after a take, sorted and unique as TF expects, becomes the buffer itself,
and a take whose slots are already in row order and need no division returns the
buffer as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.host import _args
from optax_accum.host._core import Batch, Core, HostAccumulator
from optax_accum.indexed_slices import IndexedSlices

_MIN_BUCKET = 8
_MAX_UNSETTLED = 4  # scatters in flight at most
_INT32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------- kernels
# Module-level jits: every accumulator shares their compilation caches.


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_add(rows: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Adds `values[i]` to `rows[slots[i]]`; slots out of range are padding, dropped."""
    return rows.at[slots].add(values.astype(rows.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("capacity", "dtype"))
def _scatter_fresh(
    rows: jax.Array | None, slots: jax.Array, values: jax.Array, capacity: int, dtype: Any
) -> jax.Array:
    """`_scatter_add` into a new buffer of `capacity` rows holding `rows` (or zeros)."""
    fresh = jnp.zeros((capacity, *values.shape[1:]), dtype)
    if rows is not None:
        fresh = jax.lax.dynamic_update_slice_in_dim(fresh, rows, 0, axis=0)
    return fresh.at[slots].add(values.astype(dtype), mode="drop")


def _gather(
    rows: jax.Array, order: jax.Array, counts: jax.Array, *, mean: bool, dtype: Any
) -> jax.Array:
    """`rows[order]`, each divided by its count under MEAN (padding counts are 1)."""
    taken = rows[order]
    if mean:
        taken = taken / counts.astype(rows.dtype).reshape((-1,) + (1,) * (rows.ndim - 1))
    return taken.astype(dtype)


_gather_copy = jax.jit(_gather, static_argnames=("mean", "dtype"))


def _bucket(n: int) -> int:
    """The smallest power of two >= max(n, _MIN_BUCKET): sizes that bound compilations."""
    return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


# --------------------------------------------------------------------------- state


class SparseBatch(Batch):
    """Rows since the last take. `rows` (None until the first row) is the device buffer
    of `rows.shape[0]` slots; `slot_ids`/`sorted_slots` index the slots by row id
    (sorted), for lookups and for the sorted answer; `row_counts[s]` is how many
    accepted gradients touched slot `s` (MEAN divides each row by it); `values_shape`
    is fixed by the first gradient until the take."""

    __slots__ = ("row_counts", "rows", "sorted_ids", "sorted_slots", "unsettled", "values_shape")

    def __init__(self) -> None:
        super().__init__()
        self.rows: jax.Array | None = None
        self.values_shape: tuple[int, ...] | None = None
        self.sorted_ids = np.zeros(0, np.int64)
        self.sorted_slots = np.zeros(0, np.int32)
        self.row_counts = np.zeros(0, np.int64)
        self.unsettled = 0  # scatters dispatched since the last wait


class SparseCore(Core):
    kind = "SparseConditionalAccumulator"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.capacity_hint = 0  # the largest buffer so far: later batches start there

    def new_batch(self) -> SparseBatch:
        return SparseBatch()

    def finite(self, values: Any) -> bool:
        """Whether `values` is finite; only asked under `skip_nonfinite` (it syncs)."""
        return bool(np.isfinite(np.asarray(jax.device_get(values), np.float32)).all())

    def _validate(self, indices: Any, values: Any, grad_shape: Any) -> tuple[np.ndarray, Any]:
        """TF's checks, in TF's order, that need no lock; returns host indices, values."""
        if not hasattr(indices, "shape"):
            listed = np.asarray(indices)
            indices = listed.astype(np.int32) if listed.size == 0 else listed
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"grad_indices must be integers, got dtype {indices.dtype}")
        if len(indices.shape) != 1:
            raise ValueError(f"grad_indices must be a vector, got shape {list(indices.shape)}")
        values = _args.as_array(values, self.dtype, "grad_values")
        if len(values.shape) == 0:
            raise ValueError("grad_values cannot be 0-dimensional; expected [nnz, ...]")
        if values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"grad_values must have one row per index: expected {indices.shape[0]} "
                f"rows, got {values.shape[0]}"
            )
        known = self.shape
        grad_shape = _args.check_shape(grad_shape, "grad_shape")
        if grad_shape and known is not None:
            if len(grad_shape) < len(known):
                raise ValueError(
                    f"grad_shape must have rank at least {len(known)} (the accumulator's "
                    f"shape {_args.fmt(known)}), got {_args.fmt(grad_shape)}"
                )
            for i, (k, g) in enumerate(zip(known, grad_shape, strict=False)):
                if k is not None and g is not None and k != g:
                    raise ValueError(
                        f"grad_shape dim {i} must be {k} (the accumulator's shape "
                        f"{_args.fmt(known)}), got {g}"
                    )
        host = np.asarray(jax.device_get(indices)).astype(np.int64, copy=False)
        if host.size:
            low = int(host.argmin())
            if host[low] < 0:
                raise ValueError(
                    f"grad_indices[{low}] = {host[low]} is negative; indices must be row ids"
                )
            high = int(host.argmax())
            limit = known[0] if known else None
            if limit is not None and host[high] >= limit:
                raise ValueError(
                    f"grad_indices[{high}] = {host[high]} exceeds the accumulator's "
                    f"shape[0] = {limit}"
                )
            if grad_shape and grad_shape[0] is not None and host[high] >= grad_shape[0]:
                raise ValueError(
                    f"grad_indices[{high}] = {host[high]} exceeds grad_shape[0] = {grad_shape[0]}"
                )
            if host[high] > _INT32_MAX:
                raise ValueError(f"grad_indices[{high}] = {host[high]} does not fit in int32")
        if known is not None:
            if len(values.shape) < len(known):
                raise ValueError(
                    f"grad_values must have rank at least {len(known)} (the accumulator's "
                    f"shape {_args.fmt(known)}), got shape {list(values.shape)}"
                )
            for i in range(1, len(known)):
                if known[i] is not None and known[i] != values.shape[i]:
                    raise ValueError(
                        f"grad_values dim {i} must be {known[i]} (the accumulator's shape "
                        f"{_args.fmt(known)}), got {values.shape[i]}"
                    )
        return host, values

    def apply(self, indices: Any, values: Any, grad_shape: Any, local_step: Any) -> bool:
        step = _args.check_step("local_step", local_step)
        ids, values = self._validate(indices, values, grad_shape)
        nnz = ids.shape[0]
        finite = self.finite(values) if self.skip_nonfinite else True
        padded = _bucket(nnz)
        if nnz and nnz != padded:  # rows padded to a bucketed count (ours: a copy)
            grown = np.zeros((padded, *values.shape[1:]), values.dtype)
            grown[:nnz] = np.asarray(values)
            values = grown
        if nnz < 2 or (ids[1:] > ids[:-1]).all():  # sorted and unique, as TF expects
            unique, inverse = ids, None
        else:
            unique, inverse = np.unique(ids, return_inverse=True)
        callers = self.device.is_callers(values)  # read by a kernel now, never kept
        if not callers:
            values = self.device.own(values)
        with self.lock, self.device.precision():
            batch = self.batch
            if batch.values_shape is not None and (
                len(values.shape) != len(batch.values_shape)
                or values.shape[1:] != batch.values_shape[1:]
            ):
                raise ValueError(
                    f"grad_values rows must have shape {list(batch.values_shape[1:])} (fixed "
                    f"by the first gradient since the last take), got {list(values.shape[1:])}"
                )
            accepted = self.admit(step, finite)
            if accepted:
                self._add_rows(batch, unique, inverse, values, nnz, ours=not callers)
                self.serve()
        return accepted

    def _add_rows(
        self,
        batch: SparseBatch,
        unique: np.ndarray,
        inverse: np.ndarray | None,
        values: jax.Array,
        nnz: int,
        ours: bool,
    ) -> None:
        """Adds one accepted gradient's rows to `batch` (lock held, in the accumulator's
        precision), changing it in one assignment once the kernel is dispatched."""
        values_shape = (0, *values.shape[1:])
        if nnz == 0:
            batch.values_shape, batch.count = values_shape, batch.count + 1
            return
        rows, count, new = batch.rows, batch.count + 1, None
        try:
            if rows is None and inverse is None and ours and values.dtype == self.acc_dtype:
                # The first rows since the take, sorted and unique: they are the buffer.
                ids, slots, counts = unique, np.arange(nnz, dtype=np.int32), np.ones(nnz, np.int64)
                new = (values, ids, slots, counts, values_shape, 0, count)
            else:
                ids, slots, counts, slot_of = self._place(batch, unique, inverse)
                grow = rows is None or len(ids) > rows.shape[0]
                capacity = max(self.capacity_hint, _bucket(len(ids))) if grow else rows.shape[0]
                per_value = np.full(values.shape[0], capacity, np.int32)  # padding: dropped
                per_value[:nnz] = slot_of
                unsettled = 0 if grow else batch.unsettled + 1
                if unsettled > _MAX_UNSETTLED:  # a few scatters in flight at most
                    rows.block_until_ready()
                    unsettled = 0
                self.capacity_hint = max(self.capacity_hint, capacity)
                bookkeeping = (ids, slots, counts, values_shape, unsettled, count)
                if grow:  # the first rows since the take, or more than fit
                    fresh = functools.partial(_scatter_fresh, capacity=capacity)
                    new = (fresh(rows, per_value, values, dtype=self.acc_dtype), *bookkeeping)
                else:
                    new = (_scatter_add(rows, per_value, values), *bookkeeping)
            self._commit(batch, new)
        except BaseException:  # finish an update whose kernel ran, or drop a consumed batch
            if new is not None and batch.count != count:
                self._commit(batch, new)
            self.discard_if_consumed(batch, batch.rows)
            raise

    @staticmethod
    def _commit(batch: SparseBatch, new: tuple) -> None:
        """Sets every field of `batch` at once (no interruption can land in between)."""
        (
            batch.rows,
            batch.sorted_ids,
            batch.sorted_slots,
            batch.row_counts,
            batch.values_shape,
            batch.unsettled,
            batch.count,
        ) = new

    @staticmethod
    def _place(
        batch: SparseBatch, unique: np.ndarray, inverse: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The batch's bookkeeping with `unique` row ids added, as new arrays (sorted ids,
        their slots, per-slot counts), and the slot of each of the gradient's values."""
        known, known_slots = batch.sorted_ids, batch.sorted_slots
        n = known.shape[0]
        pos = np.searchsorted(known, unique)
        found = np.zeros(unique.shape, bool)
        inside = pos < n
        found[inside] = known[pos[inside]] == unique[inside]
        new_ids = unique[~found]
        slots = np.empty(unique.shape, np.int32)
        slots[found] = known_slots[pos[found]]
        slots[~found] = np.arange(n, n + new_ids.shape[0], dtype=np.int32)
        counts = np.concatenate([batch.row_counts, np.zeros(new_ids.shape[0], np.int64)])
        counts[slots] += 1
        ids = np.insert(known, pos[~found], new_ids)
        sorted_slots = np.insert(known_slots, pos[~found], slots[~found])
        slot_of = slots if inverse is None else slots[inverse.reshape(-1)]
        return ids, sorted_slots, counts, slot_of

    def reduce(self, batch: SparseBatch) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        n = batch.sorted_ids.shape[0]
        dims = (self.shape[0] if self.shape and self.shape[0] is not None else -1,)
        dims += tuple(batch.values_shape[1:])
        indices = self.device.own(batch.sorted_ids.astype(np.int32))
        if n == 0:
            return indices, jnp.zeros((0, *batch.values_shape[1:]), self.dtype), dims
        rows, slots = batch.rows, batch.sorted_slots
        counts = batch.row_counts[slots]
        if (
            (slots == np.arange(n)).all()
            and (not self.mean or (counts == 1).all())
            and rows.dtype == self.dtype
        ):
            taken = rows  # slots already sorted, nothing to divide: no kernel
        else:
            # Gather a bucketed n rows, not the whole buffer (compiles once per bucket).
            order = np.zeros(_bucket(n), np.int32)
            order[:n] = slots
            padded_counts = np.ones(_bucket(n), np.int32)
            padded_counts[:n] = counts
            taken = _gather_copy(rows, order, padded_counts, mean=self.mean, dtype=self.dtype)
        if taken.shape[0] == n:
            return indices, taken, dims
        # Cut to the n real rows on the host: a device slice compiles once per n. On a
        # CPU device the cut is a view of `taken`, which nothing writes again.
        cut = np.asarray(taken)[:n]
        values = jax.device_put(cut, may_alias=True) if self.device.is_cpu else self.device.own(cut)
        return indices, values, dims


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
    take sorts and divides the rows in the taker's thread.

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

        Returns:
          True if accepted, False if dropped (stale, or non-finite under
          `skip_nonfinite`).

        Raises:
          TypeError: for a wrong values dtype, non-integer indices or `local_step`.
          ValueError: for any shape or index check above. Nothing changes.
        """
        return self._core.apply(grad_indices, grad_values, grad_shape, local_step)

    def apply_indexed_slices_grad(self, grad: IndexedSlices, local_step: int = 0) -> bool:
        """`apply_grad` for an `IndexedSlices` gradient.

        Rows at the padding index (`grad.padding_index`: `dense_shape[0]`, or the
        int32 maximum when the row count is unknown, as the functional
        `sparse_conditional_accumulator` pads) are left out; every other index is
        checked as in `apply_grad`.

        Args:
          grad: the gradient.
          local_step: the global step the gradient was computed at.

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
        return self._core.apply(indices, values, grad.dense_shape, local_step)

    def take_grad(
        self, num_required: int, timeout: float | None = None
    ) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        """Blocks until `num_required` gradients are in; returns their aggregate rows.

        Served first come, first served, as `ConditionalAccumulator.take_grad`.

        Args:
          num_required: a positive int, or a 0-d integer NumPy or JAX array.
          timeout: seconds to wait at most; None or `float("inf")` waits forever.

        Returns:
          `(indices, values, shape)`: sorted unique int32 row ids, their rows (MEAN
          per row, or SUM) in the accumulator's dtype, and the dense shape as a tuple
          of ints (dim 0 is -1 when the accumulator's is unknown).

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return self._core.take(num_required, timeout)

    def take_indexed_slices_grad(
        self, num_required: int, timeout: float | None = None
    ) -> IndexedSlices:
        """`take_grad`, returning an `IndexedSlices`.

        Args:
          num_required: a positive int, or a 0-d integer NumPy or JAX array.
          timeout: seconds to wait at most; None or `float("inf")` waits forever.

        Returns:
          `IndexedSlices(indices, values, shape)` as `take_grad` returns them.

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return IndexedSlices(*self.take_grad(num_required, timeout))
