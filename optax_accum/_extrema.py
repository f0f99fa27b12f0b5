"""Leaves whose window combines by max or min: FP8 amax histories and other statistics.

A leaf whose `reduction` is "max" keeps the running elementwise max of the window's
accepted gradients (`RunningMax`), "min" the running min (`RunningMin`), like its param
and in the accumulator's dtype. Like a dense sum it restarts lazily: after a release
the next gradient starts from the identity (-inf for max, +inf for min) in the same
pass. A max has no weights: every accepted gradient takes part, whatever its `weight`.
Under an `axis_name` each replica keeps its own and the release takes one `pmax`
(`pmin`) over the replicas; a held step moves nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _checks, _compat, _sums
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
    `param` (its sharding and varying axes too)."""
    dtype = _sums.accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    return KINDS[how](identity(how, jnp.zeros_like(param, dtype=dtype)))


def check_param(where: str, param: Any, kind: str) -> None:
    """At `init`: a max (min) leaf's param must not be typed reduced, whose gradients
    arrive as partial sums (see `check`)."""
    axes = _compat.sum_types(param)[0]
    if axes:
        raise TypeError(
            f'{where} has reduction "{kind}" but is typed reduced over {sorted(axes)}: its '
            "gradients would arrive typed unreduced, partial sums over devices, whose "
            f"{kind} is not the {kind} of the values (jax 0.10 has no max kind of "
            "unreduced). Keep this param out of optax_accum.as_reduced (its statistic then "
            "arrives with its true values), or accumulate under jax.shard_map with "
            f"axis_name, where each replica keeps its own and the release takes one {kind}"
        )


def continued(store: Any, restart: jax.Array, accepted: jax.Array, gradient: jax.Array) -> Any:
    """The store after one step: restarted if the last step released it, combined with
    the gradient if `accepted` (a selection: a rejected NaN never reaches it)."""
    kind = how(store)
    values = _sums.select(restart, identity(kind, store.values), store.values)
    combined = _COMBINE[kind](values, gradient.astype(values.dtype))
    return type(store)(_sums.select(accepted, combined, values))


def released(stores: list, axis_name: Any) -> list:
    """The window's values: each store's, and over `axis_name` one `pmax` (`pmin`) per
    kind for all its leaves (XLA may pack them into one all-reduce)."""
    out = [s.values for s in stores]
    if axis_name is None:
        return out
    for kind, across in _ACROSS.items():
        at = [i for i, s in enumerate(stores) if how(s) == kind]
        if at:
            for i, x in zip(at, across([out[i] for i in at], axis_name), strict=True):
                out[i] = x
    return out


def check(where: str, gradient: Any, store: Any) -> None:
    """A max (min) leaf's gradient: an array of its param's shape, floating, whose true
    values each device holds (not typed unreduced: partial sums have no max)."""
    kind = how(store)
    if isinstance(gradient, IndexedSlices):
        raise TypeError(
            f'{where} must be an array (reduction "{kind}" keeps a dense leaf), got an '
            "IndexedSlices: offer its dense values (IndexedSlices.to_dense())"
        )
    _checks.check_tree_matches(gradient, store.values, what=where)
    axes = _compat.sum_types(gradient)[1]
    if axes:
        raise TypeError(
            f'{where} must hold its true values (reduction "{kind}"), got '
            f"{jax.typeof(gradient)}, typed unreduced over {sorted(axes)}: each device holds "
            f"a partial sum, and the {kind} of partial sums is not the {kind} of the values "
            "(jax 0.10 has no max kind of unreduced). Keep this param out of "
            "optax_accum.as_reduced, or accumulate under jax.shard_map with axis_name, "
            f"where each replica keeps its own and the release takes one {kind} over them"
        )


__all__ = [
    "KINDS",
    "RunningMax",
    "RunningMin",
    "check",
    "check_param",
    "continued",
    "empty",
    "how",
    "released",
]
