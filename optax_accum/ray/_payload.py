"""What the handles send and get back: the accumulator's spec (one array, or a tree of
them), gradients as host NumPy (the large by reference through Ray's object store),
and taken aggregates as `jax.Array`s.

JAX is imported only when it is needed: to flatten a tree, or to return a taken
aggregate. A process that only applies NumPy gradients to a one-array accumulator
never imports it, and neither does the actor, which shares this package.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import ray

from optax_accum.host import _args
from optax_accum.ray._spec import Leaf, Spec

# Arrays of at least this many bytes go by reference (`ray.put`); smaller ones are
# sent inline with the call, as Ray sends small arguments.
BY_REFERENCE_BYTES = 100 * 1024


# --------------------------------------------------------------------------- the spec


def _is_shape(x: Any) -> bool:
    """Whether `x` reads as one shape (None, an int, or a sequence of ints and Nones)."""
    if x is None or (isinstance(x, int | np.integer) and not isinstance(x, bool)):
        return True
    if isinstance(x, tuple | list):
        return all(d is None or isinstance(d, int | np.integer) for d in x)
    return (isinstance(x, np.ndarray) or _args.is_jax_array(x)) and x.ndim == 1


def _is_struct(x: Any) -> bool:
    """Whether `x` carries a shape and a dtype (an array, a `jax.ShapeDtypeStruct`)."""
    if isinstance(x, type | np.dtype | str):
        return False
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _single_dtype(dtype: Any) -> np.dtype | None:
    try:
        return _args.check_dtype(dtype)
    except TypeError:
        return None


def spec_of(
    kind: str, dtype: Any, shape: Any, reduction_type: str, skip_nonfinite: bool
) -> tuple[Spec, Any]:
    """The spec of an accumulator of `dtype` and `shape`, and its tree's treedef (None
    for one array).

    One array: a dtype and a shape, as in-process. A tree: a tree of arrays or
    `jax.ShapeDtypeStruct`s as `dtype` (and `shape` None), a tree of dtypes and a
    matching tree of shapes, or one dtype and a tree of shapes.
    """
    mean = _args.check_reduction(reduction_type)
    skip_nonfinite = _args.check_bool("skip_nonfinite", skip_nonfinite)
    single = _single_dtype(dtype)
    treedef = None
    if single is not None and _is_shape(shape):
        leaves = (Leaf(single.name, _args.check_shape(shape), ""),)
    else:
        leaves, treedef = _tree_leaves(dtype, shape, single)
    reduction = "MEAN" if mean else "SUM"
    tree = None if treedef is None else str(treedef)
    return Spec(kind, leaves, tree, reduction, skip_nonfinite), treedef


def _tree_leaves(dtype: Any, shape: Any, single: np.dtype | None) -> tuple[tuple, Any]:
    import jax

    tree_util = jax.tree_util
    if single is not None:  # one dtype, a tree of shapes
        flat, treedef = tree_util.tree_flatten_with_path(shape, is_leaf=_is_shape)
        pairs = [(path, single, s) for path, s in flat]
    else:
        flat, treedef = tree_util.tree_flatten_with_path(dtype)
        if flat and all(_is_struct(x) for _, x in flat):
            if shape is not None:
                raise ValueError(
                    "shape must be None when dtype is a tree of arrays or "
                    f"jax.ShapeDtypeStructs (they carry their shapes), got {shape!r}"
                )
            pairs = [(path, x.dtype, tuple(x.shape)) for path, x in flat]
        else:
            try:
                shapes = treedef.flatten_up_to(shape)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"shape must be a tree of shapes with dtype's structure {treedef}, "
                    f"got {shape!r} ({error})"
                ) from None
            pairs = [(path, d, s) for (path, d), s in zip(flat, shapes, strict=True)]
    if not pairs:
        raise ValueError(f"the accumulator's tree must have at least one leaf, got {treedef}")
    leaves = tuple(
        Leaf(_args.check_dtype(d).name, _args.check_shape(s), tree_util.keystr(path))
        for path, d, s in pairs
    )
    return leaves, treedef


def leaves_of(treedef: Any, tree: Any, what: str) -> list:
    """The leaves of `tree`, a gradient (or one of its parts) of the accumulator's tree
    structure `treedef` (None: the one array itself)."""
    if treedef is None:
        return [tree]
    try:
        return treedef.flatten_up_to(tree)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{what} must have the accumulator's tree structure {treedef}: {error}"
        ) from None


# --------------------------------------------------------------------------- arrays


def to_host(x: Any) -> Any:
    """`x` with a `jax.Array` brought to host NumPy (one transfer); anything else,
    NumPy arrays and Python values included, as it came (the actor checks it). A
    deleted (donated) `jax.Array` is the in-process ValueError."""
    if _args.is_jax_array(x):
        if x.is_deleted():
            raise ValueError(
                "grad must be a live array, got one whose buffer was deleted (donated to a "
                "jit or deleted) before the apply"
            )
        return np.asarray(x)
    return x


def send(x: Any) -> Any:
    """`to_host(x)`, put in the object store when it is a large NumPy array: the call
    then carries its reference, which Ray resolves to a read-only view in the actor."""
    x = to_host(x)
    if isinstance(x, np.ndarray) and x.nbytes >= BY_REFERENCE_BYTES:
        return ray.put(x)
    return x


def from_host(x: np.ndarray) -> Any:
    """A taken array, returned as the in-process classes return it: a `jax.Array` on
    the caller's default device, of the same dtype (float64 too when jax_enable_x64
    is off, as the in-process objects keep it)."""
    import jax.numpy as jnp

    if x.dtype == np.float64 and not sys.modules["jax"].config.jax_enable_x64:
        from optax_accum import _compat

        with _compat.enable_x64(True):
            return jnp.asarray(x)
    return jnp.asarray(x)
