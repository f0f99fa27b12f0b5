"""The functional SparseConditionalAccumulator: row-sparse, step-tagged accumulation.

TF1's `tf.sparse.SparseConditionalAccumulator` accumulates `IndexedSlices` gradients
(an embedding table's few touched rows) and averages each row over the gradients that
touched it. `sparse_conditional_accumulator` is that rule as a jit-able Optax
transform with static shapes: each sparse leaf keeps at most `capacity` distinct rows,
found through a row-to-slot map, so an update costs work in proportion to the
gradient's rows, never to the table's size. `sparse_sgd` updates only those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _collectives,
    _compat,
    _counters,
    _extra_args,
    _row_ids,
    _sums,
)
from optax_accum.indexed_slices import IndexedSlices


class RowBuffer(NamedTuple):
    """One sparse leaf's running sum: up to `capacity` distinct rows, in arrival order.

    Attributes:
      rows: int32 `[capacity]`, the row id held in each slot.
      values: `[capacity, *row_shape]`, the sum of the accepted gradients' rows.
      touches: int32 `[capacity]`, how many accepted gradients touched each slot's row.
      weights: float32 `[capacity]`, the sum of the `weight`s of those gradients (each
        1 by default, so then it equals `touches`); MEAN divides each row by it.
      size: int32, the number of slots in use (slots `0..size-1`). Slots at or beyond
        `size` hold stale data from before the last release and are never read: a
        release only resets `size`, so it costs nothing per table row.
      slot_of: int32 `[table rows]`, the slot of each row; an entry counts only if it
        points below `size` at a slot whose `rows` entry is that row.

    Read a held row's running sum through the map (TF keeps no such buffer: its
    accumulator stores the gradients' rows as they come).

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=2)
      >>> state = tx.init(jnp.zeros((5, 1)))
      >>> g = optax_accum.IndexedSlices(jnp.array([3, 3]), jnp.ones((2, 1)), (5, 1))
      >>> _, state = tx.update(g, state)  # row 3, twice: summed, counted once
      >>> buf = state.accumulator
      >>> slot = int(buf.slot_of[3])
      >>> int(buf.size), int(buf.rows[slot]), float(buf.values[slot, 0]), int(buf.touches[slot])
      (1, 3, 2.0, 1)
    """

    rows: jax.Array
    values: jax.Array
    touches: jax.Array
    weights: jax.Array
    size: jax.Array
    slot_of: jax.Array


class DenseRows(NamedTuple):
    """One dense leaf's running sum, and how many accepted gradients touched each row.

    A dense gradient touches every row; an `IndexedSlices` gradient offered to a dense
    leaf touches its distinct row ids. MEAN divides each row by the weight sum of the
    gradients that touched it (their count, without weights), so a row's mean does not
    depend on whether its leaf is kept sparse or dense.

    TF counterpart: the running sum of `tf.ConditionalAccumulator`, with a count per row
    for the per-row mean of `tf.sparse.SparseConditionalAccumulator`.

    Attributes:
      values: the sum of the accepted gradients, shaped like the param, in the
        accumulator's dtype (float32 for float16 and bfloat16 params).
      touches: int32 `[rows]` (a scalar for a scalar param), the count of each row.
      weights: float32, shaped like `touches`: the sum of the `weight`s of the
        gradients that touched each row (equal to `touches` without weights).

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=3, capacity=8)
      >>> state = tx.init(jnp.zeros((4, 1)))  # 4 rows, not more than capacity: dense
      >>> _, state = tx.update(jnp.ones((4, 1)), state)
      >>> g = optax_accum.IndexedSlices(jnp.array([1]), jnp.ones((1, 1)), (4, 1))
      >>> _, state = tx.update(g, state)
      >>> state.accumulator.touches.tolist(), state.accumulator.values[:, 0].tolist()
      ([1, 2, 1, 1], [1.0, 2.0, 1.0, 1.0])
    """

    values: jax.Array
    touches: jax.Array
    weights: jax.Array


class SparseConditionalAccumulatorState(NamedTuple):
    """State of `sparse_conditional_accumulator`.

    Attributes:
      global_step: int32, the number of updates released so far (TF's global step).
      count: int32, accepted gradients since the last release (over all replicas).
      num_dropped: int32, stale gradients dropped so far.
      num_nonfinite: int32, gradients skipped for a NaN or Inf (`skip_nonfinite`).
      num_skipped: int32, fresh gradients skipped by `should_skip_update_fn`, or for a
        traced `weight` that is negative, NaN or infinite. A non-finite gradient
        under `skip_nonfinite=True` counts in `num_nonfinite` only.
      num_overflowed: int32, gradients rejected because a sparse leaf would have held
        more than `capacity` distinct rows.
      num_out_of_range: int32, rows of accepted `IndexedSlices` gradients (for sparse
        and dense leaves alike) whose id lay outside `[0, num_rows]` and were ignored
        (the padding id `num_rows` is not counted).
      emitted: bool, whether the last `update` released an update.
      accumulator: the params' tree, holding a `RowBuffer` for each sparse leaf and a
        `DenseRows` (per replica under an `axis_name`) for each dense leaf.
      inner_state: the wrapped optimizer's state.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=1)
      >>> state = tx.init(jnp.zeros((4, 2)))
      >>> g = optax_accum.IndexedSlices(jnp.array([0, 3]), jnp.ones((2, 2)), (4, 2))
      >>> _, state = tx.update(g, state)  # two rows do not fit in capacity 1
      >>> int(state.count), int(state.num_overflowed), type(state.accumulator).__name__
      (0, 1, 'RowBuffer')
    """

    global_step: jax.Array
    count: jax.Array
    num_dropped: jax.Array
    num_nonfinite: jax.Array
    num_skipped: jax.Array
    num_overflowed: jax.Array
    num_out_of_range: jax.Array
    emitted: jax.Array
    accumulator: Any
    inner_state: optax.OptState


def _is_slices(x: Any) -> bool:
    return isinstance(x, IndexedSlices)


def _is_buffer(x: Any) -> bool:
    return isinstance(x, RowBuffer)


def _is_accumulator(x: Any) -> bool:
    return isinstance(x, RowBuffer | DenseRows)


def _num_rows(acc: RowBuffer | DenseRows) -> int:
    return acc.slot_of.shape[0] if _is_buffer(acc) else acc.values.shape[0]


def _dense_rows(param: Any) -> DenseRows:
    return DenseRows(
        values=_sums.zeros_accumulator(param),
        touches=_sums.row_zeros(param, jnp.int32),
        weights=_sums.row_zeros(param, _sums.WEIGHT_DTYPE),
    )


def _empty_buffer(param: Any, capacity: int) -> RowBuffer:
    shape = jnp.shape(param)
    dtype = _sums.accumulator_dtype_for(jnp.result_type(param), None)
    return RowBuffer(
        rows=jnp.full((capacity,), shape[0], jnp.int32),
        values=jnp.zeros((capacity, *shape[1:]), dtype),
        touches=jnp.zeros((capacity,), jnp.int32),
        weights=jnp.zeros((capacity,), _sums.WEIGHT_DTYPE),
        size=_counters.int32(0),
        slot_of=jnp.full((shape[0],), -1, jnp.int32),
    )


def _sparse_mask(sparse: Any, params: Any, capacity: int) -> Any:
    """The tree of bools saying which leaves of `params` accumulate sparsely."""
    if sparse is None:
        return jax.tree.map(lambda p: jnp.ndim(p) >= 2 and jnp.shape(p)[0] > capacity, params)
    mask = sparse(params) if callable(sparse) else sparse
    if jax.tree.structure(mask) != jax.tree.structure(params):
        raise ValueError(
            "sparse must be a tree of bools with the params' structure (or a function of "
            f"the params returning one): expected {jax.tree.structure(params)}, "
            f"got {jax.tree.structure(mask)}"
        )
    flat = [
        _sparse_flag(jax.tree_util.keystr(path), p, m)
        for (path, p), m in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(mask), strict=True
        )
    ]
    return jax.tree.unflatten(jax.tree.structure(params), flat)


def _sparse_flag(where: str, param: Any, flag: Any) -> bool:
    """One leaf's entry of the `sparse` tree, checked against its param."""
    if not isinstance(flag, bool | np.bool_):
        raise TypeError(f"sparse{where} must be a bool, got {flag!r} ({type(flag).__name__})")
    if flag and jnp.ndim(param) < 1:
        raise ValueError(f"params{where} is a scalar and cannot be sparse")
    if flag and jnp.shape(param)[0] == 0:
        raise ValueError(
            f"params{where} must have at least one row to be sparse, got shape "
            f"{tuple(jnp.shape(param))}"
        )
    return bool(flag)


# --------------------------------------------------------------------------- checks


def _check_updates(updates: Any, accumulator: Any) -> None:
    """Trace-time check of the gradient tree against the accumulator's leaves."""
    got = jax.tree.structure(updates, is_leaf=_is_slices)
    expected = jax.tree.structure(accumulator, is_leaf=_is_accumulator)
    if got != expected:
        raise ValueError(
            "updates must have the tree structure of the params given to init: "
            f"expected {expected}, got {got}"
        )
    flat, _ = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_slices)
    for (path, u), a in zip(
        flat, jax.tree.leaves(accumulator, is_leaf=_is_accumulator), strict=True
    ):
        where = f"updates{jax.tree_util.keystr(path)}"
        if isinstance(u, IndexedSlices):
            _check_slices(where, u, a)
        elif _is_buffer(a):
            raise TypeError(
                f"{where} must be an IndexedSlices (this leaf accumulates sparsely), got "
                f"{type(u).__name__}; pass `sparse` to choose the sparse leaves"
            )
        else:
            _checks.check_tree_matches(u, a.values, what=where)


