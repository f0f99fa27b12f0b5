"""A sparse leaf's row buffer: where a gradient's rows go, adding them, releasing them.

`sparse_conditional_accumulator` keeps a `RowBuffer` for each leaf `sparse_mask`
chooses: up to `capacity` distinct rows in arrival order, and their slots in order of
their rows. `offer` inserts a step's gradients (under an `axis_name`, every replica's,
in replica order), each whole or not at all: it sorts a gradient's ids, finds them
among the held rows by binary search and merges the new ones into the order, so a
step's work grows with the gradient and the buffer, never with the table; `release`
reads the rows out sorted and unique, with no sort. Replicas that share the buffers first sum
each gradient's duplicate ids in a fixed order (`combined`, which the dense leaves
use too). The functions take and return `RowBuffer`s (new ones made with `_replace`).
`docs/design.md`, "The sparse accumulator", says why it is built this way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _checks, _collectives, _compat, _counters, _row_ids, _sums
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
      order: int32 `[capacity]`, the slots in use ordered by the row each holds
        (`rows[order[:size]]` ascends); the entries from `size` on are stale.
      slot_of: int32 `[table rows]`, its shape the table's rows; no step reads or
        writes it. (Up to optax_accum 0.1.0 it mapped each row to its slot; read on
        every step, such a map was copied into TPU's faster memory and back on each
        step whenever it fit there, so a step's bytes grew with the table.)

    Find a held row by binary search of the rows in `order` (TF keeps no such buffer:
    its accumulator stores the gradients' rows as they come). A gradient's new rows
    take the next slots in the order of their ids.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=2)
      >>> state = tx.init(jnp.zeros((5, 1)))
      >>> g = optax_accum.IndexedSlices(jnp.array([3, 3]), jnp.ones((2, 1)), (5, 1))
      >>> _, state = tx.update(g, state)  # row 3, twice: summed, counted once
      >>> buf = state.storage
      >>> held = buf.rows[buf.order[:int(buf.size)]]  # the rows, ascending
      >>> slot = int(buf.order[jnp.searchsorted(held, 3)])
      >>> int(buf.size), int(buf.rows[slot]), float(buf.values[slot, 0]), int(buf.touches[slot])
      (1, 3, 2.0, 1)
    """

    rows: jax.Array
    values: jax.Array
    touches: jax.Array
    weights: jax.Array
    size: jax.Array
    order: jax.Array
    slot_of: jax.Array


def empty(param: Any, capacity: int) -> RowBuffer:
    """An empty buffer of `capacity` slots for the table `param`."""
    shape = jnp.shape(param)
    dtype = _sums.accumulator_dtype_for(jnp.result_type(param), None)
    return RowBuffer(
        rows=jnp.full((capacity,), shape[0], jnp.int32),
        values=jnp.zeros((capacity, *shape[1:]), dtype),
        touches=jnp.zeros((capacity,), jnp.int32),
        weights=jnp.zeros((capacity,), _sums.WEIGHT_DTYPE),
        size=_counters.int32(0),
        order=jnp.arange(capacity, dtype=jnp.int32),
        slot_of=jnp.full((shape[0],), -1, jnp.int32),
    )


def _num_rows(buf: RowBuffer) -> int:
    """The table's rows (static: the shape of `slot_of`)."""
    return buf.slot_of.shape[0]


def upgraded(saved: Any) -> Any:
    """A buffer restored from a checkpoint (a dict of its fields) with today's fields:
    0.1.0's buffers found their rows through `slot_of` and kept no `order`, which is
    made here from their rows (the held slots ordered by row: a sort of `capacity` ids,
    at restore time only). Anything else is returned as it is."""
    if not isinstance(saved, dict) or "order" in saved:
        return saved
    rows, size = np.asarray(saved["rows"]), int(np.asarray(saved["size"]))
    held = np.where(np.arange(rows.shape[0]) < size, rows, np.iinfo(np.int32).max)
    return saved | {"order": np.argsort(held, kind="stable").astype(np.int32)}


# --------------------------------------------------------------------------- which leaves


def sparse_mask(sparse: Any, params: Any, capacity: int) -> Any:
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


# --------------------------------------------------------------------------- insertion


