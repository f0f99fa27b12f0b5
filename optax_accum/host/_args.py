"""Argument checks for the host accumulators: each returns the canonical value or raises
a TypeError/ValueError naming the argument, what was expected and what came.

NumPy only: the Ray actor (`optax_accum.ray`) runs these checks in a process that
never imports JAX. A JAX array is recognised only where JAX is already imported (no
one else can hold one), and read as NumPy reads it.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any

import numpy as np

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")

Shape = tuple[int | None, ...]

_INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_jax_array(x: Any) -> bool:
    """Whether `x` is a JAX array (never, in a process that has not imported JAX)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype an accumulator of (supported) `dtype` sums in: float16 and bfloat16 in
    float32, as the functional accumulators do; float32 and float64 in themselves."""
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def check_reduction(reduction_type: Any) -> bool:
    """Whether `reduction_type` ("MEAN" or "SUM", any case) is MEAN."""
    if isinstance(reduction_type, str) and reduction_type.lower() in ("mean", "sum"):
        return reduction_type.lower() == "mean"
    raise ValueError(f'reduction_type must be "mean" or "sum" (any case), got {reduction_type!r}')


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def dtype_named(name: str) -> np.dtype:
    """The NumPy dtype of a supported dtype's name (bfloat16 is ml_dtypes', imported only
    when it is asked for: the Ray actor process does without it otherwise)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_dtype(dtype: Any) -> np.dtype:
    if (isinstance(dtype, str) and dtype == "bfloat16") or (
        getattr(dtype, "__name__", None) == "bfloat16"  # a scalar type: ml_dtypes', jax's
    ):
        dtype = dtype_named("bfloat16")
    try:
        dt = None if dtype is None else np.dtype(dtype)  # np.dtype(None) is float64
    except (TypeError, ValueError):  # a dict or a list reads as a structured dtype
        dt = None
    if dt is None or dt.name not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
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
        (isinstance(shape, np.ndarray) or is_jax_array(shape))
        and shape.ndim == 1
        and np.issubdtype(shape.dtype, np.integer)
    ):
        return np.asarray(shape).tolist()
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
        (isinstance(value, np.ndarray) or is_jax_array(value))
        and value.ndim == 0
        and np.issubdtype(value.dtype, np.integer)
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


def check_weight(weight: Any) -> float | None:
    """A gradient's `weight` as a Python float (a float32 value), or None for 1.

    A real scalar: a Python or NumPy int or float, or a 0-d real NumPy or JAX array;
    non-negative and finite in float32, as the functional accumulators' `weight`.
    """
    if weight is None:
        return None
    real = isinstance(weight, int | float | np.integer | np.floating | np.ndarray)
    if isinstance(weight, bool | np.bool_) or not (real or is_jax_array(weight)):
        raise TypeError(
            f"weight must be None or a non-negative real scalar, got {weight!r:.80} "
            f"({type(weight).__name__})"
        )
    dtype = np.dtype(weight.dtype) if hasattr(weight, "dtype") else None
    if dtype is not None and dtype.kind not in "iuf" and dtype.name != "bfloat16":
        raise TypeError(f"weight must be None or a non-negative real scalar, got dtype {dtype}")
    if np.ndim(weight) != 0:
        raise ValueError(
            f"weight must be None or a non-negative real scalar, got shape {np.shape(weight)}"
        )
    value = float(np.asarray(weight, np.float64))
    if not (math.isfinite(value) and 0 <= value <= _FLOAT32_MAX):
        raise ValueError(
            f"weight must be a non-negative, finite scalar (in float32), got {value!r}"
        )
    return float(np.float32(value))


def check_grace_period(grace_period: Any) -> float | None:
    """Seconds a take waits on once its count is reached; None (or 0) for none."""
    if grace_period is None:
        return None
    if isinstance(grace_period, bool) or not isinstance(
        grace_period, int | float | np.integer | np.floating
    ):
        raise TypeError(
            f"grace_period must be None or a number of seconds, got {grace_period!r} "
            f"({type(grace_period).__name__})"
        )
    if not (math.isfinite(grace_period) and grace_period >= 0):
        raise ValueError(
            f"grace_period must be None or a finite number of seconds >= 0, got {grace_period!r}"
        )
    return float(grace_period) or None


def kernel_weight(weight: float | None) -> np.ndarray | None:
    """A checked weight as the kernels take it: None for 1 (nothing multiplied: `1 * g`
    is `g`), else a float32 scalar."""
    return None if weight is None or weight == 1 else np.float32(weight)


