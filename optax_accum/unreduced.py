"""Unreduced gradients of any model under `jax.jit`: one reduction per window.

On a data-parallel mesh with explicit sharding, `jax.grad` all-reduces the gradient
of every replicated param on every step. Typing a param reduced over the batch's mesh
axes (`as_reduced`) makes `jax.grad` leave that sum to the caller (the gradient comes
back typed unreduced, `{U:axes}`), and every optax_accum accumulator then keeps an
unreduced running sum and reduces it once a window, in its release. On jax 0.10 a
reduced param may meet batch-sharded values only inside a dot, though: `x @ w + b`
raises. `unreduced_grad` works for any model: it differentiates the loss on each
device's shard of the batch (`jax.shard_map`), so no type rule is involved, and
returns each gradient typed unreduced over the batch axes, with no all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _compat, _unreduced


def as_reduced(params: optax.Params, axes: Hashable | Sequence[Hashable]) -> optax.Params:
    """`params` typed reduced over the mesh axes `axes`: a cast that moves nothing.

    A reduced array is a full copy on every device along `axes`, as a replicated one
    is; it differs in what autodiff gives for it: its gradient comes back typed
    unreduced over `axes` (each device's partial sum, not yet all-reduced). Make the
    state from the cast params (`tx.init(as_reduced(params, axes))`, or
    `optax_accum.state_shardings`) and every optax_accum accumulator keeps an unreduced
    running sum that it reduces once a window; its updates come back typed as the
    params, so `optax.apply_updates` keeps their type. Each param keeps its layout
    (an FSDP shard stays a shard).

    Needs explicit sharding (`jax.make_mesh`'s default from jax 0.10, under
    `jax.set_mesh`, or params placed with a `NamedSharding` on such a mesh) and a jax
    whose `PartitionSpec` has `reduced` axes (0.10 or newer).

    Args:
      params: the params (a pytree of arrays), on a mesh with explicit axes.
      axes: a mesh axis name, or a sequence of them: the axes the batch is split over
        whose gradient sum is to be deferred (for two-level meshes, the outer one).

    Returns:
      The params, each typed reduced over `axes`.

    Raises:
      ValueError: when `axes` names no axis of the params' mesh, a param is sharded
        over one of them, or a param has no explicit sharding.

    Example:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> with jax.set_mesh(mesh):
      ...     params = optax_accum.as_reduced({"w": jnp.ones((4, 2))}, "data")
      >>> jax.typeof(params["w"])
      ShapedArray(float32[4,2]{R:data})
    """
    names = _axis_names("axes", axes)
    _compat.require_sum_types()

    def cast(path: Any, x: Any) -> Any:
        _check_param_axes(path, x, names)
        reduced, unreduced = _compat.sum_types(x)
        return _compat.retyped(x, reduced=reduced | names, unreduced=unreduced)

    return jax.tree_util.tree_map_with_path(cast, params)


def unreduced_grad(
    fun: Callable[..., Any],
    axes: Hashable | Sequence[Hashable],
    *,
    argnums: int = 0,
    reduction: str = "mean",
) -> Callable[..., Any]:
    """`jax.grad(fun, argnums)` with the gradients typed unreduced over `axes`, and no
    all-reduce.

    Returns a function of `fun`'s arguments. It runs `fun` on each device's shard of
    the batch under `jax.shard_map` over the whole current mesh, so any model works
    (biases, layer norms: no sharding-type rule is involved), and differentiates with
    respect to argument `argnums` (a pytree of params). Each gradient comes back with
    its param's layout, typed unreduced over `axes`: each device along `axes` holds
    the partial sum of its own batch shards, and the sum is left to the accumulator's
    release (`conditional_accumulator` and the other accumulators keep it unreduced
    and reduce it once a window). Over the other axes the batch is split over, the
    gradient is summed here: for a param sharded FSDP-style over such an axis, by a
    reduce-scatter within it (on a two-level `(slice, data)` mesh with `axes="slice"`,
    a held step then moves nothing across slices).

    With `reduction="mean"` (the default) the gradient is that of the mean of the
    per-shard losses, which is `jax.grad(fun)` of the whole batch when `fun` averages
    over its batch (shards of equal size); with "sum", of their sum (for a `fun` that
    sums over its batch).

    The params may be typed plain or reduced (`as_reduced`): make the accumulator's
    state from params typed reduced over `axes`, so that its running sums are
    unreduced over them too, and pass those same params here. Each param is
    all-gathered over the axes it is sharded over before `fun` sees it, so `fun`
    always sees whole params. Every other argument is passed to `fun` as each device's
    block of it (its layout read from its type); arguments not sharded over a mesh
    axis are the same on every device along it.

    Needs explicit sharding (`jax.make_mesh`'s default from jax 0.10) with the mesh
    set (`jax.set_mesh`), and jax 0.10 or newer.

    Args:
      fun: the loss, `fun(*args) -> scalar`, written for one device's batch.
      axes: a mesh axis name, or a sequence of them, the batch is split over: the
        gradient stays unreduced over these.
      argnums: which positional argument holds the params (an int).
      reduction: "mean" (default) or "sum": how the per-shard losses make the loss.

    Returns:
      A function taking `fun`'s positional arguments and returning the gradients, with
      the structure of `args[argnums]`, each typed unreduced over `axes`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; when called, for a mesh
        without explicit axes, `axes` the batch is not split over, or a param sharded
        over one of `axes`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> def loss(p, x):  # a bias outside a dot: jax.grad needs this helper for it
      ...     return jnp.mean((x @ p["w"] + p["b"]) ** 2)
      >>> with jax.set_mesh(mesh):
      ...     params = optax_accum.as_reduced({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}, "data")
      ...     x = jax.reshard(jnp.ones((16, 3)), P("data"))
      ...     tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 2)
      ...     state = tx.init(params)
      ...     grads = jax.jit(optax_accum.unreduced_grad(loss, "data"))(params, x)
      ...     updates, state = tx.update(grads, state, params)
      >>> jax.typeof(grads["w"]), jax.typeof(state.accumulator["w"])
      (ShapedArray(float32[3,2]{U:data}), ShapedArray(float32[3,2]{U:data}))
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r} ({type(fun).__name__})")
    names = _axis_names("axes", axes)
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"argnums must be an int, got {argnums!r} ({type(argnums).__name__})")
    mean = _checks.canonical_reduction(reduction) == "mean"

    def grad_fn(*args: Any) -> Any:
        _compat.require_sum_types()
        if not -len(args) <= argnums < len(args):
            raise ValueError(f"argnums={argnums} names no argument of the {len(args)} given")
        index = argnums % len(args)
        mesh = _explicit_mesh()
        missing = names - set(mesh.axis_names)
        if missing:
            raise ValueError(
                f"axes must name axes of the mesh {mesh.axis_names}, got {sorted(missing)}"
            )
        args = list(args)
        params = args[index]
        jax.tree_util.tree_map_with_path(lambda path, x: _check_param_axes(path, x, names), params)
        args[index] = _unreduced.plain(params)  # free: fun gets plain, whole params
        in_specs = [jax.tree.map(_layout, a) for a in args]
        batch_axes = set()
        for i, spec in enumerate(in_specs):
            if i != index:
                batch_axes |= {
                    n for s in jax.tree.leaves(spec, is_leaf=_is_spec) for n in _spec_names(s)
                }
        if names - batch_axes:
            raise ValueError(
                "axes must be mesh axes the batch is split over, got "
                f"{sorted(names - batch_axes)}: the arguments other than the params are "
                f"split over {sorted(batch_axes)}"
            )
        shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
        scale = 1.0 / shards if mean else 1.0
        param_specs = in_specs[index]
        order = tuple(a for a in mesh.axis_names if a in batch_axes)

        def per_device(*local: Any) -> Any:
            local = list(local)
            whole = jax.tree.map(_gathered, local[index], param_specs, is_leaf=_is_array)
            local[index] = _compat.pcast_varying(whole, order)

            def scaled(p: Any) -> Any:
                return fun(*local[:index], p, *local[index + 1 :]) * scale

            grads = jax.grad(scaled)(local[index])
            return jax.tree.map(
                lambda g, s: _to_shard(g, s, batch_axes, names),
                grads,
                param_specs,
                is_leaf=_is_array,
            )

        out_specs = jax.tree.map(lambda s: P(*s, unreduced=names), param_specs, is_leaf=_is_spec)
        return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(
            *args
        )

    return grad_fn


