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
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _compat, _per_shard


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

    Abstract params work too, as pod code starts from them: `jax.ShapeDtypeStruct`
    leaves with a `NamedSharding` (on a mesh or on the abstract mesh `jax.eval_shape`
    gives under `jax.set_mesh`) come back as `jax.ShapeDtypeStruct` leaves typed reduced,
    ready for `jax.eval_shape(tx.init, ...)` or `state_shardings`. `as_reduced` may
    also run inside the init that `jax.eval_shape` or `jax.jit` traces.

    Needs explicit sharding (`jax.make_mesh`'s default from jax 0.10, under
    `jax.set_mesh`, or params placed with a `NamedSharding` on such a mesh) and a jax
    whose `PartitionSpec` has `reduced` axes (0.10 or newer).

    Args:
      params: the params (a pytree of arrays or `jax.ShapeDtypeStruct` values), on a
        mesh with explicit axes.
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
    names = _per_shard.axis_names("axes", axes)
    _compat.require_sum_types()

    def cast(path: Any, x: Any) -> Any:
        _per_shard.check_param_axes(path, x, names)
        reduced, unreduced = _compat.sum_types(x)
        if isinstance(x, jax.ShapeDtypeStruct):
            spec = P(*x.sharding.spec.partitions, reduced=reduced | names, unreduced=unreduced)
            return x.update(sharding=NamedSharding(x.sharding.mesh, spec))
        return _compat.retyped(x, reduced=reduced | names, unreduced=unreduced)

    return jax.tree_util.tree_map_with_path(cast, params)


def unreduced_grad(
    fun: Callable[..., Any],
    axes: Hashable | Sequence[Hashable],
    *,
    argnums: int = 0,
    has_aux: bool = False,
    reduction: str = "mean",
) -> Callable[..., Any]:
    """`jax.grad(fun, argnums, has_aux)` with the gradients typed unreduced over `axes`,
    and no all-reduce.

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
    always sees whole params. Every other array argument is passed to `fun` as each
    device's block of it (its layout read from its type); arrays not sharded over a
    mesh axis are the same on every device along it. Arguments that are not arrays
    (a `train` flag, a mode name, a layer count: Python bools, strings, ints, None)
    reach `fun` as they are, as with `jax.grad`, also under `jax.jit`. Keyword
    arguments are passed on the same way. `fun` must take every array it reads as an
    argument: an array it closes over cannot be split per device (a clear error says
    so).

    With `has_aux=True`, `fun` returns `(loss, aux)` and the result is `(grads, aux)`,
    `aux` computed in the same forward pass and typed as `unreduced_value_and_grad`
    types it (each device's share; nothing moves until it is read).

    Needs explicit sharding (`jax.make_mesh`'s default from jax 0.10) with the mesh
    set (`jax.set_mesh`), and jax 0.10 or newer.

    Args:
      fun: the loss, `fun(*args, **kwargs) -> scalar` (or `(scalar, aux)` with
        `has_aux`), written for one device's batch.
      axes: a mesh axis name, or a sequence of them, the batch is split over: the
        gradient stays unreduced over these.
      argnums: which positional argument holds the params (an int).
      has_aux: whether `fun` returns `(loss, aux)`.
      reduction: "mean" (default) or "sum": how the per-shard losses make the loss.

    Returns:
      A function taking `fun`'s arguments and returning the gradients (with the
      structure of `args[argnums]`, each typed unreduced over `axes`), or
      `(grads, aux)` with `has_aux`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; when called, for a mesh
        without explicit axes, `axes` the batch is not split over, a param sharded
        over one of `axes`, or a `fun` that closes over a sharded array.

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
      >>> jax.typeof(grads["w"]), jax.typeof(state.storage["w"])
      (ShapedArray(float32[3,2]{U:data}), ShapedArray(float32[3,2]{U:data}))
    """
    return _per_shard.value_and_grad(
        **_checked(fun, axes, argnums, has_aux, reduction), with_value=False
    )


