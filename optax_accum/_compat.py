"""The one place that knows how different jax versions spell things.

Every use of a jax API that moved, was renamed or is read off an abstract value goes
through here, on public APIs only. When this module cannot tell what the running jax
means, it raises a clear error rather than guessing.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` varies under `jax.shard_map`.

    `x` is an array, a tracer, an abstract value or a `jax.ShapeDtypeStruct`. Outside
    `jax.shard_map` this is the empty set. jax >= 0.10 reports it as
    `manual_axis_type.varying`, jax 0.7 to 0.9 as `vma`.

    Raises:
      RuntimeError: when the running jax reports neither, so that a partition spec is
        never derived from a guess.
    """
    for candidate in (x, None):
        if candidate is None:
            candidate = jax.typeof(x)
        manual = getattr(candidate, "manual_axis_type", None)
        if manual is not None:
            return frozenset(manual.varying)
        vma = getattr(candidate, "vma", None)
        if vma is not None:
            return frozenset(vma)
    raise RuntimeError(
        f"optax_accum cannot tell which mesh axes a value varies over with jax "
        f"{jax.__version__}: {type(x).__name__} reports neither `manual_axis_type` nor "
        "`vma`; please report this with your jax version"
    )


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """`x` typed as varying over `axes` too under `jax.shard_map` (no data moves)."""
    missing = axes - varying_axes(x)
    if not missing:
        return x
    return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


__all__ = ["make_varying", "varying_axes"]
