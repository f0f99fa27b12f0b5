"""The storage kinds the engine is given: where each param leaf keeps its running sum.

Each kind is a `_engine.Storage` record of functions over its own machinery:

- `dense_sum(accumulator_dtype, communication_dtype)`: an array like the param
  (`_sums`; typed unreduced over the axes a reduced param is, `_unreduced`), restarted
  lazily after a release, whose buffers may carry the released updates.
  `conditional_accumulator`'s leaves.
- `dense_rows(communication_dtype)`: a dense leaf of `sparse_conditional_accumulator`,
  which also counts the gradients that touched each row (`_dense_rows`); restarted
  lazily, its values' buffers may carry the released updates.
- `row_buffer(capacity)`: a sparse leaf, up to `capacity` distinct rows (`_row_buffer`).
- `extremum(how, accumulator_dtype)`: a leaf whose reduction is "max" or "min", its
  running max (min) in a `RunningMax` (`RunningMin`), restarted lazily (`_extrema`).

A release reduces the replicas' (or, under `jax.jit`, the devices' unreduced) sums
once; with a `communication_dtype` the values travel in it (`_wire`), the counts and
weights beside them exactly.

A new kind is one more record here, and a state field for each counter it reports.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import (
    _checks,
    _dense_rows,
    _extrema,
    _row_buffer,
    _row_ids,
    _sums,
    _unreduced,
    _wire,
)
from optax_accum._dense_rows import DenseRows
from optax_accum._engine import Added, Offer, Storage, Window
from optax_accum._row_buffer import RowBuffer
from optax_accum.indexed_slices import IndexedSlices

# --------------------------------------------------------------------------- checks


def _check_dense(where: str, gradient: Any, values: Any, *, sparse_ok: bool) -> None:
    """A dense leaf's gradient: an array of its shape, floating, typed unreduced over
    the axes its sum is; or, where `sparse_ok`, an `IndexedSlices` of its table."""
    if isinstance(gradient, IndexedSlices):
        if not sparse_ok:
            raise TypeError(
                f"{where} must be an array, got an IndexedSlices: conditional_accumulator "
                "sums dense gradients; sparse_conditional_accumulator takes IndexedSlices"
            )
        _check_slices(where, gradient, values.shape)
        return
    _checks.check_tree_matches(gradient, values, what=where)
    _unreduced.check_sum_types(gradient, values, what=where)


def _check_slices(where: str, gradient: IndexedSlices, table: tuple) -> None:
    """An `IndexedSlices` gradient against its leaf's table shape."""
    shape = gradient.dense_shape
    if not table or shape[1:] != tuple(table[1:]) or shape[0] not in (-1, table[0]):
        raise ValueError(f"{where} must have dense_shape {tuple(table)}, got {shape}")
    _row_ids.check_indices(gradient, what=where)
    if not jnp.issubdtype(gradient.values.dtype, jnp.floating):
        raise TypeError(f"{where}.values must be floating, got dtype {gradient.values.dtype}")


def _finite(gradient: Any, num_rows: int) -> jax.Array:
    """Whether a gradient leaf holds no NaN or Inf (padding rows of an `IndexedSlices`
    aside)."""
    if not isinstance(gradient, IndexedSlices):
        return _unreduced.finite(gradient)
    real = _row_ids.in_range(gradient.indices, num_rows)
    values = gradient.values
    return jnp.isfinite(jnp.where(real.reshape((-1,) + (1,) * (values.ndim - 1)), values, 0)).all()


def _same(x: Any, *_: Any) -> Any:
    return x


def _is_array(x: Any) -> bool:
    """Whether `x` is one array (a tree leaf), not a container of them."""
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(x)) and x is not None


# --------------------------------------------------------------------------- dense sums


