"""Checkpoints of params typed reduced and of the unreduced sums made from them.

On the one-reduction path (`as_reduced`), params are typed reduced over the batch's
mesh axes and every accumulator keeps its running sum typed unreduced over them (each
device a partial sum; the true value is their sum). On jax 0.10.2 neither saves as it
is: Orbax reads a sharding's partition spec as a tuple, which a spec with reduced or
unreduced axes refuses (`ValueError: Using *pspec is dangerous ...`), and an unreduced
array has no host value (`NotImplementedError: device_indices_map doesn't work with
unreduced`, from Orbax, `flax.serialization` and `np.asarray` alike).

`to_checkpoint` gives the tree as a checkpoint holds it, every leaf plain: a reduced
leaf is its own buffers retyped (no data moves, no copy), an unreduced one its true
value, summed once (an all-reduce of each leaf's shard, all in one compiled program,
which XLA may fuse into one all-reduce; at save time only). `from_checkpoint` types
each saved leaf as the leaf of a fresh state: reduced
again (no data moves), or unreduced with the whole sum on one device of each group
along the unreduced axes and zeros on the others, which is exact (the sum over the
devices is the saved value, bit for bit). A restored run then equals the run that was
never stopped up to the rounding of one sum: the window's all-reduce adds the same
gradients in another order. A running max (min) kept per device (a "max" leaf on a
param typed reduced, `_extrema`) is saved as the max (min) over its devices and
restored whole on every device, whose max is the saved value exactly. A tree with no
reduced or unreduced leaf comes back as it is, so the two calls cost nothing on one
device, under `jax.shard_map` or `jax.pmap`, and on a mesh with plain types.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _compat, _extrema, _row_buffer, _unreduced


def to_checkpoint(tree: Any) -> Any:
    """`tree` as a checkpoint holds it: every leaf typed plain, ready for Orbax's
    `StandardSave` or `flax.serialization.to_state_dict` / `to_bytes`.

    A leaf typed reduced over mesh axes (params from `as_reduced`) comes back as its
    own buffers typed plain: each device already holds the whole value, so no data
    moves and nothing is copied. A leaf typed unreduced (the running sums of a state
    made from such params) comes back as its true value, the sum of the devices'
    partial sums: one all-reduce of one shard of the leaf, all leaves in one compiled
    program, at save time only; the running max (min) of a "max" ("min") leaf kept
    per device, the max (min) over the devices. Every other leaf is the same object, and a tree with
    no reduced or unreduced leaf is returned itself: on one device, under
    `jax.shard_map` or `jax.pmap`, and on a mesh with plain types, this is a no-op.

    Given abstract values (`jax.ShapeDtypeStruct`, e.g. `jax.eval_shape(tx.init,
    params)`), it returns the abstract values of what it would save, with concrete
    shardings: the target to pass to Orbax's `StandardRestore`. A sharding on an
    abstract mesh (what `jax.eval_shape` gives) takes the mesh set with `jax.set_mesh`
    (a plain leaf whose abstract mesh no set mesh matches is left as it is).

    Works on any pytree (a state, params, a dict of both, a Flax `TrainState`); it
    reads each leaf's type, never a field's name. A leaf saved in place shares its
    buffers with the param: hand the result to the checkpointer before a step that
    donates the params (Orbax's `save` has copied it to the host when it returns).

    Args:
      tree: a pytree of arrays (or of `jax.ShapeDtypeStruct` values).

    Returns:
      A pytree of the same structure, each array leaf typed plain, with its layout
      (an FSDP shard stays a shard).

    Raises:
      ValueError: for an abstract leaf typed reduced or unreduced whose sharding lies
        on an abstract mesh when no mesh with the same axes is set with `jax.set_mesh`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), num_required=2)
      >>> loss = lambda p, x: jnp.sum(x @ p["w"])
      >>> with jax.set_mesh(mesh):
      ...     params = optax_accum.as_reduced({"w": jnp.zeros((3, 2))}, "data")
      ...     state = tx.init(params)
      ...     x = jax.reshard(jnp.ones((8, 3)), P("data"))  # a batch of 8, one per device
      ...     updates, state = jax.jit(tx.update)(jax.grad(loss)(params, x), state, params)
      ...     saved = optax_accum.to_checkpoint({"params": params, "opt_state": state})
      >>> jax.typeof(state.storage["w"]), jax.typeof(saved["opt_state"].storage["w"])
      (ShapedArray(float32[3,2]{U:data}), ShapedArray(float32[3,2]))
      >>> saved["opt_state"].storage["w"].tolist()  # the 8 devices' partial sums, summed
      [[8.0, 8.0], [8.0, 8.0], [8.0, 8.0]]
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, kinds = [x for _, x in flat], _extrema.leaf_kinds(tree)
    ways = [_way_saved(x, kind) for x, kind in zip(leaves, kinds, strict=True)]
    if not any(ways):
        return tree  # nothing to retype: the tree itself
    out = list(leaves)
    for i, ((path, x), way) in enumerate(zip(flat, ways, strict=True)):
        if way == "abstract":
            out[i] = _plain_struct(f"tree{jax.tree_util.keystr(path)}", x)
        elif way == "in place":
            out[i] = _retyped_in_place(x, frozenset(), frozenset())
    summed = [i for i, way in enumerate(ways) if way == "summed"]
    if summed:
        for i, x in zip(summed, _plain_program([leaves[i] for i in summed]), strict=True):
            out[i] = x
    extreme = [i for i, way in enumerate(ways) if way == "extreme"]
    if extreme:
        how = tuple(kinds[i] for i in extreme)
        for i, x in zip(extreme, _extreme_program([leaves[i] for i in extreme], how), strict=True):
            out[i] = x
    return treedef.unflatten(out)


