"""Differentiating a loss on each device's shard of the batch (`jax.shard_map`), with the
gradients left unreduced over the deferred batch axes: the machinery behind
`optax_accum.unreduced_grad` and `unreduced_value_and_grad`.

The arguments of the loss are split in three: the params (argument `argnums`: each
device gathers them whole, and their gradients come back in their layout, typed
unreduced over the deferred axes), the other arrays (each device gets its block, read
from its type), and everything else (Python bools, ints, strings, None: passed to the
loss as they are, as `jax.grad` passes them, never traced).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _compat, _unreduced


def axis_names(name: str, axes: Any) -> frozenset:
    """`axes` (a mesh axis name or a sequence of them) as a non-empty set."""
    seq = tuple(axes) if isinstance(axes, list | tuple | set | frozenset) else (axes,)
    if not seq or any(not isinstance(a, Hashable) or isinstance(a, bool) for a in seq):
        raise TypeError(
            f"{name} must be a mesh axis name or a non-empty sequence of them, got {axes!r}"
        )
    return frozenset(seq)


def explicit_mesh() -> Any:
    """The current mesh (`jax.set_mesh`), checked to have only explicit axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        got = "no mesh" if mesh.empty else f"axis types {tuple(mesh.axis_types)}"
        raise ValueError(
            "unreduced_grad needs a mesh with explicit axes set with jax.set_mesh "
            f"(jax.make_mesh's default from jax 0.10), got {got}"
        )
    return mesh


def is_array(x: Any) -> bool:
    """Whether `x` is data the loss gets per device (a JAX or NumPy array, or a tracer),
    rather than a Python value it gets as it is."""
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def spec_names(spec: P) -> set:
    """The mesh axes a partition spec shards over."""
    names = set()
    for entry in spec:
        if entry is not None:
            names |= set(entry) if isinstance(entry, tuple) else {entry}
    return names


def layout(x: Any) -> P:
    """The partition spec of `x`'s type, without reduced or unreduced axes."""
    sharding = _compat.explicit_sharding(_aval(x))
    if sharding is None:
        return P()
    return P(*getattr(sharding.spec, "partitions", sharding.spec))


def check_param_axes(path: Any, x: Any, names: frozenset) -> None:
    """Raises unless the param `x` has explicit sharding and is not sharded over `names`."""
    if _compat.explicit_sharding(_aval(x)) is None:
        raise ValueError(
            f"params{jax.tree_util.keystr(path)} must be on a mesh with explicit axes (under "
            f"jax.set_mesh, or placed with a NamedSharding), got {_type_name(x)}"
        )
    shared = spec_names(layout(x)) & names
    if shared:
        raise ValueError(
            f"params{jax.tree_util.keystr(path)} must not be sharded over the batch axes "
            f"{sorted(shared)} whose sum is deferred, got {_type_name(x)}"
        )


def _aval(x: Any) -> Any:
    """`x`'s abstract value; a `jax.ShapeDtypeStruct` is its own."""
    return x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)


def _type_name(x: Any) -> str:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{x.dtype}{list(x.shape)} with sharding {x.sharding}"
    return str(jax.typeof(x))