def _check_slices(where: str, u: IndexedSlices, acc: RowBuffer | DenseRows) -> None:
    """Trace-time check of an `IndexedSlices` gradient against its leaf's accumulator."""
    table = (acc.slot_of.shape[0], *acc.values.shape[1:]) if _is_buffer(acc) else acc.values.shape
    if not table or u.dense_shape[1:] != tuple(table[1:]) or u.dense_shape[0] not in (-1, table[0]):
        raise ValueError(f"{where} must have dense_shape {tuple(table)}, got {u.dense_shape}")
    _row_ids.check_indices(u, what=where)
    if not jnp.issubdtype(u.values.dtype, jnp.floating):
        raise TypeError(f"{where}.values must be floating, got dtype {u.values.dtype}")


def _all_finite(grads: list, accs: list) -> jax.Array:
    """Whether the gradient holds no NaN or Inf, padding rows of `IndexedSlices` aside."""

    def real_rows(g: Any, a: Any) -> Any:
        if not isinstance(g, IndexedSlices):
            return g
        real = _row_ids.in_range(g.indices, _num_rows(a))
        return jnp.where(real.reshape((-1,) + (1,) * (g.values.ndim - 1)), g.values, 0)

    return _sums.all_finite([real_rows(g, a) for g, a in zip(grads, accs, strict=True)])


