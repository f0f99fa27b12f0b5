"""Meshes and partition specs for running optax_accum transforms under `jax.shard_map`.

Two helpers for data-parallel training with `jax.shard_map`:
`replica_group_mesh` lays devices out so that replica subgroups become a mesh axis
(the fast path for `cross_shard(group_assignment=...)` on a pod), and
`state_partition_specs` works out which leaves of a transform's state differ between
replicas, so users need not write the state's partition specs by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from optax_accum import _checks, _collectives, _compat


def replica_group_mesh(
    group_assignment: Any,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_names: tuple[str, str] = ("group", "replica"),
) -> Mesh:
    """A 2-D device mesh whose inner axis is a replica group of `group_assignment`.

    Row g of the mesh holds the devices `devices[r]` for the replica ids r of group g,
    in order, so position (g, j) is replica `group_assignment[g][j]`. Under
    `jax.shard_map` over this mesh, `cross_shard(axis_names[1])` reduces within each
    group with one plain all-reduce per leaf (XLA replica groups), instead of the
    permutes or the larger buffer that a `group_assignment` on a 1-D axis costs: the
    fast path on a pod, when the devices may be laid out this way.

    To feed replica r the data it gets in the 1-D program, order the batch's leading
    (replica) axis by `np.ravel(group_assignment)` before sharding it over
    `P(axis_names)` (see the example).

    TF counterpart: none; TF on a TPU passes `group_assignment` to its collectives,
    as `cross_shard(group_assignment=...)` does.

    Args:
      group_assignment: a valid group assignment (see `cross_shard`), covering all
        of `devices`.
      devices: the devices, indexed by replica id. Default: `jax.devices()` (all
        processes' devices, in id order).
      axis_names: the names of the (group, replica) mesh axes.

    Returns:
      A `jax.sharding.Mesh` of shape (num_groups, group_size), with `Auto` axes.

    Raises:
      ValueError: for a malformed or empty `group_assignment`, or one that does not
        cover exactly the devices.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> groups = [[0, 3, 5, 6], [1, 2, 4, 7]]
      >>> mesh = optax_accum.replica_group_mesh(groups)
      >>> dict(mesh.shape)
      {'group': 2, 'replica': 4}
      >>> tx = optax_accum.cross_shard("replica", reduction="sum")
      >>> step = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                      in_specs=P(("group", "replica")), out_specs=P(("group", "replica")))
      >>> order = np.ravel(groups)  # replica r's gradient is r
      >>> out = step(jnp.arange(8.0)[order])
      >>> out[np.argsort(order)]  # back in replica order: 0+3+5+6 and 1+2+4+7
      Array([14., 14., 14., 14., 14., 14., 14., 14.], dtype=float32)
    """
    groups = _collectives.validate_group_assignment(group_assignment)
    if groups is None:
        raise ValueError(
            f"group_assignment must be a non-empty list of list, got {group_assignment!r}"
        )
    devices = list(jax.devices() if devices is None else devices)
    total = sum(len(g) for g in groups)
    if total != len(devices):
        raise ValueError(
            f"group_assignment must be a permutation of range({len(devices)}) (the number "
            f"of devices), got the {total} replica ids of {[list(g) for g in groups]}"
        )
    if len(axis_names) != 2 or len(set(axis_names)) != 2:
        raise ValueError(f"axis_names must be two distinct names, got {axis_names!r}")
    grid = np.empty((len(groups), len(groups[0])), dtype=object)
    for gi, g in enumerate(groups):
        for j, r in enumerate(g):
            grid[gi, j] = devices[r]
    return Mesh(grid, tuple(axis_names), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _how_to_shard(leaf: Any) -> str:
    """How to give `leaf` a NamedSharding: an abstract value takes it as an argument."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (
            "an abstract value takes it as an argument: jax.ShapeDtypeStruct(x.shape, "
            "x.dtype, sharding=NamedSharding(mesh, spec)), or jax.eval_shape of a jax.jit "
            "given out_shardings"
        )
    return "place it with jax.device_put(x, NamedSharding(mesh, spec))"