# --------------------------------------------------------------------------- helpers


def _axis_names(name: str, axes: Any) -> frozenset:
    seq = tuple(axes) if isinstance(axes, list | tuple | set | frozenset) else (axes,)
    if not seq or any(not isinstance(a, Hashable) or isinstance(a, bool) for a in seq):
        raise TypeError(
            f"{name} must be a mesh axis name or a non-empty sequence of them, got {axes!r}"
        )
    return frozenset(seq)


def _explicit_mesh() -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        got = "no mesh" if mesh.empty else f"axis types {tuple(mesh.axis_types)}"
        raise ValueError(
            "unreduced_grad needs a mesh with explicit axes set with jax.set_mesh "
            f"(jax.make_mesh's default from jax 0.10), got {got}"
        )
    return mesh


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _spec_names(spec: P) -> set:
    names = set()
    for entry in spec:
        if entry is not None:
            names |= set(entry) if isinstance(entry, tuple) else {entry}
    return names


def _layout(x: Any) -> P:
    """The partition spec of `x`'s type, without reduced or unreduced axes."""
    sharding = _compat.explicit_sharding(jax.typeof(x))
    if sharding is None:
        return P()
    return P(*getattr(sharding.spec, "partitions", sharding.spec))


def _check_param_axes(path: Any, x: Any, names: frozenset) -> None:
    sharding = _compat.explicit_sharding(jax.typeof(x))
    if sharding is None:
        raise ValueError(
            f"params{jax.tree_util.keystr(path)} must be on a mesh with explicit axes (under "
            f"jax.set_mesh, or placed with a NamedSharding), got {jax.typeof(x)}"
        )
    shared = _spec_names(_layout(x)) & names
    if shared:
        raise ValueError(
            f"params{jax.tree_util.keystr(path)} must not be sharded over the batch axes "
            f"{sorted(shared)} whose sum is deferred, got {jax.typeof(x)}"
        )


