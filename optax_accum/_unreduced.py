"""Unreduced running sums: one reduction per window under `jax.jit` on a mesh.

Under explicit sharding (jax >= 0.10), a parameter typed reduced over mesh axes A
(`jax.reshard(p, P(*spec, reduced=A))`: a full copy on every device, as a replicated
one is) gets its gradient from `jax.grad` typed unreduced over A (`{U:A}`): each
device holds the partial sum of its own batch shard and no all-reduce has run. An
accumulator keeps that leaf's running sum unreduced over A too, so a held step adds
locally and moves nothing; the release reduces the window's sum once (a reshard to the
plain type, which is the all-reduce), inside its branch.

The optimizer after the release sees plain values only: its state is made from the
params typed plain (`plain`), and it is given the reduced sum and the params typed
plain. Reduced values would break it (JAX has no reduced rule for `integer_pow`, which
Adam's second moment uses; a reduced value plus a plain one is a type error). Its
updates are then typed reduced over A again (`like_params`), which moves nothing, so
that `apply_updates(params, updates)` keeps the params' type and a donated step's
outputs match its inputs. Updates that leave the release branch in the sums' buffers
(the canonical step) are typed as the sums there (`in_sum_type`) and reduced after it
(`out_of_sum_type`): casts that move nothing either.

Without explicit sharding, or on a jax without these types, no leaf is reduced and
every function here returns its input.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_accum import _compat


def unreduced_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` (an array or abstract value) holds partial sums."""
    return _compat.sum_types(x)[1]


def sum_zeros(param: Any, dtype: Any) -> jax.Array:
    """Zeros like `param` in `dtype`, typed unreduced over the axes `param` is reduced
    over: the running sum of the gradients `jax.grad` gives for it."""
    zeros = jnp.zeros_like(param, dtype=dtype)
    reduced, _ = _compat.sum_types(param)
    if not reduced:
        return zeros
    return _compat.retyped(zeros, unreduced=reduced, like=param)


def zeros_like(x: jax.Array) -> jax.Array:
    """`jnp.zeros_like(x)`, also for an unreduced `x` outside jit (where JAX cannot
    build unreduced zeros directly: they are built plain, then typed unreduced)."""
    axes = unreduced_axes(x)
    if not axes or isinstance(x, jax.core.Tracer):
        return jnp.zeros_like(x)
    layout = jax.sharding.PartitionSpec(*x.sharding.spec.partitions)
    zeros = jnp.zeros(x.shape, x.dtype, out_sharding=x.sharding.update(spec=layout))
    return _compat.retyped(zeros, unreduced=axes)


def plain(tree: Any) -> Any:
    """`tree` with every leaf's reduced axes dropped: the params as the inner optimizer
    sees them (no data moves). A tree with no reduced leaf comes back as it is; None
    stays None."""
    if tree is None or not any(_compat.sum_types(x)[0] for x in jax.tree.leaves(tree)):
        return tree

    def drop(x: Any) -> Any:
        reduced, unreduced = _compat.sum_types(x)
        if not reduced:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):  # `init` on abstract params
            spec = jax.sharding.PartitionSpec(*x.sharding.spec.partitions, unreduced=unreduced)
            return x.update(sharding=x.sharding.update(spec=spec))
        return _compat.retyped(x, unreduced=unreduced)

    return jax.tree.map(drop, tree)


def reduced_sum(total: jax.Array) -> jax.Array:
    """A running sum reduced to the plain type: the one all-reduce of a window when it
    is unreduced, `total` itself otherwise."""
    if not unreduced_axes(total):
        return total
    return _compat.retyped(total, reduced=_compat.sum_types(total)[0])


def reduced_in_place(sums: list, released: jax.Array, *, nest: bool) -> tuple[list, list]:
    """Unreduced running sums all-reduced once, in a release's branch: `(left, totals)`,
    `totals` as `reduced_sum` gives them and `left` what the sums' buffers hold after.

    With `nest`, the all-reduces run inside a conditional of their own on `released`
    (True wherever this runs) whose other branch returns the sums. A conditional's
    outputs share its operands' buffers, so on TPU each all-reduce writes into its own
    sum's buffer and the release keeps no all-reduce output of its own: `left` is the
    totals typed as the sums, `totals` the same buffers cast to `reduced_sum`'s type
    (nothing moves). Without `nest`, `left` is the sums and each total a new array
    (docs/design.md, "The release's all-reduces on TPU").
    """
    if not nest:
        return list(sums), [reduced_sum(s) for s in sums]
    left = lax.cond(
        released,
        lambda held: [in_sum_type(reduced_sum(s), s) for s in held],
        lambda held: list(held),
        list(sums),
    )
    totals = [
        reinterpreted(c, reduced=_compat.sum_types(s)[0], unreduced=frozenset(), like=c)
        for c, s in zip(left, sums, strict=True)
    ]
    return left, totals


def like_params(updates: Any, sums: Any) -> Any:
    """`updates` typed reduced over the axes each leaf's running sum (in `sums`, same
    structure) is unreduced over, as its parameter is: a cast that moves nothing.
    Leaves of sums that are not unreduced come back as they are (the same objects)."""
    return jax.tree.map(
        lambda u, s: u if not unreduced_axes(s) else _compat.retyped(u, reduced=unreduced_axes(s)),
        updates,
        sums,
    )


