"""The functional SparseConditionalAccumulator: row-sparse, step-tagged accumulation.

TF1's `tf.sparse.SparseConditionalAccumulator` accumulates `IndexedSlices` gradients
(an embedding table's few touched rows) and averages each row over the gradients that
touched it. `sparse_conditional_accumulator` is that rule as a jit-able Optax
transform with static shapes: each sparse leaf keeps at most `capacity` distinct rows,
found among its slots kept in row order, so an update costs work in proportion to the
gradient's rows and the capacity, never to the table's size. `sparse_sgd` updates only those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from optax_accum import (
    _checks,
    _counters,
    _engine,
    _reductions,
    _row_buffer,
    _storages,
    _wire,
)
from optax_accum._dense_rows import DenseRows
from optax_accum._row_buffer import RowBuffer


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
      storage: the params' tree, holding a `RowBuffer` for each sparse leaf and a
        `DenseRows` (per replica under an `axis_name`) for each dense leaf: the
        window's running sums while `emitted` is False. A release resets each row
        buffer's `size`; the dense leaves hold no meaningful values after a release
        (when every leaf is dense, the updates travel out in their buffers) until the
        next `update` starts them from zeros. A dense leaf whose `reduction`
        is "max" or "min" holds a `RunningMax` or `RunningMin` of its values instead.
      inner_state: the wrapped optimizer's state.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=1)
      >>> state = tx.init(jnp.zeros((4, 2)))
      >>> g = optax_accum.IndexedSlices(jnp.array([0, 3]), jnp.ones((2, 2)), (4, 2))
      >>> _, state = tx.update(g, state)  # two rows do not fit in capacity 1
      >>> int(state.count), int(state.num_overflowed), type(state.storage).__name__
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
    storage: Any
    inner_state: optax.OptState


# --------------------------------------------------------------------------- transform


def sparse_conditional_accumulator(
    inner: optax.GradientTransformation,
    num_required: _counters.NumRequired,
    *,
    capacity: int,
    reduction: Any = "mean",
    axis_name: Any = None,
    sparse: Any = None,
    skip_nonfinite: bool = False,
    should_skip_update_fn: Callable[..., Any] | None = None,
    communication_dtype: Any = None,
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
    dense leaves (their sums and per-row counts, one all-reduce each, which XLA may
    pack into one) are summed across replicas on releasing steps only. There, each
    replica first sums its gradient's duplicate ids, in an order fixed by the ids and
    the rows' values, so results are the same bits on every replica and in every
    run, on GPUs too, whatever order the rows arrive in (barring a 32-bit hash
    collision between two different rows of one id); the sums travel in the
    gradient's dtype. (On one device, duplicates are added by a scatter, in the order
    the backend chooses; GPUs do not fix it.)

    Under `jax.jit` with explicit sharding, a dense leaf whose param is typed reduced
    over mesh axes (`optax_accum.as_reduced`) keeps its sum typed unreduced over them,
    as `conditional_accumulator` does: a held step adds locally, the release reduces
    the sum once, inside its branch, `inner` runs on plain values and the dense
    updates come back typed as the params.

    `communication_dtype` (bfloat16, int8 or float8_e4m3fn) sends the dense leaves'
    sums in that type in the release's reduction, as `conditional_accumulator` does
    (the per-row counts and weights stay exact; the sparse leaves' gathers of each
    step are unchanged). `reduction` may differ per leaf, as there: a dense leaf can
    combine by "max" or "min" (its dense gradients' running max, min), a sparse leaf
    by "mean" or "sum".

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
      reduction: "mean" (default) or "sum", in any case; or per leaf, a tree (or a
        prefix of the params' tree) or a function of the leaf path giving "mean",
        "sum", "max" or "min" (the last two for dense leaves only), as in
        `conditional_accumulator`.
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
      communication_dtype: the type the dense leaves' sums travel in when the release
        reduces them (`axis_name`, params typed reduced): None (their own dtype),
        `jnp.bfloat16`, `jnp.int8` or `jnp.float8_e4m3fn`, as in
        `conditional_accumulator`.

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
      >>> # Per leaf: the table's rows by mean, a dense statistic by max.
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=3,
      ...     reduction={"table": "mean", "amax": "max"})
      >>> state = tx.init({"table": table, "amax": jnp.zeros(1)})
      >>> _, state = tx.update({"table": grad([0], [[1.0, 1.0]]), "amax": jnp.array([4.0])}, state)
      >>> u, state = tx.update({"table": grad([0], [[3.0, 3.0]]), "amax": jnp.array([2.0])}, state)
      >>> u["table"].values[0].tolist(), u["amax"].tolist()
      ([-2.0, -2.0], [-4.0])
      >>> # Two replicas' dense sums reduced in int8 (a float32 scale per 256 values).
      >>> import jax
      >>> tx = optax_accum.sparse_conditional_accumulator(
      ...     optax_accum.sparse_sgd(1.0), num_required=2, capacity=1, axis_name="i",
      ...     communication_dtype=jnp.int8)
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="i")(jnp.array([[1.0, 2.0], [3.0, -4.0]]))[0]
      Array([-2.      ,  1.007874], dtype=float32)
    """
    capacity = _checks.require_positive_int("capacity", capacity)
    wire = _wire.wire_dtype("communication_dtype", communication_dtype)
    reductions = _reductions.Reduction.of(reduction)
    buffers, dense = _storages.row_buffer(capacity), _storages.dense_rows(wire)
    extrema = {how: _storages.extremum(how) for how in _reductions.EXTREMA}
    rules = _engine.Rules.checked(
        inner=inner,
        num_required=num_required,
        means=reductions.means(),
        axis_name=axis_name,
        skip_nonfinite=skip_nonfinite,
        should_skip_update_fn=should_skip_update_fn,
        # Row buffers first: they may refuse a gradient (overflow), which the dense
        # leaves then do not add.
        kinds=(buffers, dense, *extrema.values()),
    )
    if sparse is not None and not callable(sparse):
        jax.tree.map(lambda m: _checks.require_bool("sparse", m), sparse)

    def kind_of(param: Any, is_sparse: bool, choice: _reductions.Choice) -> _engine.Storage:
        if choice.how not in extrema:
            return buffers if is_sparse else dense
        if is_sparse:
            raise ValueError(
                f'reduction "{choice.how}" is for dense leaves, but {choice.where} is '
                "sparse (a row buffer: its rows combine by sum or mean); give it "
                '"mean" or "sum", or mark it dense with `sparse`'
            )
        return extrema[choice.how]

    def init_fn(params: optax.Params) -> SparseConditionalAccumulatorState:
        _checks.require_floating_params(params)
        mask = _row_buffer.sparse_mask(sparse, params, capacity)
        return _engine.init(
            rules,
            SparseConditionalAccumulatorState,
            params,
            kind_of,
            mask,
            reductions.tree(params),
        )

    # The release reads the row buffers and never returns them; a held step passes the
    # inner state on untouched (see _engine and _branch).
    return _engine.transformation(rules, SparseConditionalAccumulatorState, init_fn)


__all__ = [
    "DenseRows",
    "RowBuffer",
    "SparseConditionalAccumulatorState",
    "sparse_conditional_accumulator",
]
