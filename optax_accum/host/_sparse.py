"""The sparse host accumulator: `SparseConditionalAccumulator` and its device kernels.

Rows live on a JAX device in slots, in arrival order, in a buffer that grows by
powers of two (no fixed capacity); the row id and count of each slot are NumPy on the
host, and a table of hints (row id to slot) finds a gradient's slots in O(nnz). A
gradient's rows are scattered into their slots by one jitted kernel that donates the
buffer; its row count is padded to a power of two, so compilations stay bounded
however the sizes vary. The first gradient after a take, sorted and unique as TF
expects, becomes the buffer itself. When a batch is handed to a take, the thread
handing it over sorts the slots by row id and dispatches the gather (so it runs right
after the batch's scatters, not behind the next batch's); the taker then only waits
for it. A take whose slots are already in row order and need no division returns the
buffer as it is; otherwise the buffer is kept for a later batch (no fresh, zeroed
allocation per batch: a slot is zeroed when it is assigned). Likewise a NumPy
gradient is copied into a pooled staging buffer, not a fresh one (a page fault per
page), handed back once the scatters that read it are done: when an apply waits for
them, or at the take.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum.host import _args
from optax_accum.host._core import Batch, Core, HostAccumulator
from optax_accum.indexed_slices import IndexedSlices

_MIN_BUCKET = 8
_MAX_UNSETTLED = 4  # scatters in flight at most
_INT32_MAX = int(np.iinfo(np.int32).max)
_DENSE_IDS = 32  # row ids below 32x their count are sorted through a table, not a sort


# --------------------------------------------------------------------------- kernels
# Module-level jits: every accumulator shares their compilation caches.


def _fill(rows: jax.Array, fresh: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Zeroes the slots `fresh` (newly assigned: unused slots may hold anything), then
    adds `values[i]` to `rows[slots[i]]`; slots out of range are padding, dropped."""
    rows = rows.at[fresh].set(jnp.zeros((), rows.dtype), mode="drop")
    return rows.at[slots].add(values.astype(rows.dtype), mode="drop")


