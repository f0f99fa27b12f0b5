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
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _counters,
    _dense_rows,
    _extra_args,
    _gate,
    _protocol,
    _row_buffer,
    _row_ids,
    _sums,
    _unreduced,
)
from optax_accum._dense_rows import DenseRows
from optax_accum._row_buffer import RowBuffer
from optax_accum.indexed_slices import IndexedSlices


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
    inner = _checks.require_transformation("inner", inner)
    required = _counters.num_required_fn(num_required)
    capacity = _checks.require_positive_int("capacity", capacity)
    mean = _checks.canonical_reduction(reduction) == "mean"
    axis_name = _checks.require_axis_name("axis_name", axis_name)
    skip_nonfinite = _checks.require_bool("skip_nonfinite", skip_nonfinite)
    skip_rule = _checks.require_skip_rule(should_skip_update_fn)
    if sparse is not None and not callable(sparse):
        jax.tree.map(lambda m: _checks.require_bool("sparse", m), sparse)

    def init_fn(params: optax.Params) -> SparseConditionalAccumulatorState:
        _checks.require_floating_params(params)
        mask = _row_buffer.sparse_mask(sparse, params, capacity)
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
                lambda p, m: _row_buffer.empty(p, capacity) if m else _dense_rows.empty(p),
                params,
                mask,
            ),
            inner_state=inner.init(_unreduced.plain(params)),
        )

    def step(
        updates: optax.Updates,
        state: SparseConditionalAccumulatorState,
        params: optax.Params | None,
        call: _protocol.Call,
        *,
        local_step: Any = None,
        weight: Any = None,
        **extra_args: Any,
    ) -> _protocol.Result:
        _checks.require_state(state, SparseConditionalAccumulatorState)
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        _check_updates(updates, state.accumulator)
        step = _counters.local_step_or(local_step, state.global_step)
        w, weight_ok = _sums.weight_or_none(weight)
        grads = jax.tree.leaves(updates, is_leaf=_is_slices)
        accs = jax.tree.leaves(state.accumulator, is_leaf=_is_accumulator)
        _check_sum_types(grads, accs)
        judged = _gate.judged(
            call.verdict,
            fresh=step >= state.global_step,
            finite=_all_finite(grads, accs) if skip_nonfinite else jnp.asarray(True),
            weight_ok=weight_ok,
            rule=_sums.skip_rule(skip_rule, updates, state.global_step, params),
        )
        # Taken whole or not at all: `accepted` is `offered` unless its rows overflowed.
        accs, accepted, overflow, out_of_range = _accumulate(
            grads, accs, judged.offered, w, axis_name, state.emitted
        )
        accumulator = jax.tree.unflatten(
            jax.tree.structure(state.accumulator, is_leaf=_is_accumulator), accs
        )
        flags = [accepted, judged.stale, judged.nonfinite, judged.passed(overflow), judged.skipped]
        arrived = jnp.stack(
            [f.astype(jnp.int32) for f in flags] + [jnp.where(accepted, out_of_range, 0)]
        )
        if axis_name is not None:
            arrived = lax.psum(arrived, axis_name)
        count = _counters.saturating_add(state.count, arrived[0])
        emit = judged.passed(count >= required(state.global_step))

        # The release reads the accumulator and never returns it; a held step passes
        # the inner state on untouched (see _branch).
        # An unreduced dense sum (under jit) is reduced here, once a window; the inner
        # optimizer runs on plain values, its updates typed as the params are.
        def release(inner_state, params):
            aggregate = _aggregate(accumulator, updates, mean, axis_name)
            result = _protocol.call_inner(
                inner,
                aggregate,
                inner_state,
                _unreduced.plain(params),
                _protocol.Call(),
                **extra_args,
            )
            return _like_params(result.updates, accumulator), result.state

        branched = _branch.update_if(
            emit,
            release,
            state.inner_state,
            params,
            salt=count,
            apply=call.apply,
            held=_as_padding,
        )
        emitted = judged.emitted(emit, state.emitted)
        new_state = _next_state(state, emit, emitted, count, arrived, accumulator, branched.state)
        return _protocol.result_of(
            branched.updates,
            new_state,
            call,
            params=branched.params,
            read_weight=weight is not None,
        )

    return _protocol.transformation(init_fn, step, takes_verdict=True)


# --------------------------------------------------------------------------- update steps