def _reduced_values(values: list, axis_name: Any, wire: Any) -> list:
    """Running sums reduced once: each unreduced one over its mesh axes, then all over
    `axis_name`; in `wire` (`_wire`) when it is given, else by all-reduces of their own
    dtypes (XLA may pack them into one)."""
    if wire is None:
        totals = [_unreduced.reduced_sum(v) for v in values]
        return lax.psum(totals, axis_name) if axis_name is not None else totals
    totals = _wire.unreduced_total(list(values), communication_dtype=wire)
    if axis_name is not None:
        totals = _wire.reduced(totals, axis_name, communication_dtype=wire)
    return totals


def dense_sum(accumulator_dtype: Any = None, communication_dtype: Any = None) -> Storage:
    """A dense running sum per leaf, in `accumulator_dtype` (None: float32 for float16
    and bfloat16 params, the params' dtype otherwise), reduced in `communication_dtype`
    (None: in its own dtype)."""

    def add(sums: list, grads: list, offer: Offer) -> Added:
        added = [
            _sums.continued(s, offer.restart, offer.offered, g, offer.weight)
            for s, g in zip(sums, grads, strict=True)
        ]
        return Added(added, offer.offered, {})

    def release(sums: list, grads: list, window: Window) -> list:
        # An unreduced sum (under jit) is reduced here, once a window: one all-reduce
        # per leaf, which XLA may pack into one; likewise the replicas' sums.
        totals = _reduced_values(sums, window.axis_name, communication_dtype)
        if any(window.means):
            divide = _sums.mean_divider(
                window.weight_sum, [t for t, m in zip(totals, window.means, strict=True) if m]
            )
            totals = [divide(t) if m else t for t, m in zip(totals, window.means, strict=True)]
        return [t.astype(jnp.result_type(g)) for t, g in zip(totals, grads, strict=True)]

    return Storage(
        holds=_is_array,
        empty=lambda param: _sums.zeros_accumulator(param, accumulator_dtype),
        check=lambda where, g, s: _check_dense(where, g, s, sparse_ok=False),
        finite=lambda g, s: _unreduced.finite(g),
        add=add,
        release=release,
        retyped=lambda u, s: _unreduced.like_params(u, s),
        after=_same,
        held=_same,
        spendable=True,
        spent_as=_unreduced.in_sum_type,
        summed=communication_dtype is None,  # else reduced in one narrow all-reduce
    )


# --------------------------------------------------------------------------- dense rows


def dense_rows(communication_dtype: Any = None) -> Storage:
    """A dense leaf that counts the gradients touching each row (an `IndexedSlices`
    gradient touches its rows, a dense one all of them), for the per-row MEAN; its
    values reduced in `communication_dtype` (None: their own dtype)."""

    def add(stores: list, grads: list, offer: Offer) -> Added:
        added, out_of_range = _dense_rows.add_all(
            offer.offered, stores, grads, offer.weight, offer.axis_name, offer.restart
        )
        arrivals = {"num_out_of_range": jnp.where(offer.offered, out_of_range, 0)}
        return Added(added, offer.offered, arrivals)

    def release(stores: list, grads: list, window: Window) -> list:
        totals: list = [None] * len(stores)
        if communication_dtype is not None:  # all leaves' values in one narrow reduction
            values = [s.values for s in stores]
            totals = _reduced_values(values, window.axis_name, communication_dtype)
        return [
            _dense_rows.release(
                s,
                mean,
                g.values if isinstance(g, IndexedSlices) else g,
                window.axis_name,
                total=t,
            )
            for s, g, mean, t in zip(stores, grads, window.means, totals, strict=True)
        ]

    return Storage(
        holds=lambda store: isinstance(store, DenseRows),
        empty=_dense_rows.empty,
        check=lambda where, g, s: _check_dense(where, g, s.values, sparse_ok=True),
        finite=lambda g, s: _finite(g, s.values.shape[0]),
        add=add,
        release=release,
        retyped=lambda u, s: _unreduced.like_params(u, s.values),
        after=_same,
        held=_same,
        # The updates travel in the values' buffers, restarted lazily as a dense sum's;
        # the per-row counts stay as they are until the next step restarts them too.
        spendable=True,
        spent_as=lambda u, s: _unreduced.in_sum_type(u, s.values),
        spent_in=lambda s: (s.values, lambda values: s._replace(values=values)),
        summed=communication_dtype is None,
    )


