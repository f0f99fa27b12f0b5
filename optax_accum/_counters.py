"""int32 counters and step tags: counting that never wraps, and steps as int32 scalars.

Every counter in a state is an int32 scalar. They advance with `optax.safe_increment`
or `saturating_add`, so they stop at the int32 maximum instead of wrapping; a step tag
given as a wider integer saturates on its way in, so a step from the far future stays
in the future.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _checks

_INT32_MAX = np.iinfo(np.int32).max

# `num_required`: a positive int, or a schedule of the global step.
NumRequired = int | Callable[[jax.Array], Any]


def int32(value: Any) -> jax.Array:
    """A scalar int32 array."""
    return jnp.asarray(value, dtype=jnp.int32)


def saturating_add(count: jax.Array, increment: jax.Array) -> jax.Array:
    """int32 `count + increment` (increment >= 0) that stops at the int32 maximum.

    The multi-increment sibling of `optax.safe_increment`: counters never wrap.
    """
    increment = increment.astype(count.dtype)
    return jnp.where(count > _INT32_MAX - increment, _INT32_MAX, count + increment)


def increment_if(pred: jax.Array, counter: jax.Array) -> jax.Array:
    """`counter + 1` where `pred` holds (stopping at the int32 maximum), else `counter`."""
    return jnp.where(pred, optax.safe_increment(counter), counter)


def local_step_or(local_step: Any, default: jax.Array, *, argname: str = "local_step") -> jax.Array:
    """Validates the `local_step` extra argument; returns it as an int32 scalar.

    `None` means "computed at the current step" and returns `default`. A non-integer
    dtype is a TypeError and a non-scalar a ValueError, both raised at trace time.
    """
    if local_step is None:
        return default
    _integer_scalar_dtype(local_step, argname)
    # Saturate wider integers instead of wrapping: a step from the far future must stay
    # in the future (NumPy int64 scalars and 0-d arrays, and int64 arrays under x64).
    return saturate_int32(local_step)


def saturate_int32(value: Any) -> jax.Array:
    """An integer scalar (Python, NumPy or JAX, traced is fine) as int32, clipped to the
    int32 range instead of wrapping: a Python int beyond it would be an OverflowError
    inside JAX, an int64 or uint32 array would wrap."""
    if isinstance(value, int | np.integer | np.ndarray):
        value = int(np.clip(int(value), np.iinfo(np.int32).min, _INT32_MAX))
    else:
        dtype = jnp.result_type(value)
        if dtype.itemsize > 4 or (
            dtype.itemsize == 4 and jnp.issubdtype(dtype, jnp.unsignedinteger)
        ):
            info = jnp.iinfo(dtype)
            low, high = max(info.min, np.iinfo(np.int32).min), _INT32_MAX
            value = jnp.clip(value, np.asarray(low, dtype), np.asarray(high, dtype))
    return jnp.asarray(value).astype(jnp.int32)


def _integer_scalar_dtype(value: Any, argname: str) -> np.dtype:
    """The dtype of `value` if it is an integer scalar; TypeError or ValueError otherwise."""
    if isinstance(value, bool | float | complex | str):
        raise TypeError(f"{argname} must be an integer scalar, got {value!r}")
    dtype = _checks.integer_dtype(argname, value)
    if jnp.ndim(value) != 0:
        raise ValueError(
            f"{argname} must be an integer scalar, got shape {tuple(jnp.shape(value))}"
        )
    return dtype


def num_required_fn(num_required: NumRequired) -> Callable[[jax.Array], jax.Array]:
    """Validates `num_required` and returns it as a function of the global step.

    A schedule's value is checked to be an integer at trace time and clipped to
    [1, int32 max]: a value of 2**31 or more saturates (never wraps, never overflows).
    """
    if callable(num_required):

        def scheduled(step: jax.Array) -> jax.Array:
            k = num_required(step)
            if not jnp.issubdtype(jnp.result_type(k), jnp.integer):
                raise TypeError(
                    "num_required: a schedule must return an integer, "
                    f"got {jnp.result_type(k)} for step {step}"
                )
            return jnp.maximum(saturate_int32(k), 1)

        return scheduled
    k = _checks.require_positive_int("num_required", num_required)
    return lambda step: int32(k)