def _add_dense(
    accepted: jax.Array, acc: DenseRows, gradient: Any, rows: Any, weight: jax.Array | None
) -> DenseRows:
    """A dense leaf's accumulation, each row weighted by `weight` (None: 1). An
    `IndexedSlices` gradient (given as `rows`, a pair of int32 row ids and values) is
    scatter-added, each distinct row counted once; a gradient not accepted is aimed out
    of range, so nothing is written."""
    added = 1 if weight is None else weight
    if rows is None:
        return DenseRows(
            _sums.add_where(accepted, acc.values, gradient, weight),
            jnp.where(accepted, acc.touches + 1, acc.touches),
            jnp.where(accepted, acc.weights + added, acc.weights),
        )
    ids, values = rows
    ids = jnp.where(accepted, ids, acc.values.shape[0])
    # Every occurrence of a row writes the same count, so duplicates count once.
    rows_like_ids = _compat.sharding_of(ids)
    touched = acc.touches.at[ids].get(mode="fill", fill_value=0, out_sharding=rows_like_ids)
    weighed = acc.weights.at[ids].get(mode="fill", fill_value=0, out_sharding=rows_like_ids)
    values = _sums.weighted(values, weight, acc.values.dtype)
    return DenseRows(  # in the accumulator's layout (explicit sharding: its row shards)
        acc.values.at[ids].add(values, mode="drop", out_sharding=_compat.sharding_of(acc.values)),
        acc.touches.at[ids].set(
            touched + 1, mode="drop", out_sharding=_compat.sharding_of(acc.touches)
        ),
        acc.weights.at[ids].set(
            weighed + added, mode="drop", out_sharding=_compat.sharding_of(acc.weights)
        ),
    )


def _release_dense(acc: DenseRows, mean: bool, like: Any, axis_name: Any) -> jax.Array:
    """A dense leaf released: summed over `axis_name`, each row divided by its weight
    sum if `mean` (by the number of accepted gradients, when all of them were dense and
    unweighted)."""
    total, weights = acc.values, acc.weights
    if axis_name is not None:
        total = lax.psum(total, axis_name)
    if mean:
        if axis_name is not None:
            weights = lax.psum(weights, axis_name)
        weights = weights.reshape(weights.shape + (1,) * (total.ndim - weights.ndim))
        total = total / _sums.mean_divisor(weights, total.dtype)
    return total.astype(jnp.result_type(like))


# --------------------------------------------------------------------------- row buffers


class _Plan(NamedTuple):
    """Where one gradient's rows go in a buffer, found without sorting."""

    rows: jax.Array  # the gradient's row ids; padding (and out-of-range ids) = table rows
    first: jax.Array  # True at exactly one occurrence of each distinct real row
    new: jax.Array  # True at that occurrence when the row is not in the buffer yet
    slot: jax.Array  # the slot of each occurrence's row (capacity for padding)
    num_new: jax.Array  # how many slots the gradient would add
    unmapped: jax.Array  # the rows not in the buffer yet (padding elsewhere)
    before: jax.Array  # each row's map entry before this gradient (valid or stale)
    slot_of: jax.Array  # the map, with the unmapped rows' entries used as claims


