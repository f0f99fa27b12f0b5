"""Collectives over named axes: replica counts, ordered gathers, sums within groups.

Shared by `cross_shard` (group sums), `sparse_conditional_accumulator` (the gather of
every replica's rows) and `replica_group_mesh` (group assignments). Replica ids are
indices along the axis; for a tuple of names, the row-major index `lax.axis_index`
gives. docs/design.md says how a group sum is chosen where `axis_index_groups` is not
supported.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _compat

Groups = tuple[tuple[int, ...], ...]


# --------------------------------------------------------------------------- group assignments


def validate_group_assignment(group_assignment: Any) -> Groups | None:
    """Checks the structure of a `group_assignment`; returns it as a tuple of tuples.

    Like TF: a list of equal-size lists whose ids are a permutation of
    `range(num_replicas)`, and `[]` (or None) means no groups. Unlike TF, a repeated
    replica id is an error (TF only compares the set of ids). The number of replicas
    is not known here: `check_group_assignment_size` checks it at trace time.

    Raises:
      ValueError: naming what is wrong, with TF's texts ("must be a list of list",
        "must be a permutation of range(N)", "The size of each subgroup in
        group_assignment must be equal").
    """
    if group_assignment is None:
        return None
    if isinstance(group_assignment, np.ndarray):
        group_assignment = group_assignment.tolist()
    _check_list_of_lists(group_assignment)
    if not group_assignment:
        return None
    _check_ids(group_assignment)
    _check_equal_sizes(group_assignment)
    return tuple(tuple(int(i) for i in g) for g in group_assignment)


def _check_list_of_lists(groups: Any) -> None:
    if not isinstance(groups, list | tuple) or not all(isinstance(g, list | tuple) for g in groups):
        raise ValueError(
            "group_assignment must be a list of list (equal-size lists of replica ids), "
            f"got {groups!r}"
        )
    if any(len(g) == 0 for g in groups):
        raise ValueError(f"group_assignment must not hold an empty subgroup, got {groups!r}")


def _check_ids(groups: Any) -> None:
    """Int ids, none repeated, forming a permutation of `range(len(ids))`."""
    ids = [i for g in groups for i in g]
    if any(isinstance(i, bool) or not isinstance(i, int | np.integer) for i in ids):
        raise ValueError(
            f"group_assignment must be a list of list of int replica ids, got {groups!r}"
        )
    repeated = sorted({int(i) for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(
            "group_assignment must not repeat a replica id (TF does not check this), got "
            f"{repeated} more than once in {groups!r}"
        )
    if sorted(ids) != list(range(len(ids))):
        raise ValueError(
            f"group_assignment must be a permutation of range({len(ids)}), got {groups!r}"
        )


def _check_equal_sizes(groups: Any) -> None:
    sizes = [len(g) for g in groups]
    if len(set(sizes)) != 1:
        raise ValueError(
            "The size of each subgroup in group_assignment must be equal, got sizes "
            f"{sizes} in {groups!r}"
        )


def axis_size(axis_name: Any) -> int:
    """The number of replicas along `axis_name` (a name or a tuple of names)."""
    return int(np.prod([lax.axis_size(n) for n in names(axis_name)]))


def check_group_assignment_size(groups: Groups, axis_name: Any) -> None:
    """Raises at trace time unless `groups` covers exactly the replicas of `axis_name`."""
    n, total = axis_size(axis_name), sum(len(g) for g in groups)
    if n != total:
        raise ValueError(
            f"group_assignment must be a permutation of range({n}) (the size of axis "
            f"{axis_name!r}), got the {total} replica ids of {[list(g) for g in groups]}"
        )


# --------------------------------------------------------------------------- gathers


def names(axis_name: Any) -> tuple:
    """`axis_name` as a tuple of names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def under_vmap(axis_name: Any) -> bool:
    """Whether a tuple `axis_name` names an axis bound by `jax.vmap`, whose batched
    `all_gather` and `ppermute` reject several names at once; the other axes
    (`jax.shard_map`, `jax.pmap`) are manual axes of the abstract mesh."""
    axes = names(axis_name)
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    return len(axes) > 1 and not set(axes) <= manual


def all_gather(x: jax.Array, axis_name: Any, *, invariant: bool = False) -> jax.Array:
    """Every replica's `x`, stacked along a new leading axis in replica order.

    For a tuple of names the order is row-major, as `lax.axis_index` numbers the
    replicas. Under `jax.vmap` a tuple is gathered one name at a time, the last (minor)
    name first. With `invariant`, the stack is typed replica-invariant under
    `jax.shard_map` (it is the same on every replica).
    """
    if under_vmap(axis_name):
        axes = names(axis_name)
        for name in reversed(axes):
            x = all_gather(x, name, invariant=invariant)
        return x.reshape((-1, *x.shape[len(axes) :]))
    axes = frozenset(names(axis_name))
    if invariant and axes <= set(jax.sharding.get_abstract_mesh().manual_axes):
        return _compat.all_gather_invariant(_compat.make_varying(x, axes), axis_name)
    return lax.all_gather(x, axis_name)


