"""Cross-replica gradient averaging, optionally within replica subgroups.

TF1's `tf.tpu.CrossShardOptimizer` sums gradients across TPU shards (after scaling
the loss by 1/num_shards for MEAN) before the wrapped optimizer applies them.
`cross_shard` is that reduction as a chainable Optax transform over a named mapped
axis (`jax.pmap`, `jax.shard_map`, `jax.vmap`, or a multi-process mesh), and
`cross_shard_optimizer` chains it in front of an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import _checks, _collectives, _compat, _extra_args, _protocol


def _check_per_replica(where: str, leaf: Any, axis_name: Any) -> None:
    """Raises if shard_map typing says `leaf` is already the same on every replica.

    Under `jax.shard_map` (with its default `check_vma=True`), `jax.grad` with respect
    to replicated params returns the gradients already summed over the axis; averaging
    that again would silently return the sum. `pmap` and `vmap` do not track this, so
    nothing is checked there.
    """
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        tracked = name in _compat.varying_axes(lax.axis_index(name))
        if tracked and name not in _compat.varying_axes(leaf):
            raise ValueError(
                f"{where} must differ per replica of axis {name!r}, but under jax.shard_map "
                "it is replica-invariant, i.e. already reduced over the axis (jax.grad with "
                "respect to replicated params returns the sum over the axis; a shared "
                "accumulator's release is summed too). Differentiate with respect to "
                f"per-replica params, jax.lax.pcast(params, {name!r}, to='varying'), so "
                "each replica gets its own gradient"
            )


def _reject_unreduced(updates: Any) -> None:
    """A clear error for gradients typed unreduced (params typed reduced, under
    `jax.jit`): there the mesh reduces them, no axis is bound by name."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
        axes = _compat.sum_types(leaf)[1]
        if axes:
            raise TypeError(
                f"cross_shard cannot average updates{jax.tree_util.keystr(path)}, typed "
                f"unreduced over {sorted(axes)} ({jax.typeof(leaf)}: its param is typed "
                "reduced, under jax.jit): there the mesh axes are reduced by a reshard, "
                "not by name. Accumulate them instead (conditional_accumulator keeps the "
                "sum unreduced and reduces it once a window), reduce the gradients first "
                "(differentiate plain params), or run the step under jax.shard_map with "
                "per-replica gradients"
            )


# --------------------------------------------------------------------------- packing


def _packed(reduce_fn: Callable[[jax.Array], jax.Array], leaves: Sequence[jax.Array]) -> list:
    """Applies `reduce_fn` to one flat buffer per dtype instead of to every leaf."""
    out: list[Any] = list(leaves)
    by_dtype: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(jnp.result_type(leaf), []).append(i)
    for idx in by_dtype.values():
        flat = reduce_fn(jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]))
        offsets = np.cumsum([0] + [leaves[i].size for i in idx])
        for i, start, stop in zip(idx, offsets[:-1], offsets[1:], strict=True):
            out[i] = flat[start:stop].reshape(leaves[i].shape)
    return out


# --------------------------------------------------------------------------- transforms


