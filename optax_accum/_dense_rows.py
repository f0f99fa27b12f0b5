"""A dense leaf's running sum in `sparse_conditional_accumulator`: adding a gradient
(dense, or the rows of an `IndexedSlices`) with a count and a weight sum per row
(`add_all`), and releasing it with each row's mean (`release`).

The functions take and return `DenseRows` (new ones made with `_replace`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _branch, _compat, _row_buffer, _row_ids, _sums, _unreduced
from optax_accum.indexed_slices import IndexedSlices


class DenseRows(NamedTuple):
    """One dense leaf's running sum, and how many accepted gradients touched each row.

    A dense gradient touches every row; an `IndexedSlices` gradient offered to a dense
    leaf touches its distinct row ids. MEAN divides each row by the weight sum of the
    gradients that touched it (their count, without weights), so a row's mean does not
    depend on whether its leaf is kept sparse or dense.

    TF counterpart: the running sum of `tf.ConditionalAccumulator`, with a count per row
    for the per-row mean of `tf.sparse.SparseConditionalAccumulator`.

    A release spends all three: while the state's `emitted` is True they hold no
    meaningful values (the counts the last window's; the values its sums or, where
    every leaf is dense, the released updates, which travel out of the release in
    their buffers), and the next `update` starts from zeros.

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
      >>> state.storage.touches.tolist(), state.storage.values[:, 0].tolist()
      ([1, 2, 1, 1], [1.0, 2.0, 1.0, 1.0])
    """

    values: jax.Array
    touches: jax.Array
    weights: jax.Array


def empty(param: Any) -> DenseRows:
    """An empty running sum for the dense leaf `param`."""
    return DenseRows(
        values=_sums.zeros_accumulator(param),
        touches=_sums.row_zeros(param, jnp.int32),
        weights=_sums.row_zeros(param, _sums.WEIGHT_DTYPE),
    )


def add_all(
    accepted: jax.Array,
    accs: list[DenseRows],
    grads: list,
    weight: jax.Array | None,
    axis_name: Any,
    restart: jax.Array,
) -> tuple[list[DenseRows], jax.Array]:
    """The dense leaves with their gradients added if `accepted`, and how many row ids
    of their `IndexedSlices` gradients lay outside the leaves (ignored).

    After a release (`restart`), the leaves' sums, counts and weights start from zeros:
    a dense gradient selects them in the pass that adds it; before an `IndexedSlices`
    gradient's scatter, a branch zeroes them (only on that step).

    Under `axis_name`, each replica first sums its own gradient's duplicate ids in a
    fixed order, as for the row buffers, so its scatter meets no duplicate ids and gives
    the same bits in every run.
    """
    added, out_of_range = [], jnp.int32(0)
    for acc, g in zip(accs, grads, strict=True):
        rows = None
        if isinstance(g, IndexedSlices):
            num_rows = acc.values.shape[0]
            out_of_range = out_of_range + _row_ids.num_out_of_range(g.indices, num_rows)
            rows = (_row_ids.row_ids(g.indices, num_rows), g.values)
            if axis_name is not None:
                rows = _row_buffer.combined(*rows, dtype=acc.values.dtype, num_rows=num_rows)
        added.append(_add(accepted, acc, g, rows, weight, restart))
    return added, out_of_range


def _add(
    accepted: jax.Array,
    acc: DenseRows,
    gradient: Any,
    rows: Any,
    weight: jax.Array | None,
    restart: jax.Array,
) -> DenseRows:
    """A dense leaf's accumulation, each row weighted by `weight` (None: 1). An
    `IndexedSlices` gradient (given as `rows`, a pair of int32 row ids and values) is
    scatter-added, each distinct row counted once; a gradient not accepted is aimed out
    of range, so nothing is written."""
    added = 1 if weight is None else weight
    if rows is None:
        acc = jax.tree.map(lambda x: _sums.restarted(restart, x), acc)
        return acc._replace(
            values=_sums.add_where(accepted, acc.values, gradient, weight),
            touches=_sums.select(accepted, acc.touches + 1, acc.touches),
            weights=_sums.select(accepted, acc.weights + added, acc.weights),
        )
    acc = _branch.apply_if(restart, lambda a: jax.tree.map(jnp.zeros_like, a), acc)
    ids, values = rows
    ids = jnp.where(accepted, ids, acc.values.shape[0])
    # Every occurrence of a row writes the same count, so duplicates count once.
    rows_like_ids = _compat.sharding_of(ids)
    touched = acc.touches.at[ids].get(mode="fill", fill_value=0, out_sharding=rows_like_ids)
    weighed = acc.weights.at[ids].get(mode="fill", fill_value=0, out_sharding=rows_like_ids)
    values = _sums.weighted(values, weight, acc.values.dtype)
    return acc._replace(  # in the accumulator's layout (explicit sharding: its row shards)
        values=acc.values.at[ids].add(
            values, mode="drop", out_sharding=_compat.sharding_of(acc.values)
        ),
        touches=acc.touches.at[ids].set(
            touched + 1, mode="drop", out_sharding=_compat.sharding_of(acc.touches)
        ),
        weights=acc.weights.at[ids].set(
            weighed + added, mode="drop", out_sharding=_compat.sharding_of(acc.weights)
        ),
    )


def release(
    acc: DenseRows, mean: bool, like: Any, axis_name: Any, *, total: Any = None
) -> jax.Array:
    """A dense leaf released: summed over `axis_name`, each row divided by its weight
    sum if `mean` (by the number of accepted gradients, when all of them were dense and
    unweighted). `total`: the values already reduced (a narrow wire's), or None."""
    weights = acc.weights
    if total is None:
        total = _unreduced.reduced_sum(acc.values)  # the one all-reduce
        if axis_name is not None:
            total = lax.psum(total, axis_name)
    if mean:
        if axis_name is not None:
            weights = lax.psum(weights, axis_name)
        weights = weights.reshape(weights.shape + (1,) * (total.ndim - weights.ndim))
        total = total / _sums.mean_divisor(weights, total.dtype)
    return total.astype(jnp.result_type(like))