def value_and_grad(
    *,
    fun: Callable[..., Any],
    names: frozenset,
    argnums: int,
    has_aux: bool,
    mean: bool,
    with_value: bool,
) -> Callable[..., Any]:
    """The function `unreduced_grad` (`with_value=False`) or `unreduced_value_and_grad`
    (`with_value=True`) returns; the arguments are checked by the caller."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _compat.require_sum_types()
        if not -len(args) <= argnums < len(args):
            raise ValueError(f"argnums={argnums} names no argument of the {len(args)} given")
        index = argnums % len(args)
        mesh = explicit_mesh()
        missing = names - set(mesh.axis_names)
        if missing:
            raise ValueError(
                f"axes must name axes of the mesh {mesh.axis_names}, got {sorted(missing)}"
            )
        params = args[index]
        jax.tree_util.tree_map_with_path(lambda path, x: check_param_axes(path, x, names), params)
        param_leaves, param_def = jax.tree.flatten(_unreduced.plain(params))  # free
        rest = _Rest((*args[:index], *args[index + 1 :]), kwargs)
        param_specs = tuple(layout(x) for x in param_leaves)
        batch_axes = rest.batch_axes()
        if names - batch_axes:
            raise ValueError(
                "axes must be mesh axes the batch is split over, got "
                f"{sorted(names - batch_axes)}: the array arguments other than the params "
                f"are split over {sorted(batch_axes)}. If fun reads the batch from a closure, "
                "pass it as an argument instead"
            )
        order = tuple(a for a in mesh.axis_names if a in batch_axes)
        shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
        scale = 1.0 / shards if mean else 1.0

        def local_loss(whole: list, local: tuple) -> tuple[Any, Any]:
            call_args, call_kwargs = rest.rebuild(local)
            call_args.insert(index, param_def.unflatten(whole))
            out = fun(*call_args, **call_kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss * scale, aux

        def per_device(local_params: tuple, local: tuple) -> tuple:
            whole = [_gathered(x, s) for x, s in zip(local_params, param_specs, strict=True)]
            whole = _compat.pcast_varying(whole, order)
            (loss, aux), grads = jax.value_and_grad(local_loss, has_aux=True)(whole, local)
            out = [
                tuple(
                    _to_shard(g, s, batch_axes, names)
                    for g, s in zip(grads, param_specs, strict=True)
                )
            ]
            if with_value:
                out.append(_as_unreduced(loss, order))
            if has_aux:
                out.append(jax.tree.map(lambda a: _as_unreduced(_aux_share(a, scale), order), aux))
            return tuple(out)

        summed = P(unreduced=frozenset(batch_axes))
        out_specs = (tuple(P(*s, unreduced=names) for s in param_specs),)
        out_specs += (summed,) * (with_value + has_aux)
        mapped = jax.shard_map(
            per_device, mesh=mesh, in_specs=(param_specs, rest.specs), out_specs=out_specs
        )
        grads, *extra = _without_closed_batch(mapped, tuple(param_leaves), rest.arrays)
        grads = param_def.unflatten(grads)
        if with_value:
            value = tuple(extra) if has_aux else extra[0]
            return value, grads
        return (grads, extra[0]) if has_aux else grads

    return run


class _Rest:
    """The arguments other than the params: arrays (each device gets its block) and
    Python values (passed to the loss as they are)."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        leaves, self.treedef = jax.tree.flatten((args, kwargs))
        self.is_array = [is_array(x) for x in leaves]
        self.arrays = tuple(x for x, a in zip(leaves, self.is_array, strict=True) if a)
        self.values = [x for x, a in zip(leaves, self.is_array, strict=True) if not a]
        self.specs = tuple(layout(x) for x in self.arrays)

    def batch_axes(self) -> set:
        """The mesh axes the array arguments are split over."""
        return set().union(*(spec_names(s) for s in self.specs))

    def rebuild(self, local: tuple) -> tuple[list, dict]:
        """The arguments and keyword arguments, with each array replaced by its block."""
        arrays, values = iter(local), iter(self.values)
        leaves = [next(arrays) if a else next(values) for a in self.is_array]
        args, kwargs = self.treedef.unflatten(leaves)
        return list(args), kwargs


def _without_closed_batch(mapped: Callable, *args: Any) -> Any:
    """`mapped(*args)`, with JAX's error for a loss that closes over arrays sharded on
    explicit mesh axes made one that says what to do."""
    try:
        return mapped(*args)
    except NotImplementedError as e:
        if "Closing over inputs to shard_map" not in str(e):
            raise
        raise ValueError(
            "fun must take the arrays it reads as arguments: it closes over an array "
            "sharded over the mesh (the batch, say), which unreduced_grad cannot split "
            "per device. Pass it as an argument, e.g. unreduced_grad(lambda params, batch: "
            "loss(params, batch), axes)(params, batch), instead of closing over batch"
        ) from e


def _aux_share(x: Any, scale: float) -> jax.Array:
    """One device's share of an aux value: a float scaled as the loss is (the shares
    add up to the mean over the batch shards, or the sum), an integer as it is (counts
    add up)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return x * scale if scale != 1.0 else x
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x
    raise TypeError(
        f"aux values must be floats (combined over the batch shards as the loss is) or "
        f"integers (summed), got {x.dtype}: compute a float (e.g. jnp.mean(flags)) in fun"
    )


def _as_unreduced(x: jax.Array, order: tuple) -> jax.Array:
    """A per-device value typed unreduced over the batch axes `order`: the true value is
    the sum of the devices' shares, and nothing has moved."""
    x = _compat.make_varying(x, frozenset(order))
    return lax.pcast(x, order, to="unreduced")


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