_scatter_add = jax.jit(_fill, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_grow(
    spare: jax.Array, rows: jax.Array, fresh: jax.Array, slots: jax.Array, values: jax.Array
) -> jax.Array:
    """`_scatter_add` into `spare`, a buffer with more slots, after copying `rows` in."""
    spare = jax.lax.dynamic_update_slice_in_dim(spare, rows.astype(spare.dtype), 0, axis=0)
    return _fill(spare, fresh, slots, values)


def _divide(taken: jax.Array, counts: jax.Array, mean: bool, dtype: Any) -> jax.Array:
    """`taken` with each row divided by its count under MEAN (padding counts are 1)."""
    if mean:
        taken = taken / counts.astype(taken.dtype).reshape((-1,) + (1,) * (taken.ndim - 1))
    return taken.astype(dtype)


@functools.partial(jax.jit, static_argnames=("mean", "dtype"))
def _gather_copy(
    rows: jax.Array, order: jax.Array, counts: jax.Array, *, mean: bool, dtype: Any
) -> jax.Array:
    """`rows[order]`, each divided by its count under MEAN."""
    return _divide(rows[order], counts, mean, dtype)


@functools.partial(jax.jit, static_argnames=("mean", "dtype"))
def _merge_copy(
    rows: jax.Array,
    order: jax.Array,
    segments: jax.Array,
    counts: jax.Array,
    *,
    mean: bool,
    dtype: Any,
) -> jax.Array:
    """`_gather_copy` where several slots hold one row: `rows[order[i]]` added into
    output row `segments[i]` (sorted; out of range is padding, dropped)."""
    summed = jax.ops.segment_sum(
        rows[order], segments, num_segments=order.shape[0], indices_are_sorted=True
    )
    return _divide(summed, counts, mean, dtype)


def _bucket(n: int) -> int:
    """The smallest power of two >= max(n, _MIN_BUCKET): sizes that bound compilations."""
    return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


# --------------------------------------------------------------------------- state


class _Rows(NamedTuple):
    """One accepted gradient's rows: its sorted unique ids, where each value goes among
    them (None when the ids came sorted and unique), the values (padded to a bucketed
    count), and how many of them are real."""

    unique: np.ndarray
    inverse: np.ndarray | None
    values: Any
    nnz: int


class SparseBatch(Batch):
    """Rows since the last take. `rows` (None until the first row) is the device buffer
    of `rows.shape[0]` slots, of which the first `len(slot_ids)` are used, in arrival
    order: `slot_ids[s]` is the row id in slot `s` and `row_counts[s]` how many accepted
    gradients touched it (MEAN divides by it). `values_shape` is fixed by the first
    gradient until the take."""

    __slots__ = (
        "answer",
        "in_flight",
        "row_counts",
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
        self.unsettled = 0  # scatters dispatched since the last wait
        self.in_flight: tuple[np.ndarray, ...] = ()  # staging buffers scatters may still read
        self.answer: tuple | None = None  # (indices, rows, n) once the take's gather is dispatched


class SlotHints:
    """Where each row id was last given a slot: a table indexed by row id (or, past
    `limit` entries, by its low bits), so finding a gradient's slots costs O(nnz),
    not a merge with every row of the batch.

    A hint is only a guess: a batch trusts it only when its `slot_ids` confirm it, so
    the table is never cleared, outlives batches, and can be written before a kernel
    that may fail. A row id whose hint was overwritten by another's (only past
    `limit`) gets a second slot; the take adds such slots together.
    """

    limit = 1 << 22  # entries at most (16 MiB)

    def __init__(self) -> None:
        self.table = np.zeros(0, np.int32)

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return ids & (self.table.shape[0] - 1)

    def slots(self, ids: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        """The slot of each of the sorted unique `ids` in a batch whose slots hold
        `slot_ids`, or -1 where it has none."""
        n = slot_ids.shape[0]
        if n == 0 or ids.shape[0] == 0 or self.table.shape[0] == 0:
            return np.full(ids.shape, -1, np.int32)
        hint = self.table[self._keys(ids)]
        hint = np.where(hint < n, hint, 0)
        return np.where(slot_ids[hint] == ids, hint, -1).astype(np.int32, copy=False)

    def remember(self, ids: np.ndarray, slots: np.ndarray, slot_ids: np.ndarray) -> None:
        """Records that sorted `ids` are in `slots` of a batch whose slots hold
        `slot_ids` (used to refill a table that grows)."""
        if ids.shape[0] == 0:
            return
        size = min(_bucket(int(ids[-1]) + 1), self.limit)
        if size > self.table.shape[0]:
            self.table = np.zeros(size, np.int32)
            self.table[self._keys(slot_ids)] = np.arange(slot_ids.shape[0], dtype=np.int32)
        self.table[self._keys(ids)] = slots


def _unique(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A gradient's sorted unique row ids and, unless `ids` already were (as TF
    expects), the index of each id among them."""
    if ids.shape[0] < 2 or (ids[1:] > ids[:-1]).all():
        return ids, None
    return np.unique(ids, return_inverse=True)


def _check_rows_like_batch(values: Any, batch: SparseBatch) -> None:
    """The values' rows must have the shape of the batch's earlier gradients' rows."""
    known = batch.values_shape
    if known is not None and (len(values.shape) != len(known) or values.shape[1:] != known[1:]):
        raise ValueError(
            f"grad_values rows must have shape {list(known[1:])} (fixed by the first "
            f"gradient since the last take), got {list(values.shape[1:])}"
        )


class SparseCore(Core):
    kind = "SparseConditionalAccumulator"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.capacity_hint = 0  # the largest buffer so far: later batches start there
        self.spare: jax.Array | None = None  # a taken batch's buffer, for the next batch
        self.hints = SlotHints()

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
        grad_shape = self._check_grad_shape(grad_shape)
        host = np.asarray(jax.device_get(indices)).astype(np.int64, copy=False)
        if host.size:
            self._check_row_ids(host, grad_shape)
        self._check_values_shape(values)
        return host, values

    def _check_grad_shape(self, grad_shape: Any) -> _args.Shape | None:
        """`grad_shape` as a shape, checked against the accumulator's."""
        known = self.shape
        grad_shape = _args.check_shape(grad_shape, "grad_shape")
        if not grad_shape or known is None:
            return grad_shape
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
        return grad_shape

    def _check_row_ids(self, host: np.ndarray, grad_shape: _args.Shape | None) -> None:
        """Non-empty host indices: row ids below every known dim 0, within int32."""
        low = int(host.argmin())
        if host[low] < 0:
            raise ValueError(
                f"grad_indices[{low}] = {host[low]} is negative; indices must be row ids"
            )
        high = int(host.argmax())
        limit = self.shape[0] if self.shape else None
        if limit is not None and host[high] >= limit:
            raise ValueError(
                f"grad_indices[{high}] = {host[high]} exceeds the accumulator's shape[0] = {limit}"
            )
        if grad_shape and grad_shape[0] is not None and host[high] >= grad_shape[0]:
            raise ValueError(
                f"grad_indices[{high}] = {host[high]} exceeds grad_shape[0] = {grad_shape[0]}"
            )
        if host[high] > _INT32_MAX:
            raise ValueError(f"grad_indices[{high}] = {host[high]} does not fit in int32")

    def _check_values_shape(self, values: Any) -> None:
        """The values' rank and row dims against the accumulator's shape."""
        known = self.shape
        if known is None:
            return
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

    def apply(self, indices: Any, values: Any, grad_shape: Any, local_step: Any) -> bool:
        step = _args.check_step("local_step", local_step)
        ids, values = self._validate(indices, values, grad_shape)
        nnz = ids.shape[0]
        finite = self.finite(values) if self.skip_nonfinite else True
        unique, inverse = _unique(ids)
        values, staged, callers = self._own_rows(values, nnz)
        accepted = False
        try:
            with self.lock, self.device.precision():
                batch = self.batch
                _check_rows_like_batch(values, batch)
                accepted = self.admit(step, finite)
                if accepted:
                    grad = _Rows(unique, inverse, values, nnz)
                    self._add_rows(batch, grad, staged, ours=not callers)
                    self.serve()
        finally:
            if not accepted:  # nothing reads it
                self.device.recycle([staged])
        return accepted

    def _own_rows(self, values: Any, nnz: int) -> tuple[Any, np.ndarray | None, bool]:
        """The values, their rows padded to a bucketed count, as a device array a kernel
        may read; with the staging buffer it aliases, if any, and whether it is the
        caller's. A caller's JAX array on our device that needs no padding is used as it
        is (read by a kernel now, never kept); other values are copied, on a CPU device
        into a pooled staging buffer (a fresh megabyte costs a page fault per page)."""
        padded = _bucket(nnz) if nnz else 0
        if nnz == padded and self.device.is_callers(values):
            return values, None, True
        if self.device.is_cpu and nnz and (nnz != padded or not isinstance(values, jax.Array)):
            staged = self.device.stage(np.asarray(values), padded)
            return jax.device_put(staged, may_alias=True), staged, False
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
        unique, inverse, values, nnz = grad
        values_shape = (0, *values.shape[1:])
        if nnz == 0:
            batch.values_shape, batch.count = values_shape, batch.count + 1
            return
        count, new, settled = batch.count + 1, None, ()
        try:
            if (
                batch.rows is None
                and self.spare is None
                and inverse is None
                and ours
                and values.dtype == self.acc_dtype
            ):
                # The first rows since the take, sorted and unique, and no taken batch's
                # buffer to fill: they are the buffer (its staging buffer, if any, with
                # them: never recycled). With a spare they go into it instead: a second
                # gradient would grow a buffer of exactly their rows, in a kernel that
                # XLA:CPU runs inline (0.6-0.9 ms under the lock).
                self.hints.remember(unique, np.arange(nnz, dtype=np.int32), unique)
                new = (values, unique, np.ones(nnz, np.int64), values_shape, 0, batch.in_flight)
            else:
                out, slot_ids, counts, unsettled, waited = self._scatter(batch, grad)
                in_flight = batch.in_flight
                if waited:  # the earlier scatters are done: their staging buffers are free
                    settled, in_flight = in_flight, ()
                in_flight += (staged,) if staged is not None else ()
                new = (out, slot_ids, counts, values_shape, unsettled, in_flight)
            self._commit(batch, (*new, count))
        except BaseException:  # finish an update whose kernel ran, or drop a consumed batch
            if new is not None and batch.count != count:
                self._commit(batch, (*new, count))
            self.discard_if_consumed(batch, batch.rows)
            raise
        self.device.recycle(settled)

    def _scatter(self, batch: SparseBatch, grad: _Rows) -> tuple:
        """Dispatches the kernel adding a gradient's rows to the batch's buffer, growing
        it if they do not fit; returns the new buffer and bookkeeping, and whether it
        waited for the batch's earlier scatters first (lock held)."""
        unique, inverse, values, nnz = grad
        rows, known = batch.rows, batch.slot_ids.shape[0]
        ids, counts, slot_of = self._place(batch, unique, inverse)
        grow = rows is None or ids.shape[0] > rows.shape[0]
        target = self._buffer(ids.shape[0], values.shape[1:]) if grow else rows
        # Index vectors as long as the (bucketed) values: padding points past the end.
        per_value = np.full(values.shape[0], target.shape[0], np.int32)
        per_value[:nnz] = slot_of
        fresh = np.full(values.shape[0], target.shape[0], np.int32)
        fresh[: ids.shape[0] - known] = np.arange(known, ids.shape[0], dtype=np.int32)
        unsettled, waited = (0 if grow else batch.unsettled + 1), False
        if unsettled > _MAX_UNSETTLED:  # a few scatters in flight at most
            rows.block_until_ready()
            unsettled, waited = 0, True
        if not grow:
            out = _scatter_add(rows, fresh, per_value, values)
        elif rows is None:
            out = _scatter_add(target, fresh, per_value, values)
        else:
            out = _scatter_grow(target, rows, fresh, per_value, values)
        return out, ids, counts, unsettled, waited

    def _buffer(self, n: int, row_shape: tuple[int, ...]) -> jax.Array:
        """A buffer of at least `n` slots of `row_shape` for a batch: a taken batch's, or
        a new one as large as the largest so far (lock held)."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.shape[0] >= n and spare.shape[1:] == row_shape:
            return spare
        self.capacity_hint = max(self.capacity_hint, _bucket(n))
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
            batch.values_shape,
            batch.unsettled,
            batch.in_flight,
            batch.count,
        ) = new

    def _place(
        self, batch: SparseBatch, unique: np.ndarray, inverse: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch's bookkeeping with the sorted `unique` row ids added, as new arrays
        (the row id and count of each slot), and the slot of each gradient value."""
        known = batch.slot_ids
        n = known.shape[0]
        slots = self.hints.slots(unique, known)
        new = slots < 0
        added = int(new.sum())
        slots[new] = np.arange(n, n + added, dtype=np.int32)
        ids = np.concatenate([known, unique[new]])
        counts = np.concatenate([batch.row_counts, np.zeros(added, np.int64)])
        counts[slots] += 1
        self.hints.remember(unique[new], slots[new], ids)
        slot_of = slots if inverse is None else slots[inverse.reshape(-1)]
        return ids, counts, slot_of

    def seal(self, batch: SparseBatch) -> None:
        """Dispatches the take's gather as the batch is handed over, so it runs right
        after the batch's own scatters, not behind the next batch's (lock held)."""
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
        dims = (self.shape[0] if self.shape and self.shape[0] is not None else -1,)
        dims += tuple(batch.values_shape[1:])
        if batch.answer is None:
            batch.answer = self._answer(batch)
            if batch.answer[1] is not batch.rows:
                self._recycle(batch.rows)
        indices, taken, n = batch.answer
        if batch.in_flight:  # the scatters that read them are done once the answer is
            jax.block_until_ready(taken)
            self.device.recycle(batch.in_flight)
        if taken.shape[0] == n:
            return indices, taken, dims
        # Cut to the n real rows on the host: a device slice compiles once per n. On a
        # CPU device the cut is a view of `taken`, which nothing writes again.
        cut = np.asarray(taken)[:n]
        values = jax.device_put(cut, may_alias=True) if self.device.is_cpu else self.device.own(cut)
        return indices, values, dims

    def _answer(self, batch: SparseBatch) -> tuple[jax.Array, jax.Array, int]:
        """The sorted row ids, the rows (at least as many, dispatched), and their count."""
        ids, order, segments = _sorted_slots(batch.slot_ids)
        n = ids.shape[0]
        indices = self.device.own(ids.astype(np.int32))
        if n == 0:
            return indices, jnp.zeros((0, *batch.values_shape[1:]), self.dtype), 0
        counts = batch.row_counts[order]
        if segments is not None:  # a row id in several slots: their counts add up
            counts = np.bincount(segments, weights=counts, minlength=n).astype(np.int64)
        return indices, self._gather_rows(batch.rows, order, segments, counts), n

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
        size = _bucket(n)
        padded_order = np.zeros(size, np.int32)
        padded_order[:n] = order
        padded_counts = np.ones(size, np.int32)
        padded_counts[: counts.shape[0]] = counts
        how = {"mean": self.mean, "dtype": self.dtype}
        if segments is None:
            taken = _gather_copy(rows, padded_order, padded_counts, **how)
        else:
            padded_segments = np.full(size, size, np.int32)  # padding: dropped
            padded_segments[:n] = segments
            taken = _merge_copy(rows, padded_order, padded_segments, padded_counts, **how)
        return taken


def _sorted_slots(slot_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The sorted unique row ids of a batch's slots, the slots in row-id order, and,
    when a row id has several slots, the index of its unique id for each of them.

    Run under the lock at every hand-off, so the common cases skip the sort: slots
    already in row order (one gradient), and unique row ids dense enough to invert
    through a table as long as the largest id."""
    n = slot_ids.shape[0]
    if n < 2 or (slot_ids[1:] > slot_ids[:-1]).all():
        return slot_ids, np.arange(n, dtype=np.int32), None
    top = int(slot_ids.max()) + 1
    if top <= _DENSE_IDS * n:
        where = np.full(top, -1, np.int32)
        where[slot_ids] = np.arange(n, dtype=np.int32)
        ids = np.flatnonzero(where >= 0)
        if ids.shape[0] == n:  # unique: a row id with several slots is left to the sort
            return ids, where[ids], None
    keys = np.sort((slot_ids.astype(np.int64) << 32) | np.arange(n, dtype=np.int64), kind="stable")
    ids, order = keys >> 32, (keys & 0xFFFFFFFF).astype(np.int32)
    first = np.ones(n, bool)
    first[1:] = ids[1:] != ids[:-1]
    if first.all():
        return ids, order, None
    return ids[first], order, np.cumsum(first) - 1


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