def _plan(buf: RowBuffer, rows: jax.Array) -> _Plan:
    """Looks up the gradient's rows: O(nnz) gathers and scatters, no sort, no table pass.

    `rows` are int32 row ids, with every id outside the table already the padding id
    (see `_row_ids.row_ids`).

    A map entry is trusted only if it points below `size` at a slot holding that row,
    so a release never has to clear the map. Duplicate ids count once: an occurrence of
    a row already held is told apart by claiming its slot in a `capacity`-sized
    scratch; one of a row not held yet claims the row's own (so far meaningless) map
    entry, which `_commit` then sets to the new slot or restores. The one claim that
    sticks picks the occurrence that counts.
    """
    num_rows, capacity = buf.slot_of.shape[0], buf.rows.shape[0]
    real = rows < num_rows
    before = buf.slot_of.at[rows].get(mode="fill", fill_value=-1)
    held = buf.rows.at[before].get(mode="fill", fill_value=-1)
    existing = jnp.where((before >= 0) & (before < buf.size) & (held == rows), before, -1)
    position = jnp.arange(rows.shape[0], dtype=jnp.int32)
    # Rows held: claim their slot. Rows not held: claim their map entry, as -2 - position
    # (never a slot). The map scatter's indices depend on the lookup above, so XLA reads
    # the old entries first and updates the map in place.
    held_slot = jnp.where(existing >= 0, existing, capacity)
    by_slot = jnp.full((capacity,), -1, jnp.int32).at[held_slot].set(position, mode="drop")
    unmapped = jnp.where(real & (existing < 0), rows, num_rows)
    slot_of = buf.slot_of.at[unmapped].set(-2 - position, mode="drop")
    owner = jnp.where(
        existing >= 0,
        by_slot.at[held_slot].get(mode="fill", fill_value=-1),
        -2 - slot_of.at[unmapped].get(mode="fill", fill_value=0),
    )
    first = real & (owner == position)
    new = first & (existing < 0)
    new_slot = buf.size + jnp.cumsum(new, dtype=jnp.int32) - 1
    slot = jnp.where(existing >= 0, existing, new_slot.at[owner].get(mode="fill", fill_value=0))
    slot = jnp.where(real, slot, capacity)
    num_new = jnp.sum(new, dtype=jnp.int32)
    return _Plan(rows, first, new, slot, num_new, unmapped, before, slot_of)


def _fits(buf: RowBuffer, plan: _Plan) -> jax.Array:
    return buf.size + plan.num_new <= buf.rows.shape[0]


def _commit(
    buf: RowBuffer, plan: _Plan, values: jax.Array, take: jax.Array, weight: jax.Array | None
) -> RowBuffer:
    """Adds the planned rows, weighted by `weight` (None: 1), if `take`; otherwise every
    scatter is aimed out of range."""
    capacity = buf.rows.shape[0]
    slot = jnp.where(take, plan.slot, capacity)
    new_slot = jnp.where(plan.new, slot, capacity)
    # A slot freed by a release still holds its old sum and count: reset them on reuse.
    zero = jnp.zeros((), buf.values.dtype)
    cleared = buf.values.at[new_slot].set(zero, mode="drop")
    touches = buf.touches.at[new_slot].set(0, mode="drop")
    weights = buf.weights.at[new_slot].set(0, mode="drop")
    first = jnp.where(plan.first, slot, capacity)
    # Every occurrence of a row writes the same entry, so the scatter is deterministic;
    # a gradient not taken restores the claimed entries exactly as they were.
    mapped = jnp.where(take, plan.slot, plan.before)
    return RowBuffer(
        rows=buf.rows.at[new_slot].set(plan.rows, mode="drop"),
        values=cleared.at[slot].add(_sums.weighted(values, weight, buf.values.dtype), mode="drop"),
        touches=touches.at[first].add(1, mode="drop"),
        weights=weights.at[first].add(1 if weight is None else weight, mode="drop"),
        size=jnp.where(take, buf.size + plan.num_new, buf.size),
        slot_of=plan.slot_of.at[plan.unmapped].set(mapped, mode="drop"),
    )


def _release_rows(buf: RowBuffer, mean: bool, like: IndexedSlices) -> IndexedSlices:
    """The buffer's rows, sorted and unique, padded to capacity; per-row mean if `mean`.

    Sorts the `capacity` row ids alone (no payload) and finds their slots in the map.
    """
    num_rows, capacity = buf.slot_of.shape[0], buf.rows.shape[0]
    used = jnp.arange(capacity, dtype=jnp.int32) < buf.size
    ids = jnp.sort(jnp.where(used, buf.rows, num_rows))
    slots = buf.slot_of.at[ids].get(mode="fill", fill_value=capacity)
    values = buf.values.at[slots].get(mode="fill", fill_value=0)  # stale slots never read
    if mean:
        weights = buf.weights.at[slots].get(mode="fill", fill_value=1)
        weights = weights.reshape((-1,) + (1,) * (values.ndim - 1))
        values = values / _sums.mean_divisor(weights, values.dtype)
    table = (num_rows, *buf.values.shape[1:])
    return IndexedSlices(ids, values.astype(like.values.dtype), table)


def _reset_if(emit: jax.Array, acc: RowBuffer | DenseRows) -> RowBuffer | DenseRows:
    """The accumulator emptied if `emit`; a row buffer only resets `size` (see `_plan`
    and `_commit`)."""
    if _is_buffer(acc):
        return acc._replace(size=jnp.where(emit, 0, acc.size))
    return jax.tree.map(lambda x: jnp.where(emit, jnp.zeros((), x.dtype), x), acc)


def _gather(x: jax.Array, axis_name: Any) -> jax.Array:
    """All replicas' `x`, stacked; typed replica-invariant under `jax.shard_map`.

    The gathered stack is the same on every replica; saying so keeps the row buffers
    built from it invariant, so they need no mesh axis in a shard_map state spec.
    """
    return _collectives.all_gather(x, axis_name, invariant=True)


