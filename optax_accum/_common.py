"""Small helpers shared by the transforms: argument checks, counters, tree selection.

Everything here is private. Each helper does one thing and is named for it; a
transform module should read as the behaviour it implements, with the plumbing here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

_INT32_MAX = np.iinfo(np.int32).max
REDUCTIONS = ("mean", "sum")


# --------------------------------------------------------------------------- arguments


def canonical_reduction(reduction: Any, *, argname: str = "reduction") -> str:
    """Returns "mean" or "sum" for any capitalisation of them; ValueError otherwise."""
    if isinstance(reduction, str) and reduction.lower() in REDUCTIONS:
        return reduction.lower()
    raise ValueError(f'{argname} must be "mean" or "sum" (any case), got {reduction!r}')


def require_positive_int(name: str, value: Any) -> int:
    """Returns `value` if it is a Python (or NumPy) int >= 1; raises otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > _INT32_MAX:
        raise ValueError(f"{name} must be at most 2**31 - 1 (an int32 counter), got {value!r}")
    return int(value)


def require_floating_params(params: Any) -> None:
    """Raises a TypeError at `init` naming the first params leaf that is not floating.

    Float gradients on integer params would otherwise give updates that
    `optax.apply_updates` silently rounds away.
    """
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(p)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} must be floating (optimizers update "
                f"floating-point parameters), got dtype {dtype}"
            )


def require_axis_name(name: str, value: Any) -> Any:
    """Checks an optional axis name: None, a hashable name, or a tuple of names."""
    if value is None:
        return None
    names = value if isinstance(value, tuple) else (value,)
    if not names or any(not isinstance(n, str | int) or isinstance(n, bool) for n in names):
        raise TypeError(
            f"{name} must be None, an axis name (str) or a tuple of axis names, got {value!r}"
        )
    return value


def require_bound_axis(axis_name: Any, *, argname: str = "axis_name") -> None:
    """Raises a clear NameError-free error when `axis_name` is not bound by the caller.

    Without this, an unbound name fails deep inside JAX with "unbound axis name".
    Called at trace time.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for n in names:
        try:
            lax.axis_size(n)
        except NameError as e:  # JAX raises NameError for an unbound axis name.
            raise ValueError(
                f"{argname}={axis_name!r} is not bound here: call the update inside "
                f"jax.pmap, jax.shard_map or jax.vmap with that axis name ({e})"
            ) from None


def require_transformation(name: str, value: Any, *, optional: bool = False) -> Any:
    """Returns `value` if it has callable `init` and `update` (an optax transformation).

    Without this, a wrong `inner` (a string, an optax module, None) fails later with
    an AttributeError from inside optax. `optional` says None is allowed (the caller
    handles it) and words the error so.
    """
    if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
        return value
    expected = "None or an" if optional else "an"
    raise TypeError(
        f"{name} must be {expected} optax.GradientTransformation (with init and update), "
        f"got {value!r} ({type(value).__name__})"
    )


def require_state(state: Any, state_type: type) -> None:
    """Raises a TypeError naming the expected state type when `state` is another one.

    Called at trace time by `update`: a state from another transform (or a chain's
    tuple passed to one of its members) otherwise fails deep inside with an
    AttributeError.
    """
    if not isinstance(state, state_type):
        raise TypeError(
            f"state must be a {state_type.__name__} (as returned by this transform's init), "
            f"got {type(state).__name__}"
        )


def require_bool(name: str, value: Any) -> bool:
    """Returns `value` if it is a Python bool; TypeError otherwise."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def floating_dtype(name: str, dtype: Any) -> np.dtype | None:
    """Returns `dtype` as a NumPy floating dtype (None stays None); TypeError otherwise."""
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dt.name}")
    return dt


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


# --------------------------------------------------------------------------- trace-time checks