# --------------------------------------------------------------------------- group sums


def _group_tables(groups: Groups) -> tuple[np.ndarray, np.ndarray]:
    """For each replica id: its group's index and its position inside the group."""
    group_of = np.empty(sum(len(g) for g in groups), np.int32)
    position = np.empty_like(group_of)
    for gi, g in enumerate(groups):
        for j, r in enumerate(g):
            group_of[r], position[r] = gi, j
    return group_of, position


def one_hot_group_sum(x: jax.Array, axis_name: Any, groups: Groups) -> jax.Array:
    """Each replica's group sum: one all-reduce of a (num_groups, *x.shape) buffer.

    A replica writes its value into its group's row of a zero buffer; the all-reduce
    sums every row over all replicas, adding exact zeros from the other groups, and
    each replica reads its group's row. All members read the same all-reduce result,
    so they agree bit for bit.
    """
    group_of, _ = _group_tables(groups)
    me = jnp.asarray(group_of)[lax.axis_index(axis_name)]
    buffer = jnp.zeros((len(groups), *x.shape), x.dtype).at[me].set(x)
    return lax.psum(buffer, axis_name)[me]


def permute_group_sum(x: jax.Array, axis_name: Any, groups: Groups) -> jax.Array:
    """Each replica's group sum: k-1 collective permutes, for groups of size k.

    Shift s sends each member's value to the member s places before it in its group,
    so after k-1 shifts every replica holds all k values of its group. They are added
    in the group's member order, the same order on every member, so all members agree
    bit for bit.
    """
    _, position = _group_tables(groups)
    k = len(groups[0])
    received = [x]  # received[s] on the member at position p is member (p + s) % k's value
    for s in range(1, k):
        perm = [(g[(j + s) % k], g[j]) for g in groups for j in range(k)]
        received.append(lax.ppermute(x, axis_name, perm))
    p = jnp.asarray(position)[lax.axis_index(axis_name)]
    ordered = jnp.stack(received)[(jnp.arange(k) - p) % k]
    total = ordered[0]
    for m in range(1, k):
        total = total + ordered[m]
    return total


def _gathered_group_sum(x: jax.Array, axis_name: Any, groups: Groups) -> jax.Array:
    """`permute_group_sum` for a tuple of `jax.vmap` axes, which cannot be permuted:
    every value gathered, the group's added in its member order (the same bits)."""
    group_of, _ = _group_tables(groups)
    members = jnp.asarray(np.asarray(groups, np.int32))[
        jnp.asarray(group_of)[lax.axis_index(axis_name)]
    ]
    values = all_gather(x, axis_name)[members]
    total = values[0]
    for m in range(1, len(groups[0])):
        total = total + values[m]
    return total


def _exact_group_sum(x: jax.Array, axis_name: Any, groups: Groups) -> jax.Array:
    """The group sum without `axis_index_groups`, by the cheaper of the two methods.

    Per-device traffic in units of x's bytes, for n replicas in groups of size k:
    the one-hot all-reduce moves about 2(n-1)/n * n/k (a ring all-reduce of n/k
    copies); the permutes move k-1. The permutes win while k(k-1) < 2(n-1).
    """
    n, k = sum(len(g) for g in groups), len(groups[0])
    if k * (k - 1) < 2 * (n - 1):
        if under_vmap(axis_name):
            return _gathered_group_sum(x, axis_name, groups)
        return permute_group_sum(x, axis_name, groups)
    return one_hot_group_sum(x, axis_name, groups)


def group_sum(x: jax.Array, axis_name: Any, groups: Groups | None) -> jax.Array:
    """`psum` of `x` over `axis_name`, within each group of `groups` if given.

    Uses `axis_index_groups` where JAX supports it (`jax.pmap`), and the exact
    replacement of `_exact_group_sum` where it does not (`jax.shard_map`, `jax.vmap`).
    """
    if groups is None or len(groups) == 1:
        return lax.psum(x, axis_name)
    if len(groups[0]) == 1:
        return x
    try:
        return lax.psum(x, axis_name, axis_index_groups=[list(g) for g in groups])
    except NotImplementedError:  # shard_map and vmap reject axis_index_groups
        return _exact_group_sum(x, axis_name, groups)