def _way_saved(x: Any, kind: str | None) -> str | None:
    """How `to_checkpoint` types a leaf plain: "abstract" (a `jax.ShapeDtypeStruct`),
    "in place" (reduced: the same buffers), "summed" (unreduced partial sums, or a
    traced leaf typed either way: in one program), "extreme" (a running max or min
    kept per device, `kind`: its max or min over them), or None (as it is)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return "abstract"
    if not isinstance(x, jax.Array):
        return None
    reduced, unreduced = _compat.sum_types(x)
    if unreduced and kind:
        return "extreme"
    if unreduced or (reduced and isinstance(x, jax.core.Tracer)):
        return "summed"
    return "in place" if reduced else None


def from_checkpoint(saved: Any, like: Any) -> Any:
    """`saved` (what `to_checkpoint` gave, restored) typed and placed as `like`.

    `like` is a fresh state of the same transform and params (`tx.init(params)`, or
    `jax.eval_shape` of it under `jax.set_mesh`), or any tree `to_checkpoint` was
    given. Each leaf of the result has the `jax.typeof` of `like`'s leaf:

    - typed reduced in `like`: the saved value placed whole on every device and typed
      reduced (no data moves);
    - typed unreduced in `like`: the saved value (a true sum) on one device of each
      group along the unreduced axes and zeros on the others, so that the sum over
      the devices is the saved value exactly; a running max (min) of a "max" ("min")
      leaf, whole on every device, so that their max (min) is;
    - otherwise: the saved leaf itself when it already has `like`'s sharding (what
      Orbax restores), else placed with it (the NumPy arrays of
      `flax.serialization.from_bytes`); where `like`'s leaf has no sharding, a NumPy
      leaf becomes an array as `jnp.asarray` makes it (on the mesh set with
      `jax.set_mesh`, if any).

    Call it outside `jax.jit`. A tree with no reduced or unreduced leaf, restored by
    Orbax into `like`'s shardings, comes back as it is.

    Args:
      saved: a pytree with `like`'s structure, of arrays (jax or NumPy).
      like: the pytree to take the types from: arrays or `jax.ShapeDtypeStruct`
        values with shardings.

    Returns:
      `saved`, with `like`'s structure, each leaf typed and placed as `like`'s.

    Raises:
      ValueError: when `saved`'s structure, or a leaf's shape or dtype, differs from
        `like`'s (a checkpoint of another transform or other params), a saved leaf
        is typed reduced or unreduced otherwise than `like`'s, or a leaf of `like`
        typed reduced or unreduced lies on an abstract mesh and no mesh with its axes
        is set.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), num_required=2)
      >>> with jax.set_mesh(mesh):
      ...     params = optax_accum.as_reduced({"w": jnp.zeros((3, 2))}, "data")
      ...     like = tx.init(params)  # a fresh state: the types to restore into
      ...     saved = like._replace(storage={"w": jnp.full((3, 2), 8.0, jnp.float32)})
      ...     state = optax_accum.from_checkpoint(saved, like)
      >>> jax.typeof(state.storage["w"])
      ShapedArray(float32[3,2]{U:data})
      >>> [float(s.data[0, 0]) for s in state.storage["w"].addressable_shards]
      [8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    try:
        saved_leaves = treedef.flatten_up_to(saved)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "saved must have like's structure (restore into the shapes of the same "
            f"transform's init on the same params): {e}"
        ) from None
    out, pending, kinds = [], [], _extrema.leaf_kinds(like)
    for (path, want), x, kind in zip(flat, saved_leaves, kinds, strict=True):
        value, types = _restored(jax.tree_util.keystr(path), x, want)
        if types is not None and kind is not None:  # a max (min): whole on every device
            whole = {"reduced": frozenset(), "unreduced": types[1], "like": value}
            value, types = _unreduced.reinterpreted(value, **whole), None
        if types is not None:
            pending.append((len(out), types))
        out.append(value)
    if pending:
        typed = _retype_program([out[i] for i, _ in pending], tuple(t for _, t in pending))
        for (i, _), x in zip(pending, typed, strict=True):
            out[i] = x
    return treedef.unflatten(out)