# --------------------------------------------------------------------------- row buffers


def _check_sparse(where: str, gradient: Any, buffer: RowBuffer) -> None:
    if not isinstance(gradient, IndexedSlices):
        raise TypeError(
            f"{where} must be an IndexedSlices (this leaf accumulates sparsely), got "
            f"{type(gradient).__name__}; pass `sparse` to choose the sparse leaves"
        )
    _check_slices(where, gradient, (buffer.slot_of.shape[0], *buffer.values.shape[1:]))


def _padding(update: Any) -> Any:
    """A held step's `IndexedSlices`: padding ids, so applying it touches no row."""
    if not isinstance(update, IndexedSlices):
        return update
    ids = jnp.full_like(update.indices, update.padding_index)
    return IndexedSlices(ids, update.values, update.dense_shape)


def row_buffer(capacity: int) -> Storage:
    """A sparse leaf: at most `capacity` distinct rows between releases, taken whole or
    not at all (a gradient that does not fit is refused and counted as overflowed)."""

    def add(buffers: list, grads: list, offer: Offer) -> Added:
        buffers, accepted, overflow, out_of_range = _row_buffer.offer(
            buffers, grads, offer.offered, offer.weight, offer.axis_name
        )
        arrivals = {
            "num_overflowed": overflow,
            "num_out_of_range": jnp.where(accepted, out_of_range, 0),
        }
        return Added(buffers, accepted, arrivals)

    def release(buffers: list, grads: list, window: Window) -> list:
        return [
            _row_buffer.release(b, mean, g)
            for b, g, mean in zip(buffers, grads, window.means, strict=True)
        ]

    return Storage(
        holds=lambda store: isinstance(store, RowBuffer),
        empty=lambda param: _row_buffer.empty(param, capacity),
        check=_check_sparse,
        finite=lambda g, s: _finite(g, s.slot_of.shape[0]),
        add=add,
        release=release,
        retyped=_same,
        # A release resets `size` alone; the slots and the map are never cleared.
        after=lambda b, emit: b._replace(size=jnp.where(emit, 0, b.size)),
        held=_padding,
        spendable=False,
        carries_params=False,  # a table is updated after the branch, by its rows alone
    )


# --------------------------------------------------------------------------- max and min


def extremum(how: str, accumulator_dtype: Any = None) -> Storage:
    """A dense leaf whose window combines by `how`, "max" or "min": its running max
    (min) of the accepted gradients, whatever their weights (a max has none), and under
    an `axis_name` (or over the devices, for a param typed reduced) one `pmax` (`pmin`)
    in the release."""
    kind = _extrema.KINDS[how]

    def add(stores: list, grads: list, offer: Offer) -> Added:
        added = [
            _extrema.continued(s, offer.restart, offer.offered, g)
            for s, g in zip(stores, grads, strict=True)
        ]
        return Added(added, offer.offered, {})

    def release(stores: list, grads: list, window: Window) -> list:
        totals = _extrema.released(stores, window.axis_name)
        return [t.astype(jnp.result_type(g)) for t, g in zip(totals, grads, strict=True)]

    return Storage(
        holds=lambda store: isinstance(store, kind),
        empty=lambda param: _extrema.empty(how, param, accumulator_dtype),
        check=_extrema.check,
        finite=lambda g, s: _unreduced.finite(g),
        add=add,
        release=release,
        retyped=lambda u, s: _unreduced.like_params(u, s.values),
        after=_same,
        held=_same,
        spendable=True,  # restarted lazily, as a dense sum
        # Typed as the store, as a dense sum's updates are: the branch carries every
        # leaf's update in its store's buffer, or none of them (`_branch._can_spend`).
        spent_as=lambda u, s: _unreduced.in_sum_type(u, s.values),
    )


__all__ = ["dense_rows", "dense_sum", "extremum", "row_buffer"]