# --------------------------------------------------------------------------- duplicates


def _row_hash(flat: jax.Array) -> jax.Array:
    """uint32 `[n]`: a hash of each row's bits (murmur3's finaliser on every element,
    salted by its column, summed), so that equal rows hash equally."""
    bits = lax.bitcast_convert_type(flat.astype(jnp.float32), jnp.uint32)
    column = jnp.arange(flat.shape[1], dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    x = bits ^ column
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return jnp.sum(x ^ (x >> 16), axis=1, dtype=jnp.uint32)


def _combined(
    rows: jax.Array, values: jax.Array, *, dtype: Any, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """One gradient with its duplicate ids summed in `dtype`, in a fixed order.

    The rows are sorted by id, and the duplicates of an id by a hash of their values
    (ties, which only equal rows or a 32-bit hash collision give, by position): the
    same (id, row) pairs in any order come out in the same order. A segmented scan
    then adds every run of an id in that order (no scatter adds duplicates, so no
    backend can reorder them); the run's total lands on its last row, and its other
    rows become padding with zero values. The ids come out unique.
    """
    n = rows.shape[0]
    flat = values.reshape(n, -1).astype(dtype)
    if not n:
        return rows, flat.reshape(values.shape)
    position = jnp.arange(n, dtype=jnp.int32)
    rows, _, order = lax.sort((rows, _row_hash(flat), position), num_keys=2)
    flat = flat[order]
    boundary = rows[1:] != rows[:-1]
    first = jnp.concatenate([jnp.ones((1,), bool), boundary])
    last = jnp.concatenate([boundary, jnp.ones((1,), bool)])

    def add(a: tuple, b: tuple) -> tuple:
        (first_a, sum_a), (first_b, sum_b) = a, b
        return first_a | first_b, jnp.where(first_b[:, None], sum_b, sum_a + sum_b)

    _, sums = lax.associative_scan(add, (first, flat), axis=0)
    keep = last & (rows < num_rows)
    sums = jnp.where(keep[:, None], sums, jnp.zeros((), dtype))
    return jnp.where(keep, rows, num_rows), sums.reshape(values.shape)


_UNROLL = 8  # up to this many replicas, insertion is unrolled rather than scanned


def _insert_all(
    buffers: list[RowBuffer],
    grads: list[tuple[jax.Array, jax.Array]],
    offered: jax.Array,
    weights: jax.Array | None,
) -> tuple[list[RowBuffer], jax.Array, jax.Array]:
    """Inserts a stack of gradients (one per replica) in order, each whole or not at all.

    `grads[k]` is a pair of int32 row ids `[n, nnz]` and their values, and `offered`
    and `weights` (None: all 1) are `[n]`. Returns the buffers and, per gradient,
    whether it was taken and whether it overflowed.
    """

    def one(bufs, xs):
        offer, weight, indices, values = xs
        plans = [_plan(b, i) for b, i in zip(bufs, indices, strict=True)]
        fits = jnp.stack([_fits(b, p) for b, p in zip(bufs, plans, strict=True)] + [True]).all()
        take = offer & fits
        bufs = [_commit(b, p, v, take, weight) for b, p, v in zip(bufs, plans, values, strict=True)]
        return bufs, (take, offer & ~fits)

    xs = (offered, weights, [ids for ids, _ in grads], [values for _, values in grads])
    if offered.shape[0] > _UNROLL:
        buffers, (taken, overflowed) = lax.scan(one, buffers, xs)
        return buffers, taken, overflowed
    flags = []
    for r in range(offered.shape[0]):  # few replicas: unrolled, no loop-carried copies
        buffers, flag = one(buffers, jax.tree.map(lambda x: x[r], xs))  # noqa: B023
        flags.append(flag)
    taken, overflowed = (jnp.stack(f) for f in zip(*flags, strict=True))
    return buffers, taken, overflowed


# --------------------------------------------------------------------------- transform


def sparse_conditional_accumulator(
    inner: optax.GradientTransformation,
    num_required: _counters.NumRequired,
    *,
    capacity: int,
    reduction: str = "mean",
    axis_name: Any = None,
    sparse: Any = None,
    skip_nonfinite: bool = False,
    should_skip_update_fn: Callable[..., Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates step-tagged, row-sparse gradients and releases them to `inner`.

    The accept and release rules are those of `conditional_accumulator`: a gradient
    tagged with `local_step` (extra argument; omitted means up to date) is accepted
    iff `local_step >= global_step`, stale ones are dropped and counted, and once
    `num_required` gradients are accepted the aggregate goes through `inner`, whose
    updates are returned, and `global_step` advances. Other steps return zeros.

    Sparse leaves (chosen by `sparse`) take `IndexedSlices` gradients. Their
    aggregate is per row: SUM adds each row, MEAN divides each row by the number of
    accepted gradients that touched it (not by `count`). With the extra argument
    `weight` (a non-negative scalar per gradient, 1 if omitted), each row is the sum of
    `weight * row` over those gradients, and MEAN divides it by the sum of their
    weights (a row whose weights sum to 0 releases zeros). A release still comes after
    `num_required` accepted gradients, whatever their weights. Duplicate ids within one
    gradient are summed and count once; ids (of any integer dtype) outside `[0, rows)`
    are padding and ignored. Each sparse leaf holds at most `capacity` distinct rows:
    a gradient that would exceed it in any leaf is rejected whole and counted in
    `num_overflowed`, never cut. The release is an `IndexedSlices` with sorted, unique
    row ids, padded to `capacity` with the id `rows`.

    Dense leaves keep a running sum and a count per row (`DenseRows`). A dense
    gradient touches every row, so dense gradients accumulate exactly as in
    `conditional_accumulator`. An `IndexedSlices` offered to a dense leaf (a small
    embedding table, say) is scatter-added there, and MEAN divides each row by the
    gradients that touched it, as for a sparse leaf; the release is a dense array. So
    a table releases the same numbers whether `capacity` keeps it sparse or not.

    `inner` sees the released tree: use `sparse_sgd` to update only the touched rows, or
    `optax.chain(densify(), any_optimizer)` for a dense optimizer (which then does
    table-sized work on releasing steps only). Apply the updates with
    `optax_accum.apply_updates`. Never hand raw `IndexedSlices` to optax's element-wise
    transforms: they would change the indices too (floating indices raise a TypeError).
    With mixed precision (float32 gradients on bfloat16 params, say), the updates
    have the dtypes of `inner`'s own updates, held steps included.

    With `axis_name`, the replicas of that axis share one accumulator: every step the
    replicas' sparse gradients are gathered and inserted in replica order (so every
    replica holds the same rows, and overflow is decided the same everywhere), while
    dense leaves are summed across replicas on releasing steps only. There, each
    replica first sums its gradient's duplicate ids, in an order fixed by the ids and
    the rows' values, so results are the same bits on every replica and in every
    run, on GPUs too, whatever order the rows arrive in (barring a 32-bit hash
    collision between two different rows of one id); the sums travel in the
    gradient's dtype. (On one device, duplicates are added by a scatter, in the order
    the backend chooses; GPUs do not fix it.)

    Cost: an update does a few gathers and scatters over the gradient's rows, and no
    sort; a release sorts the `capacity` row ids. Nothing scales with the table,
    except the map's memory (4 bytes per table row). With `axis_name`, each replica
    also sorts its own gradient's row ids every step. `docs/design.md` says how.

    TF counterpart: `tf.sparse.SparseConditionalAccumulator` (its
    `apply_indexed_slices_grad` and `take_indexed_slices_grad`). Differences from
    TF: duplicates and unsorted ids follow their dense meaning (TF
    keeps duplicates apart); out-of-range ids are ignored and counted in
    `num_out_of_range` instead of raising (values cannot raise inside jit); the
    release is padded to `capacity`.

    Args:
      inner: the optimizer that transforms each released aggregate.
      num_required: a positive int, or a schedule `f(global_step) -> int`.
      capacity: a positive int, the most distinct rows a sparse leaf holds between
        releases.
      reduction: "mean" (default) or "sum", in any case.
      axis_name: optional name (or tuple of names) of a mapped axis whose replicas share
        the accumulator.
      sparse: which param leaves are sparse: a tree of bools (Python or NumPy) shaped
        like the params, or a function of the params returning one. Default: every
        leaf of rank >= 2 with more rows than `capacity` (an embedding table). A sparse
        leaf must have at least one row.
      skip_nonfinite: if True, a gradient holding any NaN or Inf is skipped and counted
        in `num_nonfinite`; by default it is accumulated as given, as TF does.
      should_skip_update_fn: optional rule with `optax.MultiSteps`' signature,
        `(updates, gradient_step, params) -> bool` (or its pair of a bool and a
        debugging tree, which is discarded), called with the gradient as given
        (`IndexedSlices` leaves included: mind their indices), `global_step` and
        `params`. A fresh gradient it skips is neither accumulated nor counted as
        accepted, and is counted in `num_skipped`; nothing else changes.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `SparseConditionalAccumulatorState`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; at `init`, for a bad
        `sparse` tree or a sparse leaf without rows; at trace time, for
        gradients whose structure, kinds (sparse or dense), shapes or dtypes do not
        match, for a bad `local_step`, for a non-scalar `weight` or a concrete one
        that is negative or not finite (a traced one is skipped and counted in
        `num_skipped`), and for a rule that does not return a bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=3)
      >>> table = jnp.zeros((5, 2))
      >>> state = tx.init(table)
      >>> grad = lambda ids, rows: optax_accum.IndexedSlices(
      ...     jnp.array(ids), jnp.array(rows), (5, 2))
      >>> u, state = tx.update(grad([0, 1], [[1.0, 0.0], [0.0, 2.0]]), state)
      >>> u, state = tx.update(grad([0, 4], [[0.0, 1.0], [3.0, 0.0]]), state)
      >>> u.indices.tolist(), u.values.tolist()
      ([0, 1, 4], [[-0.5, -0.5], [-0.0, -2.0], [-3.0, -0.0]])
      >>> optax_accum.apply_updates(table, u)[:, 0].tolist()
      [-0.5, 0.0, 0.0, 0.0, -3.0]
      >>> # Weighted: row 0 is (1 * 1 + 3 * 3) / (1 + 3), row 4 is (3 * 2) / 3.
      >>> _, state = tx.update(grad([0], [[1.0, 1.0]]), state, weight=1)
      >>> u, state = tx.update(grad([0, 4], [[3.0, 3.0], [2.0, 2.0]]), state, weight=3)
      >>> u.indices.tolist(), u.values[:2].tolist()
      ([0, 4, 5], [[-2.5, -2.5], [-2.0, -2.0]])
    """
    inner = _extra_args.forward_to("inner", inner)
    required = _counters.num_required_fn(num_required)
    capacity = _checks.require_positive_int("capacity", capacity)
    mean = _checks.canonical_reduction(reduction) == "mean"
    axis_name = _checks.require_axis_name("axis_name", axis_name)
    skip_nonfinite = _checks.require_bool("skip_nonfinite", skip_nonfinite)
    skip_rule = _sums.require_skip_rule(should_skip_update_fn)
    if sparse is not None and not callable(sparse):
        jax.tree.map(lambda m: _checks.require_bool("sparse", m), sparse)

    def init_fn(params: optax.Params) -> SparseConditionalAccumulatorState:
        _checks.require_floating_params(params)
        mask = _sparse_mask(sparse, params, capacity)
        # Each counter gets its own buffer, so the state can be donated as it comes.
        return SparseConditionalAccumulatorState(
            global_step=_counters.int32(0),
            count=_counters.int32(0),
            num_dropped=_counters.int32(0),
            num_nonfinite=_counters.int32(0),
            num_skipped=_counters.int32(0),
            num_overflowed=_counters.int32(0),
            num_out_of_range=_counters.int32(0),
            emitted=jnp.asarray(False),
            accumulator=jax.tree.map(
                lambda p, m: _empty_buffer(p, capacity) if m else _dense_rows(p),
                params,
                mask,
            ),
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: SparseConditionalAccumulatorState,
        params: optax.Params | None = None,
        *,
        local_step: Any = None,
        weight: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SparseConditionalAccumulatorState]:
        _checks.require_state(state, SparseConditionalAccumulatorState)
        _extra_args.warn_misspelled(extra_args)
        _check_updates(updates, state.accumulator)
        step = _counters.local_step_or(local_step, state.global_step)
        w, weight_ok = _sums.weight_or_none(weight)
        fresh = step >= state.global_step
        grads = jax.tree.leaves(updates, is_leaf=_is_slices)
        accs = jax.tree.leaves(state.accumulator, is_leaf=_is_accumulator)
        finite = _all_finite(grads, accs) if skip_nonfinite else jnp.asarray(True)
        rule = _sums.skip_rule(skip_rule, updates, state.global_step, params)
        kept = weight_ok if rule is None else weight_ok & ~rule
        offered = fresh & finite & kept
        # Every IndexedSlices as int32 row ids, ids outside the table as the padding id:
        # exact for ids of every integer dtype. Out-of-range ids cannot raise under jit:
        # they are ignored and counted.
        slices: list[Any] = [None] * len(grads)
        out_of_range = jnp.int32(0)
        for i, (g, a) in enumerate(zip(grads, accs, strict=True)):
            if isinstance(g, IndexedSlices):
                out_of_range = out_of_range + _row_ids.num_out_of_range(g.indices, _num_rows(a))
                ids = _row_ids.row_ids(g.indices, _num_rows(a))
                if _is_buffer(a):  # the row buffer is replicated, and so is its input
                    ids, values = _compat.replicated_under_auto((ids, g.values))
                else:
                    values = g.values
                slices[i] = (ids, values)
        sparse_at = [i for i, a in enumerate(accs) if _is_buffer(a)]
        if axis_name is not None:
            _checks.require_bound_axis(axis_name)
            # Each replica sums its own gradient's duplicate ids in a fixed order, so
            # every replica (and every run) gets the same bits whatever order a scatter
            # would add them in. Gathered in the gradient's dtype.
            for i, (g, a) in enumerate(zip(grads, accs, strict=True)):
                if slices[i] is not None:
                    ids, sums = _combined(*slices[i], dtype=a.values.dtype, num_rows=_num_rows(a))
                    slices[i] = (ids, sums.astype(g.values.dtype) if _is_buffer(a) else sums)
            stacked = [tuple(_gather(x, axis_name) for x in slices[i]) for i in sparse_at]
            me = lax.axis_index(axis_name)
            if w is None:
                offers, weights = _gather(offered, axis_name), None
            else:  # one all-gather for both
                both = _gather(jnp.stack([offered.astype(w.dtype), w]), axis_name)
                offers, weights = both[:, 0] > 0, both[:, 1]
        else:
            stacked = [jax.tree.map(lambda x: x[None], slices[i]) for i in sparse_at]
            me = 0
            offers, weights = offered[None], None if w is None else w[None]
        buffers, taken, overflowed = _insert_all(
            [accs[i] for i in sparse_at], stacked, offers, weights
        )
        accepted, overflow = taken[me], overflowed[me]
        for i, buf in zip(sparse_at, buffers, strict=True):
            accs[i] = buf
        accs = [
            a if _is_buffer(a) else _add_dense(accepted, a, g, s, w)
            for a, g, s in zip(accs, grads, slices, strict=True)
        ]
        accumulator = jax.tree.unflatten(
            jax.tree.structure(state.accumulator, is_leaf=_is_accumulator), accs
        )
        flags = [accepted, ~fresh, fresh & ~finite, overflow, fresh & finite & ~kept]
        arrived = jnp.stack(
            [f.astype(jnp.int32) for f in flags] + [jnp.where(accepted, out_of_range, 0)]
        )
        if axis_name is not None:
            arrived = lax.psum(arrived, axis_name)
        count = _counters.saturating_add(state.count, arrived[0])
        emit = count >= required(state.global_step)

        def aggregate(accumulator):
            def leaf(a, g):
                if _is_buffer(a):
                    return _release_rows(a, mean, g)
                like = g.values if isinstance(g, IndexedSlices) else g
                return _release_dense(a, mean, like, axis_name)

            return jax.tree.map(leaf, accumulator, updates, is_leaf=_is_accumulator)

        # The release reads the accumulator and never returns it; a held step passes
        # the inner state on untouched (see _branch).
        def release(inner_state):
            return inner.update(aggregate(accumulator), inner_state, params, **extra_args)

        new_updates, inner_state = _branch.update_if(
            emit, release, state.inner_state, salt=count, params=params, held=_as_padding
        )
        accumulator = jax.tree.map(
            lambda a: _reset_if(emit, a), accumulator, is_leaf=_is_accumulator
        )
        new_state = SparseConditionalAccumulatorState(
            global_step=_counters.increment_if(emit, state.global_step),
            count=jnp.where(emit, 0, count),
            num_dropped=_counters.saturating_add(state.num_dropped, arrived[1]),
            num_nonfinite=_counters.saturating_add(state.num_nonfinite, arrived[2]),
            num_skipped=_counters.saturating_add(state.num_skipped, arrived[4]),
            num_overflowed=_counters.saturating_add(state.num_overflowed, arrived[3]),
            num_out_of_range=_counters.saturating_add(state.num_out_of_range, arrived[5]),
            emitted=emit,
            accumulator=accumulator,
            inner_state=inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_padding(tree: Any) -> Any:
    """Zero `IndexedSlices` leaves get padding ids, so applying them touches no row."""

    def pad(u: Any) -> Any:
        if not isinstance(u, IndexedSlices):
            return u
        return IndexedSlices(jnp.full_like(u.indices, u.padding_index), u.values, u.dense_shape)

    return jax.tree.map(pad, tree, is_leaf=_is_slices)


def sparse_sgd(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformationExtraArgs:
    """SGD that scales only the values of `IndexedSlices` (and dense leaves as usual).

    `optax.sgd` must not see raw `IndexedSlices`: it would scale the row ids too. This
    is `optax.sgd(learning_rate)` (without momentum) for trees that mix `IndexedSlices`
    and arrays: each update is `-learning_rate * gradient`, and sparse updates stay
    sparse, so `sparse_conditional_accumulator(sparse_sgd(lr), ...)` followed by
    `optax_accum.apply_updates` writes only the rows some gradient touched.

    TF counterpart: `tf.train.GradientDescentOptimizer` applied to `tf.IndexedSlices`
    gradients, which updates only their rows.

    Args:
      learning_rate: a scalar (may be traced, for `optax.inject_hyperparams`) or an
        `optax.Schedule` of the update count.

    Returns:
      An `optax.GradientTransformationExtraArgs`, with the state of
      `optax.scale_by_learning_rate`.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> g = optax_accum.IndexedSlices(jnp.array([3]), jnp.array([[2.0]]), (5, 1))
      >>> tx = optax_accum.sparse_sgd(0.5)
      >>> u, _ = tx.update(g, tx.init(jnp.zeros((5, 1))))
      >>> u.indices.tolist(), u.values.tolist()
      ([3], [[-1.0]])
    """
    scale = optax.scale_by_learning_rate(learning_rate)

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        del params, extra_args
        values = jax.tree.map(
            lambda u: u.values if isinstance(u, IndexedSlices) else u,
            updates,
            is_leaf=_is_slices,
        )
        scaled, state = scale.update(values, state)
        rebuilt = jax.tree.map(
            lambda u, s: (
                IndexedSlices(u.indices, s, u.dense_shape) if isinstance(u, IndexedSlices) else s
            ),
            updates,
            scaled,
            is_leaf=_is_slices,
        )
        return rebuilt, state

    return optax.GradientTransformationExtraArgs(scale.init, update_fn)


__all__ = [
    "DenseRows",
    "RowBuffer",
    "SparseConditionalAccumulatorState",
    "sparse_conditional_accumulator",
    "sparse_sgd",
]