def kernel_weights(weights: list[float | None]) -> np.ndarray | None:
    """The weights of gradients added by one kernel, as it takes them: None when none
    needs multiplying, else a float32 vector (1 for None): a kernel compiles for these
    two forms only."""
    if all(kernel_weight(w) is None for w in weights):
        return None
    return np.array([1 if w is None else w for w in weights], np.float32)


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
    if np.dtype(x.dtype) != dtype:
        raise TypeError(f"{what} must have the accumulator's dtype {dtype.name}, got {x.dtype}")
    if is_jax_array(x) and x.is_deleted():
        raise ValueError(
            f"{what} must be a live array, got one whose buffer was deleted (donated to a "
            f"jit or deleted) before the apply"
        )
    return x


# --------------------------------------------------------------------------- sparse gradients


def check_sparse_grad(
    indices: Any, values: Any, grad_shape: Any, shape: Shape | None, dtype: np.dtype
) -> tuple[np.ndarray, Any]:
    """TF's checks of a sparse gradient against an accumulator of `shape` and `dtype`,
    in TF's order; returns the indices as an int64 NumPy vector, and the values."""
    if not hasattr(indices, "shape"):
        listed = np.asarray(indices)
        indices = listed.astype(np.int32) if listed.size == 0 else listed
    if not np.issubdtype(indices.dtype, np.integer):
        raise TypeError(f"grad_indices must be integers, got dtype {indices.dtype}")
    if len(indices.shape) != 1:
        raise ValueError(f"grad_indices must be a vector, got shape {list(indices.shape)}")
    values = as_array(values, dtype, "grad_values")
    if len(values.shape) == 0:
        raise ValueError("grad_values cannot be 0-dimensional; expected [nnz, ...]")
    if values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"grad_values must have one row per index: expected {indices.shape[0]} "
            f"rows, got {values.shape[0]}"
        )
    grad_shape = _check_grad_shape(grad_shape, shape)
    host = np.asarray(indices).astype(np.int64, copy=False)
    if host.size:
        _check_row_ids(host, grad_shape, shape)
    _check_values_shape(values, shape)
    return host, values


def _check_grad_shape(grad_shape: Any, known: Shape | None) -> Shape | None:
    """`grad_shape` as a shape, checked against the accumulator's."""
    grad_shape = check_shape(grad_shape, "grad_shape")
    if not grad_shape or known is None:
        return grad_shape
    if len(grad_shape) < len(known):
        raise ValueError(
            f"grad_shape must have rank at least {len(known)} (the accumulator's "
            f"shape {fmt(known)}), got {fmt(grad_shape)}"
        )
    for i, (k, g) in enumerate(zip(known, grad_shape, strict=False)):
        if k is not None and g is not None and k != g:
            raise ValueError(
                f"grad_shape dim {i} must be {k} (the accumulator's shape {fmt(known)}), got {g}"
            )
    return grad_shape


def _check_row_ids(host: np.ndarray, grad_shape: Shape | None, known: Shape | None) -> None:
    """Non-empty host indices: row ids below every known dim 0, within int32."""
    low = int(host.argmin())
    if host[low] < 0:
        raise ValueError(f"grad_indices[{low}] = {host[low]} is negative; indices must be row ids")
    high = int(host.argmax())
    limit = known[0] if known else None
    if limit is not None and host[high] >= limit:
        raise ValueError(
            f"grad_indices[{high}] = {host[high]} exceeds the accumulator's shape[0] = {limit}"
        )
    if grad_shape and grad_shape[0] is not None and host[high] >= grad_shape[0]:
        raise ValueError(
            f"grad_indices[{high}] = {host[high]} exceeds grad_shape[0] = {grad_shape[0]}"
        )
    if host[high] > _INT32_MAX:
        raise ValueError(f"grad_indices[{high}] = {host[high]} does not fit in int32")


def _check_values_shape(values: Any, known: Shape | None) -> None:
    """The values' rank and row dims against the accumulator's shape."""
    if known is None:
        return
    if len(values.shape) < len(known):
        raise ValueError(
            f"grad_values must have rank at least {len(known)} (the accumulator's "
            f"shape {fmt(known)}), got shape {list(values.shape)}"
        )
    for i in range(1, len(known)):
        if known[i] is not None and known[i] != values.shape[i]:
            raise ValueError(
                f"grad_values dim {i} must be {known[i]} (the accumulator's shape "
                f"{fmt(known)}), got {values.shape[i]}"
            )


def check_rows_like(values: Any, known: tuple[int, ...] | None) -> None:
    """The values' rows must have the shape of the batch's earlier gradients' rows
    (`known`, fixed by the first gradient since the last take)."""
    if known is not None and (len(values.shape) != len(known) or values.shape[1:] != known[1:]):
        raise ValueError(
            f"grad_values rows must have shape {list(known[1:])} (fixed by the first "
            f"gradient since the last take), got {list(values.shape[1:])}"
        )