def state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
    """The sharding of every leaf of `tx.init(params)`, for params sharded on a mesh.

    Each state leaf that mirrors a parameter (an accumulator, the inner optimizer's
    moments, AGN's centre) gets that parameter's sharding, per-row state of an
    embedding table its rows' sharding, and counters, flags and row buffers are
    replicated. Pass the result as `out_shardings` to `jax.jit(tx.init)`, so that under
    auto sharding (classic GSPMD) the state is created in place, never whole on one
    device. Under explicit sharding (`jax.make_mesh`'s default from jax 0.10),
    `tx.init` already returns the state sharded this way.

    It works for every optax_accum transform and for any optax optimizer that builds
    its state with `zeros_like` (as optax's own do): `tx.init` is traced, not run,
    under an explicit-sharding copy of the params' mesh, where each array's type
    carries its sharding.

    The params may be what `jax.eval_shape` gives under `jax.set_mesh` on an explicit
    mesh (each `jax.ShapeDtypeStruct`'s sharding then lies on an abstract mesh, with no
    devices): the shardings come back on the mesh set with `jax.set_mesh` when it is
    that mesh, else on the abstract mesh, which `jax.jit`'s `out_shardings` take under
    `jax.set_mesh`. Params typed reduced (`as_reduced`, on arrays or abstract values)
    give the running sums' shardings typed unreduced.

    Args:
      tx: the transformation whose state is wanted.
      params: the params (arrays or `jax.ShapeDtypeStruct` values), each with a
        `NamedSharding` on one mesh (or on one abstract mesh).

    Returns:
      A tree of `NamedSharding` objects on the params' mesh (see above for an abstract
      one), shaped like the state.

    Raises:
      TypeError: when `tx` is not an optax transformation.
      ValueError: when a param has no `NamedSharding`, or the params lie on several
        meshes.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> params = {"w": jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P("fsdp")))}
      >>> tx = optax_accum.conditional_accumulator(optax.adam(1e-3), num_required=4)
      >>> shardings = optax_accum.state_shardings(tx, params)
      >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
      >>> state.storage["w"].addressable_shards[0].data.shape  # 2 of 16 rows a device
      (2, 4)
      >>> state.count.sharding.is_fully_replicated
      True
    """
    tx = _checks.require_transformation("tx", tx)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    meshes = set()
    for path, leaf in flat:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} must have a NamedSharding "
                f"({_how_to_shard(leaf)}), got {sharding!r}"
            )
        meshes.add(sharding.mesh)
    if len(meshes) != 1:
        raise ValueError(f"params must lie on one mesh, got {len(meshes)} meshes")
    (mesh,) = meshes
    explicit = _compat.with_explicit_axes(mesh)
    typed = treedef.unflatten(
        [
            jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.sharding.NamedSharding(explicit, x.sharding.spec)
            )
            for _, x in flat
        ]
    )
    with _compat.mesh_context(explicit):
        state = jax.eval_shape(tx.init, typed)

    placed = _compat.placing_mesh(mesh)

    def on_params_mesh(leaf: Any) -> jax.sharding.NamedSharding:
        sharding = _compat.explicit_sharding(leaf)
        spec = P() if sharding is None else sharding.spec
        return jax.sharding.NamedSharding(placed, spec)

    return jax.tree.map(on_params_mesh, state)


def _struct(tree: Any) -> Any:
    """ShapeDtypeStructs for a tree of arrays (or of ShapeDtypeStructs)."""
    return jax.eval_shape(lambda t: t, tree)


def _varying_after_update(
    tx: Any,
    params_s: Any,
    grads_s: Any,
    treedef: Any,
    varying: list[frozenset],
    mesh: Mesh,
    axes: tuple[frozenset, frozenset],
    extra_args: dict,
) -> list[frozenset]:
    """The mesh axes each state leaf varies over after one traced `update` under shard_map.

    State leaves enter varying over `varying`, gradients and params over `axes`,
    extra arguments replicated.
    """
    grad_axes, param_axes = axes
    seen: list[frozenset] = []

    def body(p: Any) -> jax.Array:
        state_leaves = jax.tree.leaves(tx.init(p))  # as users init: from replicated params
        p = jax.tree.map(lambda x: _compat.make_varying(x, param_axes), p)
        state = treedef.unflatten(
            [_compat.make_varying(x, v) for x, v in zip(state_leaves, varying, strict=True)]
        )
        g = jax.tree.map(
            lambda s: _compat.make_varying(jnp.zeros(s.shape, s.dtype), grad_axes), grads_s
        )
        _, new_state = tx.update(g, state, p, **extra_args)
        seen.extend(_compat.varying_axes(x) for x in jax.tree.leaves(new_state))
        return jnp.zeros(())

    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()), params_s)
    return seen


