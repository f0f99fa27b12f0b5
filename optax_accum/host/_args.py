"""Argument checks for the host accumulators: each returns the canonical value or raises
a TypeError/ValueError naming the argument, what was expected and what came."""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))

Shape = tuple[int | None, ...]


def check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = None if dtype is None else jnp.dtype(dtype)  # np.dtype(None) is float64
    except TypeError:
        dt = None
    if dt is None or dt not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(f"dtype must be one of {names}, got {dtype!r}")
    return dt


def check_shape(shape: Any, name: str = "shape") -> Shape | None:
    """None (unknown rank) or a tuple whose unknown dims are None (-1 also means unknown).

    A NumPy or JAX integer vector is read as its values, as TF reads a shape tensor.
    """
    if shape is None:
        return None
    shape = _shape_values(shape)
    out = [_dim(d) for d in _listed_dims(shape, name)]
    if isinstance(shape, str) or any(d is _BAD_DIM for d in out):
        raise ValueError(
            f"{name} must hold non-negative ints (None or -1 for unknown dims), got {shape!r}"
        )
    return tuple(out)


_BAD_DIM = object()  # what `_dim` returns for a dim that is not one


def _shape_values(shape: Any) -> Any:
    """An int as a 1-dim shape, an integer NumPy or JAX vector as a list of its values;
    anything else as it came."""
    if isinstance(shape, int | np.integer):
        return (shape,)
    if (
        isinstance(shape, np.ndarray | jax.Array)
        and shape.ndim == 1
        and jnp.issubdtype(shape.dtype, jnp.integer)
    ):
        return np.asarray(jax.device_get(shape)).tolist()
    return shape


def _listed_dims(shape: Any, name: str) -> list:
    """The dims of a shape as a list (none for a str, which is then rejected)."""
    try:
        return [] if isinstance(shape, str) else list(shape)
    except TypeError:
        raise TypeError(
            f"{name} must be None or a sequence of ints (None or -1 for unknown dims), "
            f"got {shape!r}"
        ) from None


def _dim(d: Any) -> int | object | None:
    """A dim as an int, None when unknown (None or -1), or `_BAD_DIM`."""
    is_int = isinstance(d, int | np.integer) and not isinstance(d, bool)
    if d is None or (is_int and d == -1):
        return None
    if is_int and d >= 0:
        return int(d)
    return _BAD_DIM


def check_step(name: str, value: Any) -> int:
    if isinstance(value, bool | float | np.floating):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _int_scalar(value: Any) -> int | None:
    """`value` as an int if it is an integer scalar (Python, NumPy, or a concrete 0-d
    integer NumPy or JAX array), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    if (
        isinstance(value, np.ndarray | jax.Array)
        and value.ndim == 0
        and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        try:
            return int(value)
        except TypeError:  # a tracer: no value to wait for
            return None
    return None


def check_num_required(num_required: Any) -> int:
    n = _int_scalar(num_required)
    if n is None:
        raise TypeError(
            f"num_required must be a positive int, got {num_required!r} "
            f"({type(num_required).__name__})"
        )
    if n < 1:
        raise ValueError(f"num_required must be positive, but was {n}")
    return n


def check_timeout(timeout: Any) -> float | None:
    """Seconds to wait, or None for no limit (also for an infinite timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.integer | np.floating):
        raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def fmt(shape: Shape | None) -> str:
    return "unknown" if shape is None else str(tuple("?" if d is None else d for d in shape))


def compatible(shape: tuple[int, ...], spec: Shape | None) -> bool:
    return spec is None or (
        len(shape) == len(spec)
        and all(s is None or s == d for d, s in zip(shape, spec, strict=True))
    )


def as_array(x: Any, dtype: np.dtype, what: str) -> Any:
    """`x` as an array: arrays keep their own dtype, which must be `dtype`; Python
    numbers and nested lists are converted to `dtype` (as TF converts them). A JAX
    array whose buffer was deleted (donated to a jit) is a ValueError."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        try:
            converted = np.asarray(x)
        except (TypeError, ValueError):  # ragged lists
            converted = np.asarray(None)
        if converted.dtype.kind not in "iuf":  # None would become NaN, True 1.0
            raise TypeError(f"{what} must be an array or nested list of numbers, got {x!r:.80}")
        x = converted.astype(dtype)
    if jnp.dtype(x.dtype) != dtype:
        raise TypeError(f"{what} must have the accumulator's dtype {dtype.name}, got {x.dtype}")
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(
            f"{what} must be a live array, got one whose buffer was deleted (donated to a "
            f"jit or deleted) before the apply"
        )
    return x
