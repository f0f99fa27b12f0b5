"""The sparse host accumulator's device kernels: rows scattered into a buffer's slots,
and a take's rows gathered out of it (sorted, several slots of one row added, divided
under MEAN).

Module-level jits: every accumulator shares their compilation caches. Index vectors are
as long as the (bucketed) values; entries out of range are padding, dropped.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from optax_accum import _sums


def _fill(
    rows: jax.Array,
    known: jax.Array,
    slots: jax.Array,
    values: jax.Array,
    weight: jax.Array | None,
    distinct: bool,
) -> jax.Array:
    """Adds `weight * values[i]` (None: 1) to `rows[slots[i]]`, the slots from `known`
    on zeroed first (newly assigned: unused slots may hold anything); slots out of
    range are padding, dropped.

    With `distinct` slots (static: no row id repeats in the gradient, which has no
    weight) the rows are read, zeroed where new, added to and written back: one pass
    over the rows fewer than zeroing and then adding (about 40% less CPU on XLA:CPU),
    with the same sums (`0 + v`, `r + v`). Repeated slots must add in turn, and a
    weight's product must stay out of the add: fused into `r + w * v`, XLA:CPU would
    round once, not twice."""
    fresh = slots >= known
    if distinct:
        current = rows.at[slots].get(mode="fill", fill_value=0)
        new = fresh.reshape((-1,) + (1,) * (values.ndim - 1))
        current = jnp.where(new, jnp.zeros((), rows.dtype), current)
        return rows.at[slots].set(current + values.astype(rows.dtype), mode="drop")
    fresh_slots = jnp.where(fresh, slots, rows.shape[0])  # the others: past the end
    rows = rows.at[fresh_slots].set(jnp.zeros((), rows.dtype), mode="drop")
    return rows.at[slots].add(_sums.weighted(values, weight, rows.dtype), mode="drop")


scatter_add = jax.jit(_fill, donate_argnums=0, static_argnames="distinct")


@functools.partial(jax.jit, donate_argnums=0, static_argnames="distinct")
def scatter_grow(
    spare: jax.Array,
    rows: jax.Array,
    known: jax.Array,
    slots: jax.Array,
    values: jax.Array,
    weight: jax.Array | None,
    distinct: bool,
) -> jax.Array:
    """`scatter_add` into `spare`, a buffer with more slots, after copying `rows` in."""
    spare = jax.lax.dynamic_update_slice_in_dim(spare, rows.astype(spare.dtype), 0, axis=0)
    return _fill(spare, known, slots, values, weight, distinct)


def _divide(taken: jax.Array, counts: jax.Array, mean: bool, dtype: Any) -> jax.Array:
    """`taken` with each row divided by its divisor under MEAN: its count, or the sum of
    its weights (padding divisors are 1)."""
    if mean:
        taken = taken / counts.astype(taken.dtype).reshape((-1,) + (1,) * (taken.ndim - 1))
    return taken.astype(dtype)


@functools.partial(jax.jit, static_argnames=("mean", "dtype"))
def gather_copy(
    rows: jax.Array, order: jax.Array, counts: jax.Array, *, mean: bool, dtype: Any
) -> jax.Array:
    """`rows[order]`, each divided by its count under MEAN."""
    return _divide(rows[order], counts, mean, dtype)


@functools.partial(jax.jit, static_argnames=("mean", "dtype"))
def merge_copy(
    rows: jax.Array,
    order: jax.Array,
    segments: jax.Array,
    counts: jax.Array,
    *,
    mean: bool,
    dtype: Any,
) -> jax.Array:
    """`gather_copy` where several slots hold one row: `rows[order[i]]` added into
    output row `segments[i]` (sorted; out of range is padding, dropped)."""
    summed = jax.ops.segment_sum(
        rows[order], segments, num_segments=order.shape[0], indices_are_sorted=True
    )
    return _divide(summed, counts, mean, dtype)


__all__ = ["gather_copy", "merge_copy", "scatter_add", "scatter_grow"]