def offer(
    buffers: list[RowBuffer],
    grads: list[IndexedSlices],
    offered: jax.Array,
    weight: jax.Array | None,
    axis_name: Any,
) -> tuple[list[RowBuffer], jax.Array, jax.Array, jax.Array]:
    """Offers the sparse leaves' gradients to their buffers, whole or not at all.

    Each gradient's ids become int32 row ids, those outside the table the padding id
    (exact for ids of every integer dtype; they cannot raise under jit, so they are
    ignored and counted). Under `axis_name`, every replica's gradient is inserted, in
    replica order, so every replica holds the same rows. Returns the buffers, whether
    this replica's gradient was taken, whether it overflowed, and how many of its row
    ids lay outside the tables.
    """
    if axis_name is not None:
        _checks.require_bound_axis(axis_name)
    slices, out_of_range = [], jnp.int32(0)
    for buf, g in zip(buffers, grads, strict=True):
        num_rows = _num_rows(buf)
        out_of_range = out_of_range + _row_ids.num_out_of_range(g.indices, num_rows)
        ids = _row_ids.row_ids(g.indices, num_rows)
        # The row buffer is replicated, and so is its input: ids and rows split over a
        # batch axis are gathered (one all-gather of the step's rows, never the table).
        slices.append(_compat.replicated((ids, g.values)))
    if axis_name is None:
        stacked = [jax.tree.map(lambda x: x[None], s) for s in slices]
        me, offers, weights = 0, offered[None], None if weight is None else weight[None]
    else:
        stacked, offers, weights = _gathered(buffers, slices, offered, weight, axis_name)
        me = lax.axis_index(axis_name)
    buffers, taken, overflowed = insert_all(buffers, stacked, offers, weights)
    return buffers, taken[me], overflowed[me], out_of_range


def _gathered(
    buffers: list[RowBuffer],
    slices: list[tuple[jax.Array, jax.Array]],
    offered: jax.Array,
    weight: jax.Array | None,
    axis_name: Any,
) -> tuple[list[tuple[jax.Array, jax.Array]], jax.Array, jax.Array | None]:
    """Every replica's row slices, offers and weights (None without weights), stacked.

    Each replica sums its own gradient's duplicate ids in a fixed order, so every
    replica (and every run) gets the same bits whatever order a scatter would add them
    in. Gathered in the gradient's dtype.
    """
    stacked = []
    for buf, (ids, values) in zip(buffers, slices, strict=True):
        ids, sums = combined(ids, values, dtype=buf.values.dtype, num_rows=_num_rows(buf))
        stacked.append((_gather(ids, axis_name), _gather(sums.astype(values.dtype), axis_name)))
    if weight is None:
        return stacked, _gather(offered, axis_name), None
    both = _gather(jnp.stack([offered.astype(weight.dtype), weight]), axis_name)  # one gather
    return stacked, both[:, 0] > 0, both[:, 1]


def _gather(x: jax.Array, axis_name: Any) -> jax.Array:
    """All replicas' `x`, stacked; typed replica-invariant under `jax.shard_map`.

    The gathered stack is the same on every replica; saying so keeps the row buffers
    built from it invariant, so they need no mesh axis in a shard_map state spec.
    """
    return _collectives.all_gather(x, axis_name, invariant=True)


class _Plan(NamedTuple):
    """Where one gradient's rows go in a buffer, found among the held rows alone."""

    rows: jax.Array  # the gradient's row ids, sorted (padding, the table's rows, last)
    first: jax.Array  # True at the first of each run of a real row
    new: jax.Array  # True there when the row is not in the buffer yet
    slot: jax.Array  # the slot of each sorted id's row (capacity for padding)
    at: jax.Array  # how many held rows lie below each sorted id
    rank: jax.Array  # the new rows up to each sorted id, less one: a new row's rank
    arrived: jax.Array  # the slot of each id as the gradient gives them
    num_new: jax.Array  # how many slots the gradient would add


def _held_in_order(buf: RowBuffer, num_rows: int) -> jax.Array:
    """int32 `[capacity]`: the held rows ascending, then `num_rows` (past every id)."""
    used = jnp.arange(buf.rows.shape[0], dtype=jnp.int32) < buf.size
    return jnp.where(used, buf.rows.at[buf.order].get(mode="fill", fill_value=num_rows), num_rows)


def _search(ascending: jax.Array, ids: jax.Array) -> jax.Array:
    """int32: how many entries of `ascending` lie below each id.

    A binary search unrolled over a power-of-two padding of `ascending` (no loop), each
    step one gather and one compare, so XLA fuses the steps into a few passes.
    """
    n = ascending.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    top = jnp.iinfo(jnp.int32).max
    padded = jnp.concatenate([ascending, jnp.full((size - n,), top, jnp.int32)])
    below = jnp.zeros(ids.shape, jnp.int32)
    step = size // 2
    while step:
        below = below + step * (padded[below + step - 1] < ids).astype(jnp.int32)
        step //= 2
    return below + (padded[below] < ids).astype(jnp.int32)


_GROUP = 16


def _running_sum(x: jax.Array) -> jax.Array:
    """The running sum of a 1-D int32 array: running sums within groups of 16 (adds
    that XLA fuses), then of the groups' totals, added back. XLA:CPU runs this several
    times faster than `jnp.cumsum`, which it lowers to reduce-windows."""
    n = x.shape[0]
    if n <= _GROUP:
        return jnp.cumsum(x, dtype=jnp.int32)
    groups = jnp.pad(x, (0, -n % _GROUP)).reshape(-1, _GROUP)
    columns = [groups[:, 0]]
    for j in range(1, _GROUP):
        columns.append(columns[-1] + groups[:, j])
    within = jnp.stack(columns, axis=1)
    totals = within[:, -1]
    return (within + (_running_sum(totals) - totals)[:, None]).reshape(-1)[:n]


