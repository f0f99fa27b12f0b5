"""Argument checks: a bad input gets an error naming it, what was expected, what came.

Python values are checked when a transform is built, shapes, dtypes and tree
structure when `update` is traced. Each check returns the value it accepted (in its
canonical form) or raises a TypeError or ValueError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_INT32_MAX = np.iinfo(np.int32).max
REDUCTIONS = ("mean", "sum")


# --------------------------------------------------------------------------- at construction


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


def require_bool(name: str, value: Any) -> bool:
    """Returns `value` if it is a Python bool; TypeError otherwise."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def require_skip_rule(value: Any) -> Callable | None:
    """Checks the `should_skip_update_fn` argument: a callable or None."""
    if value is not None and not callable(value):
        raise TypeError(
            "should_skip_update_fn must be a callable (updates, gradient_step, params) -> "
            f"bool, or None, got {value!r} ({type(value).__name__})"
        )
    return value


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


# --------------------------------------------------------------------------- at init and trace


def integer_dtype(name: str, value: Any, *, expected: str = "an integer scalar") -> np.dtype:
    """Returns the dtype of `value` (a number or an array) if it is an integer one.

    A TypeError otherwise, saying `name must be <expected>` and what came: the type
    when `value` has no dtype, else the dtype. Shape is left to the caller.
    """
    try:
        dtype = jnp.result_type(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be {expected}, got dtype {dtype}")
    return dtype


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


def require_bound_axis(axis_name: Any, *, argname: str = "axis_name") -> None:
    """Raises a clear ValueError when `axis_name` is not bound by the caller.

    Without this, an unbound name fails deep inside JAX with "unbound axis name".
    Called at trace time.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for n in names:
        try:
            lax.axis_size(n)
        except NameError as e:  # JAX raises NameError for an unbound axis name.
            if n in jax.sharding.get_abstract_mesh().axis_names:
                raise ValueError(
                    f"{argname}={axis_name!r} names an axis of the current mesh, but under "
                    "plain jax.jit no axis is bound by name: jit's sharding already "
                    "reduces over it (the gradient of a batch sharded over it is the whole "
                    "batch's). Leave out the argument to accumulate or drop stale "
                    "gradients under jit, or run the step inside jax.shard_map(..., "
                    "mesh=mesh) to combine per-replica gradients by name"
                ) from None
            raise ValueError(
                f"{argname}={axis_name!r} is not bound here: call the update inside "
                f"jax.pmap, jax.shard_map or jax.vmap with that axis name ({e})"
            ) from None


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