def unreduced_value_and_grad(
    fun: Callable[..., Any],
    axes: Hashable | Sequence[Hashable],
    *,
    argnums: int = 0,
    has_aux: bool = False,
    reduction: str = "mean",
) -> Callable[..., Any]:
    """`jax.value_and_grad(fun, argnums, has_aux)` with the gradients typed unreduced
    over `axes`: the loss (and aux metrics) from the same forward pass, and no
    all-reduce on any step.

    The gradients are those of `unreduced_grad` (see there for the arguments, the
    layouts and the Python values `fun` may take). The loss comes back as what each
    device holds of it: `fun` saw only its device's shard of the batch, so the loss is
    typed unreduced over every mesh axis the batch is split over, each device's share
    scaled so that the shares add up to the loss the gradient is of (the mean of the
    per-shard losses with `reduction="mean"`, their sum with "sum"). Returning it costs
    nothing; reading it costs one scalar all-reduce, only where it is read: log every
    N steps with `jax.reshard(loss, P())` (under `jax.set_mesh`, or inside the jitted
    step that logs), or keep it unreduced (`jax.device_get` cannot read an unreduced
    array on jax 0.10.2). A step that returns it with `out_shardings=P()` all-reduces
    it on every step, which is what this form saves.

    With `has_aux=True`, `fun` returns `(loss, aux)`, and each aux value comes back
    typed the same way: a float one scaled as the loss is (accuracy: the shares add up
    to the mean over the shards), an integer one as it is (counts add up). Compute
    aux as a number or a small array per device (a mean, a count); per-example outputs
    do not combine this way.

    Args:
      fun: the loss, `fun(*args, **kwargs) -> scalar` (or `(scalar, aux)` with
        `has_aux`), written for one device's batch.
      axes: a mesh axis name, or a sequence of them, the batch is split over: the
        gradient stays unreduced over these.
      argnums: which positional argument holds the params (an int).
      has_aux: whether `fun` returns `(loss, aux)`.
      reduction: "mean" (default) or "sum": how the per-shard losses make the loss.

    Returns:
      A function taking `fun`'s arguments and returning `(loss, grads)`, or
      `((loss, aux), grads)` with `has_aux`, as `jax.value_and_grad` does; the loss and
      aux typed unreduced over the batch's mesh axes, the gradients over `axes`.

    Raises:
      TypeError / ValueError: as `unreduced_grad`; when called, for an aux value that
        is neither a float nor an integer.

    Example:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> def loss(p, x, train):  # a Python flag, as jax.grad takes it
      ...     err = x @ p["w"] - 1.0
      ...     hits = jnp.mean((err < 3).astype(jnp.float32))
      ...     return jnp.mean(err**2) * (2.0 if train else 1.0), {"hits": hits}
      >>> with jax.set_mesh(mesh):
      ...     params = optax_accum.as_reduced({"w": jnp.ones((3, 2))}, "data")
      ...     x = jax.reshard(jnp.ones((16, 3)), P("data"))
      ...     fn = optax_accum.unreduced_value_and_grad(loss, "data", has_aux=True)
      ...     (value, aux), grads = jax.jit(fn, static_argnums=2)(params, x, True)
      ...     logged = jax.reshard((value, aux["hits"]), P())  # when logged: scalar all-reduces
      >>> jax.typeof(value), [float(v) for v in logged]
      (ShapedArray(float32[]{U:data}), [8.0, 1.0])
    """
    return _per_shard.value_and_grad(
        **_checked(fun, axes, argnums, has_aux, reduction), with_value=True
    )