# The state fields renamed since a release, by their names today: what a checkpoint of
# that release holds under the old name.
_RENAMED = {"storage": ("accumulator",)}  # 0.1.0: `accumulator`, the running sum's buffers


def upgrade_checkpoint(saved: Any, like: Any) -> Any:
    """A checkpoint written by an earlier release of optax_accum, in today's structure.

    Restore the checkpoint without a target (Orbax's `StandardCheckpointer().restore(
    path)`, or `flax.serialization.msgpack_restore(data)`): it comes back as nested
    dicts (and lists) keyed by the names it was saved under. This reads it into the
    structure of `like`, a fresh state of the same transform and params (or any tree
    holding one, e.g. `{"params": ..., "opt_state": ...}`), by name: a field renamed
    since (0.1.0's `accumulator`, today's `storage`) is read under its old name. Each
    leaf is then typed and placed as `like`'s leaf, as `from_checkpoint` does. A
    sparse leaf's row buffer from 0.1.0 (found its rows through `slot_of`) gets
    today's `order`, its slots in order of their rows, made from its rows.

    Args:
      saved: the restored tree, of dicts, lists and arrays (jax or NumPy).
      like: the tree to read it into.

    Returns:
      `saved`, with `like`'s structure, each leaf typed and placed as `like`'s.

    Raises:
      ValueError: when `saved` lacks a field `like` has (under any of its names), or a
        leaf's shape or dtype differs from `like`'s.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, optax_accum
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> like = tx.init(jnp.zeros(2))
      >>> saved = {name: np.int32(0) for name in ("global_step", "num_dropped",
      ...     "num_nonfinite", "num_skipped")}  # a state written by optax_accum 0.1.0
      >>> saved.update(count=np.int32(1), weight_sum=np.float32(1), emitted=np.False_,
      ...     accumulator=np.array([3.0, 4.0], np.float32), inner_state=[{}, {}])
      >>> state = optax_accum.upgrade_checkpoint(saved, like)
      >>> optax_accum.accumulated(state), int(optax_accum.num_accumulated(state))
      (Array([3., 4.], dtype=float32), 1)
    """
    return from_checkpoint(_by_name("", saved, like), like)


def _by_name(path: str, saved: Any, like: Any) -> Any:
    """`saved` in `like`'s structure, children found by name (or position)."""
    if isinstance(like, _row_buffer.RowBuffer):  # 0.1.0's held a map of table rows
        saved = _row_buffer.upgraded(saved)
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a NamedTuple: by field
        return type(like)(
            *(
                _by_name(f"{path}.{f}", _field(path, saved, f, _RENAMED.get(f, ())), v)
                for f, v in zip(like._fields, like, strict=True)
            )
        )
    if isinstance(like, dict):
        return type(like)(
            (k, _by_name(f"{path}[{k!r}]", _field(path, saved, k, ()), v)) for k, v in like.items()
        )
    if isinstance(like, list | tuple):
        return type(like)(
            _by_name(f"{path}[{i}]", _field(path, saved, i, ()), v) for i, v in enumerate(like)
        )
    if like is None or not jax.tree.leaves(like):
        return like
    if jax.tree.structure(like).num_nodes > 1:  # a registered node: flatten it as `like`
        leaves = jax.tree.leaves(saved) if not isinstance(saved, dict) else list(saved.values())
        return jax.tree.unflatten(jax.tree.structure(like), leaves)
    return saved


def _field(path: str, saved: Any, key: Any, old: tuple) -> Any:
    """`saved`'s child `key` (a field, a dict key or a position; flax keys positions as
    strings), or under one of its `old` names."""
    for name in (key, *old):
        if isinstance(saved, dict):
            for k in (name, str(name)):
                if k in saved:
                    return saved[k]
        elif isinstance(saved, list | tuple) and isinstance(name, int) and name < len(saved):
            return saved[name]
        elif hasattr(saved, str(name)):
            return getattr(saved, str(name))
    raise ValueError(f"the checkpoint holds no {path or 'tree'}[{key!r}] (nor {list(old)})")


# --------------------------------------------------------------------------- helpers