_PACKED = 2**32  # the keys a uint32 holds


def _sorted(rows: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array | None]:
    """The ids ascending and where each stood in `rows` (None when the two do not
    pack into one uint32 key, `id * len(rows) + position`: a sort with a payload
    costs XLA:CPU several times a sort of one key)."""
    n = rows.shape[0]
    if (num_rows + 1) * max(n, 1) > _PACKED:
        return jnp.sort(rows), None
    key = jnp.sort(rows.astype(jnp.uint32) * jnp.uint32(n) + jnp.arange(n, dtype=jnp.uint32))
    return (key // jnp.uint32(n)).astype(jnp.int32), (key % jnp.uint32(n)).astype(jnp.int32)


def _plan(buf: RowBuffer, rows: jax.Array) -> _Plan:
    """Looks the gradient's rows up among the held ones: a sort of the gradient's ids
    and binary searches of the `capacity` held rows in order; nothing per table row.

    `rows` are int32 row ids, with every id outside the table already the padding id
    (see `_row_ids.row_ids`). A gradient's new rows take slots in the order of their
    ids.
    """
    num_rows, capacity = _num_rows(buf), buf.rows.shape[0]
    ids, position = _sorted(rows, num_rows)
    held_rows = _held_in_order(buf, num_rows)
    at = _search(held_rows, ids)
    real = ids < num_rows
    held = real & (held_rows.at[at].get(mode="fill", fill_value=num_rows) == ids)
    first = real & jnp.concatenate([jnp.ones(ids.shape[:1], bool)[:1], ids[1:] != ids[:-1]])
    new = first & ~held
    # A run's duplicates follow its first id and are not new, so they share its rank.
    rank = _running_sum(new.astype(jnp.int32)) - 1
    slot = jnp.where(held, buf.order.at[at].get(mode="fill", fill_value=capacity), buf.size + rank)
    slot = jnp.where(real, slot, capacity)
    if position is None:  # each id's run starts where the search lands
        arrived = slot[_search(ids, rows)]
    else:
        arrived = jnp.zeros_like(slot).at[position].set(slot, unique_indices=True)
    return _Plan(ids, first, new, slot, at, rank, arrived, jnp.sum(new, dtype=jnp.int32))


def _fits(buf: RowBuffer, plan: _Plan) -> jax.Array:
    return buf.size + plan.num_new <= buf.rows.shape[0]


def _merged_order(buf: RowBuffer, plan: _Plan, take: jax.Array) -> jax.Array:
    """`order` with the new rows merged in (when `take`): each held row moves up by the
    number of new rows below it, each new row lands past the held rows below it and
    the new rows before it."""
    capacity = buf.rows.shape[0]
    index = jnp.arange(capacity, dtype=jnp.int32)
    below = (
        jnp.zeros((capacity,), jnp.int32)
        .at[jnp.where(plan.new, plan.at, capacity)]
        .add(1, mode="drop")
    )
    shift = _running_sum(below)  # the new rows at or below each held row
    keep = take & (index < buf.size)
    order = buf.order.at[jnp.where(keep, index + shift, capacity)].set(buf.order, mode="drop")
    to = jnp.where(take & plan.new, plan.at + plan.rank, capacity)
    return order.at[to].set(plan.slot, mode="drop")


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
    arrived = jnp.where(take, plan.arrived, capacity)  # the values come in the gradient's order
    added = _sums.weighted(values, weight, buf.values.dtype)
    return buf._replace(
        rows=buf.rows.at[new_slot].set(plan.rows, mode="drop"),
        values=cleared.at[arrived].add(added, mode="drop"),
        touches=touches.at[first].add(1, mode="drop"),
        weights=weights.at[first].add(1 if weight is None else weight, mode="drop"),
        size=jnp.where(take, buf.size + plan.num_new, buf.size),
        order=_merged_order(buf, plan, take),
    )


_UNROLL = 8  # up to this many replicas, insertion is unrolled rather than scanned


def insert_all(
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


# --------------------------------------------------------------------------- release


def release(buf: RowBuffer, mean: bool, like: IndexedSlices) -> IndexedSlices:
    """The buffer's rows, sorted and unique, padded to capacity; per-row mean if `mean`.

    The rows are kept in order (`order`), so nothing is sorted here.
    """
    num_rows, capacity = _num_rows(buf), buf.rows.shape[0]
    used = jnp.arange(capacity, dtype=jnp.int32) < buf.size
    ids = _held_in_order(buf, num_rows)
    slots = jnp.where(used, buf.order, capacity)
    values = buf.values.at[slots].get(mode="fill", fill_value=0)  # stale slots never read
    if mean:
        weights = buf.weights.at[slots].get(mode="fill", fill_value=1)
        weights = weights.reshape((-1,) + (1,) * (values.ndim - 1))
        values = values / _sums.mean_divisor(weights, values.dtype)
    table = (num_rows, *buf.values.shape[1:])
    return IndexedSlices(ids, values.astype(like.values.dtype), table)


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


def combined(
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
