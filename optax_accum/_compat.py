"""The one place that knows how different jax versions spell things.

Every use of a jax API that moved, was renamed or is read off an abstract value goes
through here, on public APIs only. When this module cannot tell what the running jax
means, it raises a clear error rather than guessing.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable, Sequence
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


def pcast_varying(x: Any, axis_name: Hashable | Sequence[Hashable]) -> Any:
    """`x` (a pytree) typed as varying over `axis_name` under `jax.shard_map`.

    No data moves: each replica keeps its own copy, now typed as its own. Differentiate
    with respect to it to get each replica's own gradient. jax >= 0.8.2 spells it
    `jax.lax.pcast(x, axis_name, to="varying")`, older jax `jax.lax.pvary`.

    Raises:
      RuntimeError: when the running jax has neither.
    """
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axis_name, to="varying")
    if hasattr(lax, "pvary"):
        return lax.pvary(x, axis_name)
    raise RuntimeError(_missing("jax.lax.pcast(..., to='varying') or jax.lax.pvary"))


def make_varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """`x` typed as varying over `axes` too under `jax.shard_map` (no data moves)."""
    missing = axes - varying_axes(x)
    if not missing:
        return x
    return pcast_varying(x, tuple(sorted(missing, key=str)))


def all_gather_invariant(x: jax.Array, axis_name: Hashable | Sequence[Hashable]) -> jax.Array:
    """Every replica's `x` stacked on a new leading axis, typed replica-invariant.

    Under `jax.shard_map`, the result needs no mesh axis in an out_spec. `x` must be
    varying over `axis_name`. jax >= 0.9 spells it `jax.lax.all_gather(x, axis_name,
    to="invarying")`, older jax `jax.lax.all_gather_invariant`.

    Raises:
      RuntimeError: when the running jax has neither.
    """
    if _ALL_GATHER_TAKES_TO:
        return lax.all_gather(x, axis_name, to="invarying")
    if hasattr(lax, "all_gather_invariant"):
        return lax.all_gather_invariant(x, axis_name)
    raise RuntimeError(
        _missing("jax.lax.all_gather(..., to='invarying') or jax.lax.all_gather_invariant")
    )


def explicit_sharding(aval: Any) -> Any:
    """The sharding in `aval`'s type when its mesh has an `Explicit` axis, else None.

    `aval` is an abstract value (or a `jax.ShapeDtypeStruct`). Under explicit sharding
    (`jax.make_mesh`'s default from jax 0.10, or `axis_types=(AxisType.Explicit, ...)`),
    an array built from a shape alone is replicated, and a replicated value where a
    sharded one was traced is a type error: pass the result as `out_sharding=` to
    `jnp.zeros` or `jnp.broadcast_to`. Under auto sharding or no mesh there is nothing
    to pass (sharding is propagated, not typed).
    """
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    axis_types = getattr(mesh, "axis_types", None) or ()
    if any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return sharding
    return None


def sum_types(x: Any) -> tuple[frozenset, frozenset]:
    """The mesh axes `x`'s type is reduced over and unreduced over: `(reduced, unreduced)`.

    Under explicit sharding, jax >= 0.10 types an array `{R:axes}` (`P(...,
    reduced=axes)`: a full copy on every device, whose gradients come back unreduced)
    or `{U:axes}` (`P(..., unreduced=axes)`: each device holds a partial sum, the true
    value is their sum). Both are empty under auto sharding, outside a mesh, and on a
    jax whose `PartitionSpec` has no such sets. `x` is an array, a tracer, an abstract
    value or a `jax.ShapeDtypeStruct`.
    """
    aval = x if isinstance(x, jax.ShapeDtypeStruct | jax.core.AbstractValue) else jax.typeof(x)
    spec = getattr(explicit_sharding(aval), "spec", None)
    return (
        frozenset(getattr(spec, "reduced", None) or ()),
        frozenset(getattr(spec, "unreduced", None) or ()),
    )


def has_sum_types() -> bool:
    """Whether the running jax has reduced and unreduced sharding types (0.10 on)."""
    return hasattr(jax.sharding.PartitionSpec(), "unreduced") and hasattr(lax, "pcast")


def require_sum_types() -> None:
    """Raises unless the running jax has reduced and unreduced sharding types.

    Raises:
      RuntimeError: naming the jax version found.
    """
    if not has_sum_types():
        raise RuntimeError(
            "unreduced gradients need jax's reduced and unreduced sharding types "
            f"(jax 0.10 or newer), which jax {jax.__version__} does not have"
        )


def retyped(
    x: jax.Array,
    *,
    reduced: frozenset = frozenset(),
    unreduced: frozenset = frozenset(),
    like: Any = None,
) -> Any:
    """`x` typed reduced over `reduced` and unreduced over `unreduced` (explicit sharding).

    The layout (`spec.partitions`) is kept. Casting to or from reduced moves no data
    (a reduced array is a full copy on every device, as a plain one is); dropping
    unreduced axes is the all-reduce that sums the devices' partial sums. `x` comes back
    as it is when its type already says so, or when it has no explicit sharding and
    nothing is asked. The concrete mesh of a placed array is used when it has one, so
    this works eagerly outside `jax.set_mesh` too. A value without a mesh takes `like`'s:
    a scalar (a constant made in the program) replicated, a value of `like`'s shape in
    `like`'s layout.

    Raises:
      ValueError: when reduced or unreduced axes are asked of a value that has no
        explicit sharding (auto sharding, no mesh), or of a jax without these types.
    """
    reduced, unreduced = frozenset(reduced), frozenset(unreduced)
    if sum_types(x) == (reduced, unreduced):
        return x
    sharding = explicit_sharding(jax.typeof(x))
    if sharding is None and like is not None:
        # A value made inside the program without a mesh takes `like`'s: a scalar (a
        # constant) replicated, a value of `like`'s shape in its layout (jax 0.11 gives
        # what `jnp.zeros_like` makes no mesh when jit runs outside `jax.set_mesh`).
        like_sharding = explicit_sharding(jax.typeof(like))
        if like_sharding is not None and jax.numpy.ndim(x) == 0:
            sharding = jax.sharding.NamedSharding(like_sharding.mesh, jax.sharding.PartitionSpec())
        elif like_sharding is not None and jax.numpy.shape(x) == jax.numpy.shape(like):
            sharding = like_sharding
    if sharding is None or not hasattr(sharding.spec, "unreduced"):
        raise ValueError(
            f"optax_accum cannot type a value reduced over {sorted(reduced)} or unreduced "
            f"over {sorted(unreduced)}: it has no explicit sharding (jax {jax.__version__}, "
            f"type {jax.typeof(x)})"
        )
    mesh = sharding.mesh
    concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(concrete, jax.sharding.NamedSharding):
        mesh = concrete.mesh
    spec = jax.sharding.PartitionSpec(
        *sharding.spec.partitions, reduced=reduced, unreduced=unreduced
    )
    return jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def sharding_of(x: Any) -> Any:
    """`explicit_sharding` of an array's type: what to pass as `out_sharding=` to keep
    `x`'s layout under explicit sharding (None otherwise)."""
    return explicit_sharding(jax.typeof(x))


def replicated_under_auto(tree: Any) -> Any:
    """`tree` constrained to be replicated when the current mesh (`jax.set_mesh`) has
    only `Auto` axes; unchanged otherwise.

    Under auto sharding (GSPMD) the partitioner may split small index arrays over a
    mesh axis and then stitch them back with many tiny collectives; one constraint at
    the entry keeps them whole. Explicit sharding says the same in the types, and
    under `jax.shard_map` each replica holds its own.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return tree
    return lax.with_sharding_constraint(tree, jax.sharding.PartitionSpec())


def replicated(tree: Any) -> Any:
    """`tree` whole on every device: each leaf that explicit sharding lays out across
    the mesh resharded to replicated (an all-gather of it), and under auto sharding
    the constraint of `replicated_under_auto`; unchanged elsewhere (no mesh, or each
    replica's own values under `jax.shard_map`).

    For small arrays that are looked up by any index (a sparse gradient's row ids and
    rows): a gather with ids split over a mesh axis has no sharding rule under explicit
    sharding. Reduced and unreduced axes are kept. The concrete mesh of a placed array
    is used, so this works eagerly outside `jax.set_mesh` too.
    """

    def whole(x: Any) -> Any:
        sharding = explicit_sharding(jax.typeof(x))
        if sharding is None or all(p is None for p in sharding.spec):
            return x
        mesh = sharding.mesh
        concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
        if isinstance(concrete, jax.sharding.NamedSharding):
            mesh = concrete.mesh
        sums = {k: getattr(sharding.spec, k, None) for k in ("reduced", "unreduced")}
        spec = jax.sharding.PartitionSpec(**{k: v for k, v in sums.items() if v})
        # `jax.sharding.reshard`: jax 0.8 has no `jax.reshard`.
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))

    return replicated_under_auto(jax.tree.map(whole, tree))


def leading_axis_sharding(x: Any) -> Any:
    """Under explicit sharding, the sharding of a vector laid out like `x`'s first axis
    (for per-row state of a parameter `x`); None otherwise.

    The concrete mesh of `x` is used when it has one, so this also works outside
    `jax.set_mesh` on an array that was placed by hand.
    """
    sharding = explicit_sharding(jax.typeof(x))
    if sharding is None:
        return None
    mesh = sharding.mesh
    concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if isinstance(concrete, jax.sharding.NamedSharding):
        mesh = concrete.mesh
    layout = getattr(sharding.spec, "partitions", sharding.spec)  # without reduced axes
    rows = (layout[0],) if len(layout) and jax.numpy.ndim(x) else ()
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*rows))


def mesh_context(mesh: Any) -> contextlib.AbstractContextManager:
    """A context manager that makes `mesh` the current mesh (`jax.set_mesh` from jax
    0.7, `jax.sharding.use_mesh` before); an `AbstractMesh` (no devices: for tracing
    only) with `jax.sharding.use_abstract_mesh`.

    Raises:
      RuntimeError: when the running jax has neither.
    """
    if not isinstance(mesh, jax.sharding.Mesh) and hasattr(jax.sharding, "use_abstract_mesh"):
        return jax.sharding.use_abstract_mesh(mesh)  # an AbstractMesh: tracing only
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    if hasattr(jax.sharding, "use_mesh"):
        return jax.sharding.use_mesh(mesh)
    raise RuntimeError(_missing("jax.set_mesh or jax.sharding.use_mesh"))


def concrete_mesh() -> Any:
    """The mesh set with `jax.set_mesh` (jax 0.7 on, `jax.sharding.get_mesh`), or None
    when none is set or the running jax cannot say. Call it outside `jax.jit`."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    mesh = None if get_mesh is None else get_mesh()
    return None if mesh is None or mesh.empty else mesh


def with_explicit_axes(mesh: Any) -> Any:
    """`mesh` (a `Mesh`, or the `AbstractMesh` of a `jax.eval_shape` result) with every
    axis `Explicit`, so that a value traced on it carries its sharding in its type.

    Raises:
      RuntimeError: when the running jax cannot change an abstract mesh's axis types.
    """
    explicit = jax.sharding.AxisType.Explicit
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(
            mesh.devices, mesh.axis_names, axis_types=(explicit,) * len(mesh.axis_names)
        )
    if not hasattr(mesh, "update_axis_types"):
        raise RuntimeError(_missing("jax.sharding.AbstractMesh.update_axis_types"))
    return mesh.update_axis_types(dict.fromkeys(mesh.axis_names, explicit))


def placing_mesh(mesh: Any) -> Any:
    """The mesh to build shardings on for values typed on `mesh`: `mesh` itself when it
    is a `Mesh`; for an `AbstractMesh` (from `jax.eval_shape`), the mesh set with
    `jax.set_mesh` when it is that mesh, else the abstract mesh (which `jax.jit`'s
    `out_shardings` take while a matching mesh is set). Call it outside `jax.jit`."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    current = concrete_mesh()
    return current if current is not None and current.abstract_mesh == mesh else mesh


def enable_x64(new_val: bool = True) -> contextlib.AbstractContextManager:
    """A context manager that turns 64-bit types on (or off) in this thread.

    jax >= 0.8 spells it `jax.enable_x64`, older jax `jax.experimental.enable_x64`.

    Raises:
      RuntimeError: when the running jax has neither.
    """
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(new_val)
    from jax import experimental

    if hasattr(experimental, "enable_x64"):
        return experimental.enable_x64(new_val)
    raise RuntimeError(_missing("jax.enable_x64 or jax.experimental.enable_x64"))


def _missing(what: str) -> str:
    return (
        f"optax_accum needs {what}, which jax {jax.__version__} does not have; "
        "please report this with your jax version"
    )


_ALL_GATHER_TAKES_TO = "to" in inspect.signature(lax.all_gather).parameters


__all__ = [
    "all_gather_invariant",
    "concrete_mesh",
    "enable_x64",
    "explicit_sharding",
    "leading_axis_sharding",
    "make_varying",
    "mesh_context",
    "pcast_varying",
    "placing_mesh",
    "replicated_under_auto",
    "has_sum_types",
    "require_sum_types",
    "replicated",
    "retyped",
    "sharding_of",
    "sum_types",
    "varying_axes",
    "with_explicit_axes",
]