def _gathered(x: jax.Array, spec: P) -> jax.Array:
    """A param's whole value from its local block (all-gathers over its shard axes),
    typed the same on every device along them (a varying one would make `jax.grad` sum
    the gradients of the other params over those axes)."""
    for dim, entry in enumerate(spec):
        if entry is not None:
            x = lax.all_gather(x, entry, axis=dim, tiled=True, to="invarying")
    return x


def _to_shard(g: jax.Array, spec: P, batch_axes: set, deferred: frozenset) -> jax.Array:
    """One device's gradient of a whole param, made its shard of the gradient: summed
    over the batch axes not deferred (a reduce-scatter over those the param is sharded
    over, an all-reduce over the others), sliced over the shard axes the batch is not
    split over, and typed unreduced over the deferred ones."""
    summed = set()
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        entry_names = entry if isinstance(entry, tuple) else (entry,)
        if set(entry_names) <= batch_axes:
            g = lax.psum_scatter(g, entry, scatter_dimension=dim, tiled=True)
            summed |= set(entry_names)
        elif set(entry_names) & batch_axes:
            raise ValueError(
                f"unreduced_grad cannot shard a param over {entry}: some of these axes "
                f"split the batch ({sorted(batch_axes)}) and some do not"
            )
        else:  # the same on every device along it: take this device's block
            size = g.shape[dim] // int(np.prod([lax.axis_size(n) for n in entry_names]))
            start = lax.axis_index(entry) * size
            g = lax.dynamic_slice_in_dim(g, start, size, axis=dim)
    rest = tuple(sorted(batch_axes - deferred - summed, key=str))
    if rest:
        g = lax.psum(g, rest)
    return lax.pcast(g, tuple(sorted(deferred, key=str)), to="unreduced")


__all__ = ["as_reduced", "unreduced_grad"]