def state_partition_specs(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: Mesh,
    *,
    grads: Any = None,
    grad_axes: Sequence[str] | None = None,
    param_axes: Sequence[str] = (),
    **extra_args: Any,
) -> Any:
    """The `PartitionSpec` tree of `tx`'s state when `tx.update` runs under shard_map.

    Traces (never runs) `tx.init` and `tx.update` under `jax.shard_map` over `mesh`,
    with replicated params (unless `param_axes`), per-replica gradients (varying
    over `grad_axes`) and replicated extra arguments, and reads which state leaves come out varying
    (`jax.typeof(leaf).manual_axis_type.varying`). It repeats with those leaves
    varying on input until nothing changes. Leaves that differ between replicas get
    `P(axes)` (each replica's copy is stacked along dim 0 of the global array);
    replicated ones `P()`. For example, `conditional_accumulator(axis_name=...)`'s
    per-replica `accumulator` gets `P(axis)` and its counters `P()`, and
    `cross_shard_optimizer`'s whole state is `P()`.

    Use the specs as the state's `in_specs` and `out_specs`, and create the state with
    `jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)`.

    TF counterpart: none; TF1 placed optimizer variables with device scopes, and a TPU
    replica kept a copy of each.

    Args:
      tx: the transform, built with the mesh's axis names where it takes one.
      params: the (replicated) params, or matching `jax.ShapeDtypeStruct` values.
      mesh: the mesh `tx.update` will run under.
      grads: an example of one replica's gradients (arrays or ShapeDtypeStructs).
        Default: shaped like `params`.
      grad_axes: the mesh axes the gradients differ over. Default: all of them.
      param_axes: the mesh axes the params differ over (e.g. `agn`'s local params).
        Default: none, the params are replicated.
      **extra_args: example extra arguments for `update` (e.g. `local_step=0`),
        traced as replicated values.

    Returns:
      A pytree of `PartitionSpec` leaves with the structure of `tx.init(params)`.

    Raises:
      ValueError: when a scalar state leaf differs between replicas (a scalar cannot
        be split along dim 0; give the transform an `axis_name` so replicas agree),
        or `grad_axes` names an axis the mesh lacks.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 8, axis_name="data")
      >>> specs = optax_accum.state_partition_specs(tx, jnp.zeros(3), mesh)
      >>> tuple(specs.storage), tuple(specs.global_step)  # P("data"), P()
      (('data',), ())
    """
    _checks.require_transformation("tx", tx)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {mesh!r} ({type(mesh).__name__})")
    order = tuple(mesh.axis_names)
    axes = _mesh_axes("grad_axes", order if grad_axes is None else grad_axes, order)
    p_axes = _mesh_axes("param_axes", param_axes, order)
    params_s = _struct(params)
    grads_s = params_s if grads is None else _struct(grads)
    state_s = jax.eval_shape(tx.init, params_s)
    leaves, treedef = jax.tree.flatten(state_s)
    varying = [frozenset()] * len(leaves)

    while True:
        seen = _varying_after_update(
            tx, params_s, grads_s, treedef, varying, mesh, (axes, p_axes), extra_args
        )
        grown = [a | b for a, b in zip(varying, seen, strict=True)]
        if grown == varying:
            break
        varying = grown

    paths = [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state_s)[0]
    ]
    specs = [
        _spec(path, leaf, v, order) for path, leaf, v in zip(paths, leaves, varying, strict=True)
    ]
    return treedef.unflatten(specs)


def _mesh_axes(name: str, given: Sequence[str], order: tuple) -> frozenset:
    """`given` as a set, checked to name axes of the mesh (whose axes are `order`)."""
    axes = frozenset(given)
    if axes - set(order):
        raise ValueError(f"{name} must name axes of the mesh {order}, got {sorted(axes)}")
    return axes


def _spec(path: str, leaf: Any, varying: frozenset, order: tuple) -> P:
    """The spec of a state leaf that varies over the mesh axes `varying`."""
    if not varying:
        return P()
    if not leaf.shape:
        raise ValueError(
            f"state{path} is a scalar that differs between replicas over {sorted(varying)}, "
            "so it has no PartitionSpec; build the transform with axis_name set to those "
            "axes so that the replicas agree on it"
        )
    names = tuple(a for a in order if a in varying)
    return P(names[0] if len(names) == 1 else names)


__all__ = ["replica_group_mesh", "state_partition_specs", "state_shardings"]