def local_step_or(local_step: Any, default: jax.Array, *, argname: str = "local_step") -> jax.Array:
    """Validates the `local_step` extra argument; returns it as an int32 scalar.

    `None` means "computed at the current step" and returns `default`. A non-integer
    dtype is a TypeError and a non-scalar a ValueError, both raised at trace time.
    """
    if local_step is None:
        return default
    if isinstance(local_step, bool | float | complex | str):
        raise TypeError(f"{argname} must be an integer scalar, got {local_step!r}")
    try:
        dtype = jnp.result_type(local_step)
    except TypeError:
        raise TypeError(
            f"{argname} must be an integer scalar, got {type(local_step).__name__}"
        ) from None
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{argname} must be an integer scalar, got dtype {dtype}")
    if jnp.ndim(local_step) != 0:
        raise ValueError(
            f"{argname} must be an integer scalar, got shape {tuple(jnp.shape(local_step))}"
        )
    # Saturate wider integers instead of wrapping: a step from the far future must stay
    # in the future (NumPy int64 scalars and 0-d arrays, and int64 arrays under x64).
    if isinstance(local_step, int | np.integer | np.ndarray):
        local_step = int(np.clip(int(local_step), np.iinfo(np.int32).min, _INT32_MAX))
    elif dtype.itemsize > 4 or (dtype.itemsize == 4 and jnp.issubdtype(dtype, jnp.unsignedinteger)):
        info = jnp.iinfo(dtype)
        low, high = max(info.min, np.iinfo(np.int32).min), _INT32_MAX
        local_step = jnp.clip(local_step, np.asarray(low, dtype), np.asarray(high, dtype))
    return jnp.asarray(local_step).astype(jnp.int32)


def check_tree_matches(updates: Any, reference: Any, *, what: str = "updates") -> None:
    """Raises at trace time if `updates` differs from `reference` in structure or shape."""
    got, expected = jax.tree.structure(updates), jax.tree.structure(reference)
    if got != expected:
        raise ValueError(
            f"{what} must have the tree structure of the params given to init: "
            f"expected {expected}, got {got}"
        )
    flat, _ = jax.tree_util.tree_flatten_with_path(updates)
    for (path, u), r in zip(flat, jax.tree.leaves(reference), strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        if jnp.shape(u) != jnp.shape(r):
            raise ValueError(
                f"{where} must have shape {tuple(jnp.shape(r))}, got {tuple(jnp.shape(u))}"
            )
        if not jnp.issubdtype(jnp.result_type(u), jnp.floating):
            raise TypeError(f"{where} must be floating, got dtype {jnp.result_type(u)}")


# --------------------------------------------------------------------------- counters


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: True iff no leaf of `tree` holds a NaN or Inf."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def saturating_add(count: jax.Array, increment: jax.Array) -> jax.Array:
    """int32 `count + increment` (increment >= 0) that stops at the int32 maximum.

    The multi-increment sibling of `optax.safe_increment`: counters never wrap.
    """
    increment = increment.astype(count.dtype)
    return jnp.where(count > _INT32_MAX - increment, _INT32_MAX, count + increment)


def increment_if(pred: jax.Array, counter: jax.Array) -> jax.Array:
    """`counter + 1` where `pred` holds (stopping at the int32 maximum), else `counter`."""
    return jnp.where(pred, optax.safe_increment(counter), counter)


def int32(value: Any) -> jax.Array:
    """A scalar int32 array."""
    return jnp.asarray(value, dtype=jnp.int32)


# --------------------------------------------------------------------------- selection


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `jnp.where(pred, a, b)`: a selection, never a 0/1 multiply."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


# --------------------------------------------------------------------------- dense leaves


def zeros_accumulator(param: Any, accumulator_dtype: np.dtype | None = None) -> jax.Array:
    """Zeros shaped like `param`, in the dtype its accumulator keeps."""
    dtype = accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    return jnp.zeros(jnp.shape(param), dtype)


def add_where(accepted: jax.Array, accumulator: jax.Array, gradient: jax.Array) -> jax.Array:
    """`accumulator + gradient` (in the accumulator's dtype) if `accepted`, else unchanged.

    A selection, so a NaN in a rejected gradient never reaches the accumulator.
    """
    return jnp.where(accepted, accumulator + gradient.astype(accumulator.dtype), accumulator)


def reduce_dense(
    accumulator: jax.Array, count: jax.Array | None, like: Any, axis_name: Any = None
) -> jax.Array:
    """A dense running sum released: summed over `axis_name`, divided by `count`.

    `count=None` means SUM (no division). The result has `like`'s dtype.
    """
    total = accumulator if axis_name is None else lax.psum(accumulator, axis_name)
    if count is not None:
        total = total / count.astype(total.dtype)
    return total.astype(jnp.result_type(like))


__all__ = [
    "accumulator_dtype_for",
    "add_where",
    "all_finite",
    "canonical_reduction",
    "check_tree_matches",
    "floating_dtype",
    "increment_if",
    "int32",
    "local_step_or",
    "reduce_dense",
    "require_axis_name",
    "require_floating_params",
    "require_bool",
    "require_bound_axis",
    "require_state",
    "require_transformation",
    "require_positive_int",
    "saturating_add",
    "tree_select",
    "zeros_accumulator",
]