def _accumulate(
    grads: list,
    accs: list,
    offered: jax.Array,
    w: jax.Array | None,
    axis_name: Any,
    restart: jax.Array,
) -> tuple[list, jax.Array, jax.Array, jax.Array]:
    """The accumulators with the gradient added if it is offered and fits: the row
    buffers take it (under `axis_name`, every replica's, in replica order) whole or not
    at all, then the dense leaves add it if the buffers took it. Also returns whether
    this replica's gradient was accepted, whether it overflowed, and how many of its
    row ids lay outside their leaves (ignored: they cannot raise under jit). After a
    release (`restart`) the dense leaves start from zeros (see `_dense_rows.add_all`)."""
    sparse_at = [i for i, a in enumerate(accs) if _is_buffer(a)]
    dense_at = [i for i, a in enumerate(accs) if not _is_buffer(a)]
    buffers, accepted, overflow, sparse_out = _row_buffer.offer(
        [accs[i] for i in sparse_at], [grads[i] for i in sparse_at], offered, w, axis_name
    )
    dense, dense_out = _dense_rows.add_all(
        accepted, [accs[i] for i in dense_at], [grads[i] for i in dense_at], w, axis_name, restart
    )
    accs = list(accs)
    for i, a in zip(sparse_at + dense_at, buffers + dense, strict=True):
        accs[i] = a
    return accs, accepted, overflow, sparse_out + dense_out


def _check_sum_types(grads: list, accs: list) -> None:
    """A clear error where a dense leaf's gradient is not typed unreduced over the axes
    its running sum is (see `_unreduced`)."""
    dense = [
        (g, a.values)
        for g, a in zip(grads, accs, strict=True)
        if not _is_buffer(a) and not isinstance(g, IndexedSlices)
    ]
    _unreduced.check_sum_types([g for g, _ in dense], [a for _, a in dense])


def _like_params(updates: Any, accumulator: Any) -> Any:
    """Dense updates typed reduced where their running sum is unreduced (as their
    params are): a cast that moves nothing."""

    def leaf(u: Any, a: Any) -> Any:
        return u if _is_buffer(a) else _unreduced.like_params(u, a.values)

    return jax.tree.map(leaf, updates, accumulator, is_leaf=_is_slices)


def _aggregate(accumulator: Any, updates: Any, mean: bool, axis_name: Any) -> Any:
    """The released tree: `IndexedSlices` for the row buffers, arrays for dense leaves."""

    def leaf(a, g):
        if _is_buffer(a):
            return _row_buffer.release(a, mean, g)
        like = g.values if isinstance(g, IndexedSlices) else g
        return _dense_rows.release(a, mean, like, axis_name)

    return jax.tree.map(leaf, accumulator, updates, is_leaf=_is_accumulator)


def _next_state(
    state: SparseConditionalAccumulatorState,
    emit: jax.Array,
    emitted: jax.Array,
    count: jax.Array,
    arrived: jax.Array,
    accumulator: Any,
    inner_state: optax.OptState,
) -> SparseConditionalAccumulatorState:
    """The state after an update: `arrived` holds the int32 counts of this step's
    accepted, stale, non-finite, overflowed and skipped gradients and of its
    out-of-range rows; on a release (`emit`), the accumulator is emptied and the step
    advances. `emitted` is the new state's flag (`emit`, unless a wrapper's verdict
    dropped the gradient)."""
    return SparseConditionalAccumulatorState(
        global_step=_counters.increment_if(emit, state.global_step),
        count=jnp.where(emit, 0, count),
        num_dropped=_counters.saturating_add(state.num_dropped, arrived[1]),
        num_nonfinite=_counters.saturating_add(state.num_nonfinite, arrived[2]),
        num_skipped=_counters.saturating_add(state.num_skipped, arrived[4]),
        num_overflowed=_counters.saturating_add(state.num_overflowed, arrived[3]),
        num_out_of_range=_counters.saturating_add(state.num_out_of_range, arrived[5]),
        emitted=emitted,
        accumulator=jax.tree.map(
            lambda a: _reset_if(emit, a), accumulator, is_leaf=_is_accumulator
        ),
        inner_state=inner_state,
    )


def _reset_if(emit: jax.Array, acc: RowBuffer | DenseRows) -> RowBuffer | DenseRows:
    """The accumulator emptied if `emit`: a row buffer resets `size` (see `_row_buffer`);
    a dense leaf is left as it is, and the next step starts it from zeros."""
    if _is_buffer(acc):
        return acc._replace(size=jnp.where(emit, 0, acc.size))
    return acc


def _as_padding(tree: Any) -> Any:
    """Zero `IndexedSlices` leaves get padding ids, so applying them touches no row."""

    def pad(u: Any) -> Any:
        if not isinstance(u, IndexedSlices):
            return u
        return IndexedSlices(jnp.full_like(u.indices, u.padding_index), u.values, u.dense_shape)

    return jax.tree.map(pad, tree, is_leaf=_is_slices)


__all__ = [
    "DenseRows",
    "RowBuffer",
    "SparseConditionalAccumulatorState",
    "sparse_conditional_accumulator",
]