def keep_reduction_axes(specs: Any, like: Any) -> Any:
    """`specs` given the reduced and unreduced mesh axes of `like`'s types.

    Pod code shards by rules (EasyLM's and t5x's `match_partition_rules`: a regex per
    leaf path, and the `PartitionSpec` of the first that matches). A rule writes a
    layout, `P("fsdp", None)`, and knows nothing of the types of the one-reduction
    path: params typed reduced (`P("fsdp", None, reduced={"dp"})`) and the running sums
    built from them, typed unreduced (`P("fsdp", None, unreduced={"dp"})`). Given to
    `jax.jit` as `out_shardings`, a spec without them changes the type: an init gives
    plain params and sums (the step then raises a TypeError naming the leaf), and a
    step all-reduces each running sum on every step, silently. Apply the rules, then
    this, to the tree `jax.eval_shape` gives for the train state, and the specs keep
    the types while the rules keep choosing the layouts.

    Args:
      specs: a tree of `PartitionSpec` (or `NamedSharding`) leaves, one per leaf of
        `like` (what partition rules give for `like`).
      like: the tree the specs are for: arrays, or `jax.ShapeDtypeStruct` values with
        shardings (`jax.eval_shape` of the init, under `jax.set_mesh`, gives them
        typed). A leaf with no explicit sharding keeps its spec as it is.

    Returns:
      `specs`, each `PartitionSpec` (or `NamedSharding`'s spec) with its leaf's reduced
      and unreduced axes added; its layout (partitions) is the rule's.

    Raises:
      ValueError: when `specs` and `like` differ in structure, or a spec shards a leaf
        over a mesh axis that the leaf is typed reduced or unreduced over.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("dp", "fsdp"))  # explicit axes
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 4)
      >>> def init():
      ...     params = {"w": jax.reshard(jnp.zeros((8, 2)), P("fsdp", None))}
      ...     params = optax_accum.as_reduced(params, "dp")
      ...     return params, tx.init(params)
      >>> with jax.set_mesh(mesh):
      ...     shapes = jax.eval_shape(init)
      >>> ruled = jax.tree.map(lambda s: P("fsdp", None) if s.ndim else P(), shapes)
      >>> specs = optax_accum.keep_reduction_axes(ruled, shapes)
      >>> specs[0]["w"], specs[1].storage["w"], specs[1].count
      (P('fsdp', None, reduced={'dp'}), P('fsdp', None, unreduced={'dp'}), P())
    """
    is_spec = lambda x: isinstance(x, P | NamedSharding) or x is None  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    try:
        leaves = treedef.flatten_up_to(like)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"specs must have one spec per leaf of like (the tree they are for): {e}"
        ) from e
    kept = [_kept_axes(path, spec, x) for (path, spec), x in zip(flat, leaves, strict=True)]
    return treedef.unflatten(kept)


def _kept_axes(path: Any, spec: Any, x: Any) -> Any:
    """`spec` (a PartitionSpec, a NamedSharding or None) with `x`'s reduced and
    unreduced axes."""
    if spec is None or not hasattr(x, "shape"):
        return spec
    reduced, unreduced = _compat.sum_types(x)
    if not reduced and not unreduced:
        return spec
    layout = spec.spec if isinstance(spec, NamedSharding) else spec
    sharded = _per_shard.spec_names(layout) & (reduced | unreduced)
    if sharded:
        raise ValueError(
            f"specs{jax.tree_util.keystr(path)} must not shard over {sorted(sharded)}, which "
            f"the leaf is typed reduced or unreduced over (a full copy, or a partial sum, "
            f"on every device along them), got {layout}"
        )
    typed = P(*getattr(layout, "partitions", layout), reduced=reduced, unreduced=unreduced)
    return spec.update(spec=typed) if isinstance(spec, NamedSharding) else typed


def _checked(fun: Any, axes: Any, argnums: Any, has_aux: Any, reduction: Any) -> dict:
    """The arguments of `unreduced_grad` and `unreduced_value_and_grad`, checked, as
    the keyword arguments of `_per_shard.value_and_grad`."""
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {fun!r} ({type(fun).__name__})")
    names = _per_shard.axis_names("axes", axes)
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"argnums must be an int, got {argnums!r} ({type(argnums).__name__})")
    has_aux = _checks.require_bool("has_aux", has_aux)
    mean = _checks.canonical_reduction(reduction) == "mean"
    return {"fun": fun, "names": names, "argnums": argnums, "has_aux": has_aux, "mean": mean}


__all__ = ["as_reduced", "keep_reduction_axes", "unreduced_grad", "unreduced_value_and_grad"]