def by_device(fn: Any, args: tuple, in_specs: Any, out_specs: Any, like: jax.Array) -> Any:
    """`fn` on each device's own blocks of `args`: a `jax.shard_map` over `like`'s whole
    mesh with its vma checks off, the one way jax 0.10 lets a program compute anything
    but a sum from values typed unreduced (it takes them in full manual mode only).
    Inside, each device's block is an untyped array; `out_specs` type the results.
    Eagerly, on the concrete mesh `like` is placed on."""
    mesh = _compat.explicit_sharding(jax.typeof(like)).mesh
    placed = None if isinstance(like, jax.core.Tracer) else getattr(like, "sharding", None)
    if isinstance(placed, jax.sharding.NamedSharding):
        mesh = placed.mesh
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(mesh.axis_names),
        check_vma=False,
    )(*args)


def reinterpreted(
    x: jax.Array, *, reduced: frozenset, unreduced: frozenset, like: jax.Array
) -> jax.Array:
    """`x`'s blocks, device by device, typed reduced over `reduced` and unreduced over
    `unreduced`, in `like`'s mesh and layout: a cast that moves nothing, whatever the
    types say about the blocks' meaning (JAX 0.10 has no such cast from unreduced, only
    the all-reduce): `by_device` of the identity."""
    layout = _compat.explicit_sharding(jax.typeof(like)).spec.partitions
    now = _compat.sum_types(x)
    spec = jax.sharding.PartitionSpec
    return by_device(
        lambda block: block,
        (x,),
        (spec(*layout, reduced=now[0], unreduced=now[1]),),
        spec(*layout, reduced=reduced, unreduced=unreduced),
        like,
    )


def in_sum_type(update: jax.Array, total: jax.Array) -> jax.Array:
    """A plain `update` typed as its running sum `total` (unreduced over its axes),
    every device's block holding the whole update, so that it can travel in the sum's
    buffer out of the release's branch (`_branch.release_if`); `update` itself when
    `total` is not unreduced.

    Typed so, the update is not the partial sums its type says: it must be read back
    with `out_of_sum_type` only (the all-reduce of a reshard would sum the copies).
    """
    axes = unreduced_axes(total)
    if not axes:
        return update
    return reinterpreted(update, reduced=frozenset(), unreduced=axes, like=total)


def out_of_sum_type(carried: jax.Array) -> jax.Array:
    """An update that travelled in its sum's buffer (`in_sum_type`), typed reduced over
    the axes it was unreduced over, as its param is: no data moves."""
    axes = unreduced_axes(carried)
    if not axes:
        return carried
    return reinterpreted(carried, reduced=axes, unreduced=frozenset(), like=carried)


def scalar_for(scalar: jax.Array, values: jax.Array) -> jax.Array:
    """A plain scalar typed to multiply `values`: reduced over the axes `values` is
    unreduced over (a partial sum times a common factor is a partial sum)."""
    axes = unreduced_axes(values)
    return scalar if not axes else _compat.retyped(scalar, reduced=axes, like=values)


def finite(x: jax.Array) -> jax.Array:
    """A scalar bool: whether `x` holds no NaN or Inf.

    For `x` typed unreduced, whose true value is the sum of the devices' partial sums,
    no elementwise test can run before the reduction; each device sums `0 * x` (0, or a
    NaN where its partial sum holds a NaN or Inf), and the scalars are reduced: one
    scalar all-reduce. A partial sum that holds a NaN or Inf makes the true sum hold
    one too; finite partial sums whose total overflows are not caught.
    """
    axes = unreduced_axes(x)
    if not axes:
        return jnp.isfinite(x).all()
    zeros = x * scalar_for(jnp.zeros((), x.dtype), x)
    return jnp.isfinite(reduced_sum(jnp.sum(zeros)))


def check_sum_types(gradients: Any, sums: Any, *, what: str = "updates") -> None:
    """Raises a clear error where a gradient's unreduced axes differ from its running
    sum's (the state was made from params typed otherwise than those differentiated).

    Raises:
      TypeError: naming the leaf, the type that came and the one expected.
    """
    for (path, g), s in zip(
        jax.tree_util.tree_flatten_with_path(gradients)[0], jax.tree.leaves(sums), strict=True
    ):
        got, want = unreduced_axes(g), unreduced_axes(s)
        if got != want:
            stripped = (
                ""
                if want
                else ". If the state was placed with partition specs (jax.jit's "
                "out_shardings or in_shardings, say from partition rules), they dropped the "
                "sum's type: take them from optax_accum.state_shardings(tx, params), or pass "
                "the rules' specs through optax_accum.keep_reduction_axes(specs, "
                "jax.eval_shape(init))"
            )
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} must be typed unreduced over "
                f"{sorted(want)}, as the running sum that tx.init made from its param is, "
                f"got {jax.typeof(g)}. Make the state from the params you differentiate: a "
                "param typed reduced over mesh axes (jax.reshard(p, P(..., reduced=axes))) "
                f"gets a sum unreduced over them, a plain param a plain sum{stripped}"
            )


__all__ = [
    "by_device",
    "check_sum_types",
    "finite",
    "in_sum_type",
    "like_params",
    "out_of_sum_type",
    "plain",
    "reduced_sum",
    "reinterpreted",
    "scalar_for",
    "sum_zeros",
    "unreduced_axes",
    "zeros_like",
]
