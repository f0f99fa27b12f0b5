"""Running sums of gradients: their dtype, their zeros, and selections.

An accumulator keeps one copy of the gradients in a fixed dtype. A gradient is added
or not by selection (`jnp.where`), never by multiplying with a 0/1 mask, so a NaN or
Inf in a gradient that is not taken never reaches the sum.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _compat


def accumulator_dtype_for(param_dtype: Any, accumulator_dtype: np.dtype | None) -> np.dtype:
    """The dtype an accumulator keeps for a parameter leaf.

    An explicit `accumulator_dtype` wins; otherwise float16/bfloat16 accumulate in
    float32 (sums of many low-precision gradients lose too much), and every other
    floating dtype accumulates in itself.
    """
    if accumulator_dtype is not None:
        return accumulator_dtype
    dt = jnp.dtype(param_dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dt


def zeros_accumulator(param: Any, accumulator_dtype: np.dtype | None = None) -> jax.Array:
    """Zeros like `param` (its shape, sharding and varying mesh axes), in the dtype its
    accumulator keeps."""
    dtype = accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    return jnp.zeros_like(param, dtype=dtype)


def row_zeros(param: Any, dtype: Any) -> jax.Array:
    """Zeros, one per row (first axis) of `param`, laid out like those rows under
    explicit sharding."""
    rows = jnp.shape(param)[:1]
    return jnp.zeros(rows, dtype, out_sharding=_compat.leading_axis_sharding(param))


def add_where(accepted: jax.Array, accumulator: jax.Array, gradient: jax.Array) -> jax.Array:
    """`accumulator + gradient` (in the accumulator's dtype) if `accepted`, else unchanged.

    A selection, so a NaN in a rejected gradient never reaches the accumulator.
    """
    return jnp.where(accepted, accumulator + gradient.astype(accumulator.dtype), accumulator)


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: True iff no leaf of `tree` holds a NaN or Inf."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `jnp.where(pred, a, b)`: a selection, never a 0/1 multiply."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
