"""Leaves whose window combines by max or min: FP8 amax histories and other statistics.

A leaf whose `reduction` is "max" keeps the running elementwise max of the window's
accepted gradients (`RunningMax`), "min" the running min (`RunningMin`), like its param
and in the accumulator's dtype. Like a dense sum it restarts lazily: after a release
the next gradient starts from the identity (-inf for max, +inf for min) in the same
pass. A max has no weights: every accepted gradient takes part, whatever its `weight`.
Under an `axis_name` each replica keeps its own and the release takes one `pmax`
(`pmin`) over the replicas; a held step moves nothing.

Under `jax.jit` on a mesh, a max leaf whose param is typed reduced over axes A gets
its statistic typed unreduced over A, each device holding its own value. jax 0.10's
unreduced type has one kind, the sum, and no op but linear ones and the sum's
reduction may read it, so the store is kept by hand: typed unreduced over A like the
gradient, combined inside a `jax.shard_map` that does not check types (each device
takes the max of its own values; nothing moves), and released by one `pmax` (`pmin`)
over A in the same way, to the plain type. The release reads each device's part as
that device's value, which is what jax 0.11's max kind of unreduced says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _compat, _sums, _unreduced
from optax_accum.indexed_slices import IndexedSlices


class RunningMax(NamedTuple):
    """A "max" leaf's store: the elementwise max of the window's accepted gradients
    (-inf before the first; after a release it holds no meaningful values until the
    next `update` restarts it).

    Attributes:
      values: shaped like the param, in the accumulator's dtype.
    """

    values: jax.Array


class RunningMin(NamedTuple):
    """A "min" leaf's store: as `RunningMax`, with the elementwise min (+inf before the
    first gradient).

    Attributes:
      values: shaped like the param, in the accumulator's dtype.
    """

    values: jax.Array


KINDS = {"max": RunningMax, "min": RunningMin}
_COMBINE = {"max": lax.max, "min": lax.min}
_ACROSS = {"max": lax.pmax, "min": lax.pmin}


def how(store: Any) -> str:
    """ "max" or "min": which a store keeps."""
    return "max" if isinstance(store, RunningMax) else "min"


def identity(how: str, like: jax.Array) -> jax.Array:
    """-inf (max) or +inf (min), shaped and laid out like `like`."""
    value = -jnp.inf if how == "max" else jnp.inf
    return jnp.full_like(like, value)


def empty(how: str, param: Any, accumulator_dtype: Any) -> Any:
    """The store of a fresh window: the identity, in the dtype the accumulator keeps for
    `param` (its sharding and varying axes too); typed unreduced over the axes `param`
    is reduced over, the identity on every device."""
    dtype = _sums.accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    zeros = _unreduced.sum_zeros(param, dtype)
    axes = _held_axes(zeros)
    if not axes:
        return KINDS[how](identity(how, zeros))
    spec = _spec(zeros, axes)
    return KINDS[how](
        _unreduced.by_device(lambda z: identity(how, z), (zeros,), (spec,), spec, zeros)
    )


def continued(store: Any, restart: jax.Array, accepted: jax.Array, gradient: jax.Array) -> Any:
    """The store after one step: restarted if the last step released it, combined with
    the gradient if `accepted` (a selection: a rejected NaN never reaches it). A store
    typed unreduced is combined on each device, moving nothing."""
    kind = how(store)

    def step(restart: jax.Array, accepted: jax.Array, values: jax.Array, g: jax.Array) -> Any:
        values = _sums.select(restart, identity(kind, values), values)
        combined = _COMBINE[kind](values, g.astype(values.dtype))
        return _sums.select(accepted, combined, values)

    axes = _held_axes(store.values)
    if not axes:
        return type(store)(step(restart, accepted, store.values, gradient))
    spec = _spec(store.values, axes)
    args = (restart, accepted, store.values, gradient)
    return type(store)(_unreduced.by_device(step, args, (P(), P(), spec, spec), spec, store.values))


def released(stores: list, axis_name: Any) -> list:
    """The window's values: each store's, and over `axis_name` one `pmax` (`pmin`) per
    kind for all its leaves (XLA may pack them into one all-reduce); stores typed
    unreduced take one `pmax` (`pmin`) over their axes, to the plain type."""
    out = [s.values for s in stores]
    kinds = [how(s) for s in stores]
    if axis_name is None:
        held = [i for i, x in enumerate(out) if _held_axes(x)]
        reduced = across_devices([out[i] for i in held], tuple(kinds[i] for i in held))
        for i, x in zip(held, reduced, strict=True):
            out[i] = x
        return out
    for kind, across in _ACROSS.items():
        at = [i for i, k in enumerate(kinds) if k == kind]
        if at:
            for i, x in zip(at, across([out[i] for i in at], axis_name), strict=True):
                out[i] = x
    return out


def across_devices(values: list, kinds: tuple) -> list:
    """Each of `values`, typed unreduced (each device's own), reduced over its
    unreduced axes by its kind ("max" or "min") to the plain type: one all-reduce per
    kind and set of axes."""
    out = list(values)
    groups: dict[tuple, list[int]] = {}
    for i, (x, kind) in enumerate(zip(values, kinds, strict=True)):
        groups.setdefault((kind, _held_axes(x)), []).append(i)
    for (kind, axes), where in groups.items():
        reduced = _across_devices(_ACROSS[kind], [values[i] for i in where], axes)
        for i, x in zip(where, reduced, strict=True):
            out[i] = x
    return out


def leaf_kinds(tree: Any) -> list:
    """For each leaf of `tree`, in `jax.tree.leaves` order: "max" ("min") where it is a
    `RunningMax` (`RunningMin`)'s values, None elsewhere."""
    out = []
    for x in jax.tree.leaves(tree, is_leaf=_is_store):
        out.extend([how(x)] * len(jax.tree.leaves(x)) if _is_store(x) else [None])
    return out


def _is_store(x: Any) -> bool:
    return isinstance(x, RunningMax | RunningMin)


def check(where: str, gradient: Any, store: Any) -> None:
    """A max (min) leaf's gradient: an array of its param's shape, floating, holding its
    true values on each device (plain), or each device's own values (typed unreduced
    over the axes its param is reduced over)."""
    kind = how(store)
    if isinstance(gradient, IndexedSlices):
        raise TypeError(
            f'{where} must be an array (reduction "{kind}" keeps a dense leaf), got an '
            "IndexedSlices: offer its dense values (IndexedSlices.to_dense())"
        )
    _checks.check_tree_matches(gradient, store.values, what=where)
    got, want = _held_axes(gradient), _held_axes(store.values)
    if got == want:
        return
    if not want:
        raise TypeError(
            f'{where} must hold its true values (reduction "{kind}"), got '
            f"{jax.typeof(gradient)}, typed unreduced over {sorted(got)}: each device holds "
            "its own part, and the state was made from a param not typed reduced, which "
            "keeps one value for all devices. Make the state from the params typed reduced "
            "over these axes (optax_accum.as_reduced): each device then keeps its own "
            f"{kind} and the release takes one {kind} over them"
        )
    raise TypeError(
        f"{where} must be typed unreduced over {sorted(want)}, as the running {kind} that "
        "tx.init made from its param typed reduced over them is: each device's own value "
        '(jax.lax.pcast(x, axes, to="unreduced") inside a jax.shard_map gives it), got '
        f"{jax.typeof(gradient)}"
    )


# --------------------------------------------------------------------------- by hand


def _held_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` holds one value per device (typed unreduced)."""
    return _compat.sum_types(x)[1]


def _spec(x: Any, unreduced: frozenset = frozenset()) -> P:
    """`x`'s layout, typed unreduced over `unreduced`."""
    partitions = _compat.explicit_sharding(jax.typeof(x)).spec.partitions
    return P(*partitions, unreduced=unreduced)


def _mesh_order(x: Any, axes: frozenset) -> tuple:
    """`axes` in the order of `x`'s mesh."""
    names = _compat.explicit_sharding(jax.typeof(x)).mesh.axis_names
    return tuple(a for a in names if a in axes)


def _across_devices(across: Callable, values: list, axes: frozenset) -> list:
    """`values`, each typed unreduced over `axes`, reduced by `across` (`lax.pmax` or
    `lax.pmin`) over them to the plain type: one all-reduce for them all."""
    names = _mesh_order(values[0], axes)
    specs = (tuple(_spec(v, axes) for v in values), [_spec(v) for v in values])
    return _unreduced.by_device(lambda *xs: across(list(xs), names), values, *specs, values[0])


__all__ = [
    "KINDS",
    "RunningMax",
    "RunningMin",
    "across_devices",
    "check",
    "continued",
    "empty",
    "how",
    "leaf_kinds",
    "released",
]
