"""Row ids of row-sparse gradients: checking them, and mapping them to int32 table rows.

An `IndexedSlices` names its rows by ids of any integer dtype. Ids outside
`[0, rows)` are padding; they are compared with the row count exactly (a uint8 id
never wraps), and become the padding id `rows` when turned into int32 row ids. A
floating index dtype is refused: it is the mark of an element-wise optax transform
applied to raw slices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MISUSE_HINT = (
    "an element-wise transform (optax.sgd, optax.adam, optax.scale, ...) was probably "
    "applied to a raw IndexedSlices and changed its indices; put optax_accum.densify() "
    "before a dense optimizer, or use optax_accum.sparse_sgd"
)


# --------------------------------------------------------------------------- checks


def check_index_dtype(indices: Any) -> None:
    """TypeError when indices have a floating dtype: the sign of a transform misuse."""
    dtype = getattr(indices, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"IndexedSlices.indices must be integer, got dtype {dtype}: {MISUSE_HINT}")


def check_rows(indices: Any, values: Any, dense_shape: tuple[int, ...]) -> None:
    """The trace-time checks of the `IndexedSlices` constructor, in TF's order."""
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        check_index_dtype(indices)
        raise TypeError(f"indices must be an integer vector, got dtype {indices.dtype}")
    if len(indices.shape) != 1:
        raise ValueError(f"indices must be a vector, got shape {tuple(indices.shape)}")
    if len(values.shape) < 1:
        raise ValueError("values must have rank >= 1 (one row per index), got a scalar")
    if values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"values must have one row per index: expected {indices.shape[0]} rows, "
            f"got values of shape {tuple(values.shape)}"
        )
    if tuple(values.shape[1:]) != dense_shape[1:]:
        raise ValueError(
            f"values rows must have shape dense_shape[1:] = {dense_shape[1:]}, "
            f"got {tuple(values.shape[1:])}"
        )


def check_indices(x: Any, *, what: str = "updates") -> None:
    """Trace-time check that an `IndexedSlices`' indices are an integer vector matching
    its values."""
    dtype = jnp.result_type(x.indices)
    check_index_dtype(x.indices)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{what}.indices must be integer, got dtype {dtype}")
    check_rows(x.indices, x.values, x.dense_shape)


# --------------------------------------------------------------------------- ranges


def in_range(indices: jax.Array, num_rows: int) -> jax.Array:
    """Where `0 <= indices < num_rows`, exactly for every integer dtype.

    The bound is compared in the indices' own dtype only when that dtype holds it
    (as `uint8` does not hold 256), so no id wraps around.
    """
    dtype = jnp.result_type(indices)
    info = jnp.iinfo(dtype)
    if num_rows > info.max:
        below = jnp.ones(jnp.shape(indices), bool)
    else:
        below = indices < np.asarray(num_rows, dtype)
    return below & (indices >= np.asarray(0, dtype)) if info.min < 0 else below


def row_ids(indices: jax.Array, num_rows: int) -> jax.Array:
    """`indices` as int32 row ids of a `num_rows`-row table, every id outside
    `[0, num_rows)` (negative, too large, or wider than int32) mapped to the padding
    id `num_rows`."""
    rows = jnp.asarray(indices).astype(jnp.int32)  # ids out of int32 range are masked
    return jnp.where(in_range(indices, num_rows), rows, jnp.int32(num_rows))


def num_out_of_range(indices: jax.Array, num_rows: int) -> jax.Array:
    """int32: how many ids lie outside `[0, num_rows]` (the padding id is not counted)."""
    return jnp.sum(~in_range(indices, num_rows + 1), dtype=jnp.int32)