def cross_shard(
    axis_name: Any,
    *,
    reduction: str = "mean",
    group_assignment: Any = None,
    communication_dtype: Any = None,
    pack: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Averages (or sums) gradients across the replicas of a mapped axis.

    MEAN is `jax.lax.pmean` and SUM `jax.lax.psum` over `axis_name`; every replica
    gets the same result. `None` leaves pass through. Call `update` inside
    `jax.pmap`, `jax.shard_map` (also over a multi-process mesh) or `jax.vmap` that
    binds `axis_name`; the same code runs on one host and on a TPU pod.

    With `group_assignment`, replicas are reduced only within their subgroup (replica
    ids are indices along `axis_name`; for a tuple of names, the row-major index),
    and MEAN divides by the subgroup size. Under `jax.pmap` this is
    `axis_index_groups`. `jax.shard_map` and `jax.vmap` do not support it, so there
    each replica gets its group's exact sum by k-1 collective permutes (for groups of
    size k) or by one all-reduce of a buffer n/k times the gradient's size (for n
    replicas), whichever moves fewer bytes (`docs/design.md` has the costs). Every
    member of a group gets the same bits. When the devices can be laid out by group,
    a mesh from `optax_accum.replica_group_mesh` turns the groups into a mesh axis
    and the reduction into a plain all-reduce over it: the fast path on a pod.

    Under `jax.shard_map`, each replica's gradient must be its own (varying over the
    axis): take it with respect to `jax.lax.pcast(params, axis_name, to="varying")`,
    since `jax.grad` with respect to replicated params already returns the sum over
    the axis (a replica-invariant gradient is an error, not silently summed twice).

    TF counterpart: `tf.tpu.CrossShardOptimizer(opt, reduction, name,
    group_assignment)`, here without the optimizer (`cross_shard_optimizer` has it).
    Differences from TF: TF scales the loss by 1/num_shards and sums the gradients;
    this averages the gradients themselves (same numbers; it also holds for gradients
    computed outside the wrapper). TF does not reject a group_assignment that repeats
    a replica id; this does.

    Args:
      axis_name: the name (or tuple of names) of the mapped axis to reduce over.
      reduction: "mean" (default) or "sum", in any case.
      group_assignment: optional list of equal-size lists of replica ids forming a
        permutation of `range(num_replicas)`, e.g. `[[0, 3, 5, 6], [1, 2, 4, 7]]`;
        `[]` or None means one group of all replicas.
      communication_dtype: optional floating dtype for the collective (e.g.
        `jnp.bfloat16`, half the bytes of float32). Gradients are cast to it for the
        reduction and back to their own dtype after; MEAN divides before the cast, so
        the sum cannot overflow where the mean would not. The cross-replica sum is
        rounded to this dtype. The bytes are saved on TPU and GPU (XLA:CPU computes
        bfloat16 all-reduces in float32).
      pack: if True, all leaves (of one dtype) travel in one flat buffer, so a step
        issues one collective instead of one per leaf, at the cost of a copy in and
        out of the buffer. XLA often combines per-leaf all-reduces itself; packing
        makes it certain, and also applies to the group permutes.

    Returns:
      A stateless `optax.GradientTransformationExtraArgs` (state `optax.EmptyState`).

    Raises:
      ValueError: for a bad `reduction` or a malformed `group_assignment` (at
        construction); at trace time, when `axis_name` is not bound, the
        group_assignment does not cover exactly the replicas of `axis_name`, or under
        shard_map a gradient leaf is replica-invariant.
      TypeError: for a bad `communication_dtype` or `pack` (at construction), and for
        a non-floating gradient leaf (at trace time).

    Example:
      >>> import jax, jax.numpy as jnp, optax_accum
      >>> tx = optax_accum.cross_shard("i", group_assignment=[[0, 2], [1, 3]])
      >>> def step(g):
      ...     return tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="i")(jnp.arange(4.0))  # replica r sends r
      Array([1., 2., 1., 2.], dtype=float32)
    """
    _checks.require_axis_name("axis_name", axis_name)
    if axis_name is None:
        raise TypeError("axis_name must be an axis name (str) or a tuple of axis names, got None")
    mean = _checks.canonical_reduction(reduction) == "mean"
    groups = _collectives.validate_group_assignment(group_assignment)
    wire_dtype = _checks.floating_dtype("communication_dtype", communication_dtype)
    pack = _checks.require_bool("pack", pack)

    def reduce(x: jax.Array, divisor: int) -> jax.Array:
        dtype = x.dtype
        if wire_dtype is not None:
            if mean:
                x = x / jnp.asarray(divisor, dtype)
            total = _collectives.group_sum(x.astype(wire_dtype), axis_name, groups).astype(dtype)
            return total
        if mean and groups is None:
            return lax.pmean(x, axis_name)
        total = _collectives.group_sum(x, axis_name, groups)
        return total / jnp.asarray(divisor, dtype) if mean else total

    def init_fn(params: optax.Params) -> optax.EmptyState:
        _checks.require_floating_params(params)
        return optax.EmptyState()

    def step(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None,
        call: _protocol.Call,
        **extra_args: Any,
    ) -> _protocol.Result:
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        del params, extra_args
        _reject_unreduced(updates)
        _checks.require_bound_axis(axis_name)
        if groups is not None:
            _collectives.check_group_assignment_size(groups, axis_name)
        divisor = _collectives.axis_size(axis_name) if groups is None else len(groups[0])
        leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
        for path, leaf in leaves:
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise TypeError(
                    f"updates{jax.tree_util.keystr(path)} must be floating, got dtype "
                    f"{jnp.result_type(leaf)}"
                )
            _check_per_replica(f"updates{jax.tree_util.keystr(path)}", leaf, axis_name)
        arrays = [jnp.asarray(leaf) for _, leaf in leaves]
        one = lambda x: reduce(x, divisor)  # noqa: E731
        reduced = _packed(one, arrays) if pack else [one(x) for x in arrays]
        return _protocol.Result(jax.tree_util.tree_unflatten(treedef, reduced), state)

    return _protocol.transformation(init_fn, step)


def cross_shard_optimizer(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    reduction: str = "mean",
    group_assignment: Any = None,
    communication_dtype: Any = None,
    pack: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """`cross_shard` followed by `inner`: TF's `CrossShardOptimizer(inner)`.

    Every replica reduces its gradients with the others of its group (see
    `cross_shard` for the arguments, costs and differences from TF), then `inner`
    transforms the result. Since all replicas of a group feed `inner` the same
    gradients, replicas that start with the same parameters and state keep them
    equal. Extra arguments are forwarded to `inner`.

    Args:
      inner: the optimizer applied to the reduced gradients.
      axis_name: the name (or tuple of names) of the mapped axis.
      reduction: "mean" (default) or "sum".
      group_assignment: optional replica subgroups, as in `cross_shard`.
      communication_dtype: optional dtype of the collective, as in `cross_shard`.
      pack: one collective for all leaves, as in `cross_shard`.

    Returns:
      An `optax.GradientTransformationExtraArgs`; its state is `optax.chain`'s tuple
      `(optax.EmptyState(), inner_state)`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.cross_shard_optimizer(optax.sgd(1.0), "i")
      >>> def step(g):
      ...     params = jnp.zeros(2)
      ...     return tx.update(g, tx.init(params), params)[0]
      >>> grads = jnp.array([[1.0, 2.0], [3.0, 4.0]])  # one row per replica
      >>> jax.vmap(step, axis_name="i")(grads)  # minus the mean, on both replicas
      Array([[-2., -3.],
             [-2., -3.]], dtype=float32)
    """
    inner = _checks.require_transformation("inner", inner)
    average = cross_shard(
        axis_name,
        reduction=reduction,
        group_assignment=group_assignment,
        communication_dtype=communication_dtype,
        pack=pack,
    )

    def init_fn(params: optax.Params) -> tuple:
        return average.init(params), inner.init(params)

    def step(
        updates: optax.Updates,
        state: tuple,
        params: optax.Params | None,
        call: _protocol.Call,
        **extra_args: Any,
    ) -> _protocol.Result:
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        averaged = _protocol.call_inner(
            average, updates, state[0], params, _protocol.Call(), **extra_args
        )
        result = _protocol.call_inner(
            inner, averaged.updates, state[1], params, call._replace(verdict=None), **extra_args
        )
        new_state = (averaged.state, result.state)
        _protocol.watch_weight(
            "cross_shard_optimizer",
            call,
            result.read_weight,
            inner,
            averaged.updates,
            state[1],
            params,
            extra_args,
        )
        out = result.updates if result.selection is None else result.selection
        return _protocol.result_of(
            out,
            new_state,
            call,
            part=lambda s: s[1],
            params=result.params,
            read_weight=result.read_weight,
        )

    return _protocol.transformation(init_fn, step)


__all__ = ["cross_shard", "cross_shard_optimizer"]