def _plain_leaves(leaves: list) -> list:
    """Each leaf typed plain: an unreduced one summed over its unreduced axes (the
    all-reduce), a reduced one retyped (free)."""
    return [_compat.retyped(x) for x in leaves]


def _retype_leaves(leaves: list, types: tuple) -> list:
    """Each plain leaf typed `(reduced, unreduced)`: unreduced keeps the value on one
    device of each group along those axes and zeros on the others."""
    return [
        _compat.retyped(x, reduced=r, unreduced=u) for x, (r, u) in zip(leaves, types, strict=True)
    ]


_plain_program = jax.jit(_plain_leaves)
_extreme_program = jax.jit(_extrema.across_devices, static_argnums=1)
_retype_program = jax.jit(_retype_leaves, static_argnums=1)


def _plain_sharding(sharding: NamedSharding) -> NamedSharding:
    """`sharding` without reduced or unreduced axes: the same layout, typed plain."""
    return NamedSharding(sharding.mesh, P(*sharding.spec.partitions))


def _retyped_in_place(x: jax.Array, reduced: frozenset, unreduced: frozenset) -> jax.Array:
    """`x`, a value whole on every device along the axes that change (plain or reduced),
    typed otherwise over the same buffers: no data moves, nothing is copied."""
    layout = P(*x.sharding.spec.partitions, reduced=reduced, unreduced=unreduced)
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(x.sharding.mesh, layout), [s.data for s in x.addressable_shards]
    )


def _restored(path: str, saved: Any, like: Any) -> tuple[Any, tuple | None]:
    """A saved leaf placed as `like`'s, and the `(reduced, unreduced)` axes it is still
    to be typed with (None when it is done): a leaf typed unreduced is made in one
    program with the others."""
    _check_leaf(path, saved, like)
    sharding = _sharding_of(f"like{path}", like)
    if isinstance(saved, jax.Array) and any(_compat.sum_types(saved)):
        if saved.sharding == sharding:
            return saved, None  # already as like's (the tree to_checkpoint was given)
        raise ValueError(
            f"saved{path} must be typed plain, as to_checkpoint gives it, got "
            f"{jax.typeof(saved)}: pass what to_checkpoint returned, or a restore of it"
        )
    if sharding is None:  # one device, or an abstract leaf given no sharding
        return (jnp.asarray(saved) if isinstance(saved, np.ndarray) else saved), None
    reduced, unreduced = _compat.sum_types(like)
    if not (reduced or unreduced):
        return _placed(saved, sharding), None
    plain = _placed(saved, _plain_sharding(sharding))
    if unreduced:
        return plain, (reduced, unreduced)
    return _retyped_in_place(plain, reduced, frozenset()), None


def _placed(x: Any, sharding: Any) -> jax.Array:
    """`x` with `sharding`: itself when it has it already."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _plain_struct(name: str, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """An abstract leaf as `to_checkpoint` would save it, on a concrete mesh."""
    sharding = _sharding_of(name, x)
    if isinstance(sharding, NamedSharding):
        sharding = _plain_sharding(sharding)
    if sharding is None or sharding == x.sharding:
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def _sharding_of(name: str, x: Any) -> Any:
    """`x`'s sharding, on the mesh set with `jax.set_mesh` when it names an abstract one
    (None for a plain leaf whose abstract mesh no set mesh matches: left as it is)."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return sharding
    concrete = _compat.concrete_mesh()
    if concrete is not None and concrete.abstract_mesh == mesh:
        return NamedSharding(concrete, sharding.spec)
    if not any(_compat.sum_types(x)):
        return None
    raise ValueError(
        f"{name} must have a sharding on a concrete mesh, or on the abstract mesh of the "
        f"mesh set with jax.set_mesh, got {jax.typeof(x)} on {mesh} with "
        f"{'no mesh set' if concrete is None else f'{concrete} set'}: call this under "
        "jax.set_mesh(mesh), with the mesh the state lives on"
    )


def _check_leaf(path: str, saved: Any, like: Any) -> None:
    if not (hasattr(like, "shape") and hasattr(like, "dtype")):
        return  # a Python value in the tree (a Flax TrainState's step): taken as saved
    shape, dtype = np.shape(saved), getattr(saved, "dtype", None)
    dtype = np.asarray(saved).dtype if dtype is None else dtype
    if shape != tuple(like.shape) or np.dtype(dtype) != np.dtype(like.dtype):
        raise ValueError(
            f"saved{path} must have like{path}'s shape and dtype {like.dtype}{list(like.shape)}, "
            f"got {dtype}{list(shape)}: restore the checkpoint of the same transform on "
            "the same params"
        )


__all__ = ["from_checkpoint", "to_checkpoint", "upgrade_checkpoint"]
