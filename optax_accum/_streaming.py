"""Streaming DiLoCo in `agn` (`fragments=`, `delay=`, `blend=`): which fragment each
param leaf is in, at which local steps each fragment syncs and is blended back, and
the step that does it.

A fragment is a set of param leaves. With P fragments and a period of H steps (a
multiple of P), fragment p syncs every H steps, at the local steps that are
`(p + 1) * H / P` modulo H, so a sync comes every H / P steps, one fragment at a time,
and the last fragment syncs where an unfragmented round would. The step counter the
schedule reads is `AGNState.count`, which then runs 1, 2, ..., H, 1, ... (0 before the
first step only).

With a delay V of 0, fragment p's pseudo-gradient is taken from the local params that
this step's update makes, reduced, and the result blended into them at once. With
V >= 1 it is taken from the params the step is given (the local params after the sync
step, known before this step's gradient), reduced in the step after the sync step, and
blended into the local params V steps after the sync step. Reducing a value known at
the start of the step leaves the compiler free to overlap the reduction with the
step's forward and backward passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import _branch, _checks, _compat, _counters, _engine, _sums


class Layout(NamedTuple):
    """Leaf `i` of the params (in `jax.tree.leaves` order) is in fragment `of[i]`;
    `members[p]` lists fragment p's leaves in ascending order."""

    of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.members)


def _size(x: Any) -> int:
    return int(np.prod(jnp.shape(x), dtype=np.int64))


def _balanced(sizes: list[int], count: int) -> list[int]:
    """Each leaf's fragment: the largest leaves first, each to the fragment holding the
    fewest elements so far (the lowest-numbered on a tie); every fragment non-empty."""
    totals = [0] * count
    of = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        empty = [p for p in range(count) if totals[p] == 0]
        p = empty[0] if empty else min(range(count), key=lambda p: (totals[p], p))
        of[i] = p
        totals[p] += sizes[i] or 1
    return of


def _index(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise TypeError(f"fragments{where} must be a fragment number (an int >= 0), got {value!r}")
    return int(value)


def layout(spec: Any, params: Any) -> Layout:
    """The fragments of `params` that `spec` (agn's `fragments` argument) gives: an int
    P (a partition balanced by size), a tree like the params of fragment numbers, or a
    function of a leaf's path (`jax.tree_util` keys) returning its fragment number.

    Raises:
      ValueError: when P exceeds the number of leaves, or fragment numbers leave one
        of 0 .. P-1 empty; TypeError for a fragment number that is not an int >= 0.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path for path, _ in flat]
    if isinstance(spec, int):
        if spec > len(flat):
            raise ValueError(
                f"fragments={spec} needs at least {spec} param leaves, the params have "
                f"{len(flat)}: give fewer fragments, or a tree or function that says each "
                "leaf's fragment"
            )
        of = _balanced([_size(x) for _, x in flat], spec)
    elif callable(spec):
        of = [_index(f"({jax.tree_util.keystr(p)})", spec(p)) for p in paths]
    else:
        try:
            numbers = treedef.flatten_up_to(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "fragments must be an int, a function of a leaf's path, or a tree of "
                f"fragment numbers with the params' structure ({treedef}): {e}"
            ) from None
        of = [_index(jax.tree_util.keystr(p), n) for p, n in zip(paths, numbers, strict=True)]
    count = max(of, default=-1) + 1
    empty = [p for p in range(count) if p not in of]
    if empty or not count:
        raise ValueError(
            f"fragments must number every fragment from 0 to {max(count - 1, 0)} with at "
            f"least one leaf each, got no leaf in fragment {empty[0] if empty else 0}"
        )
    members = tuple(tuple(i for i, q in enumerate(of) if q == p) for p in range(count))
    return Layout(tuple(of), members)


class Schedule(NamedTuple):
    """When each fragment syncs and is blended back, from the step counter."""

    period: int
    fragments: int
    delay: int

    def offset(self, p: int) -> int:
        """Fragment p's sync step within a period: 1 .. `period`."""
        return (p + 1) * (self.period // self.fragments)

    def next_count(self, count: jax.Array) -> jax.Array:
        """The counter after a step: 1 .. `period` (it starts at 0)."""
        return count % self.period + 1

    def syncs(self, p: int, count: jax.Array, next_count: jax.Array) -> jax.Array:
        """Whether fragment p is reduced in this step: at its sync step (delay 0), or
        in the step after it (its pseudo-gradient known when the step starts)."""
        return (next_count if self.delay == 0 else count) == self.offset(p)

    def blends(self, p: int, next_count: jax.Array, rounds: jax.Array) -> jax.Array:
        """Whether fragment p's new centre is blended into the local params in this
        step: `delay` steps after its sync step, once it has synced (`rounds`, the syncs
        so far, this step's included, exceeds p: fragments first sync in order)."""
        due = (self.offset(p) + self.delay - 1) % self.period + 1
        return (next_count == due) & (rounds > p)


def masked(leaves: list, members: tuple[int, ...], treedef: Any) -> Any:
    """A tree of `treedef` holding `leaves` (fragment `members`' leaves, in order) and
    an `optax.MaskedNode` in every other leaf's place: what `outer` sees of a fragment,
    as `optax.masked` shows its inner transform the leaves it masks in."""
    out: list[Any] = [optax.MaskedNode()] * treedef.num_leaves
    for i, x in zip(members, leaves, strict=True):
        out[i] = x
    return treedef.unflatten(out)


class Rules(NamedTuple):
    """What agn's streaming step takes from `agn`: its arguments, its dense-sum store,
    and its functions for the sums' dtype, the workers' mean, the outer step of a
    centre and the round's skip counts (None when nothing is skipped)."""

    period: int
    delay: int
    blend: float
    delta: bool
    axis_name: Any
    sums: Any
    sum_dtype: Callable[[Any], Any]
    reduced_mean: Callable[[Any], Any]
    moved_centre: Callable[..., tuple[Any, Any]]
    counted_rounds: Callable[[Any], Any] | None


def multiples(period: int, count: int) -> str:
    """The multiples of `count` nearest `period`, for an error message."""
    below, above = period // count * count, (period // count + 1) * count
    return f"{below} or {above}" if below else str(above)


def checked_args(fragments: Any, period: int, delay: Any, blend: Any) -> tuple[int, float]:
    """Checks `fragments`, `delay` and `blend` against each other and the period;
    returns the delay and the blend weight."""
    if isinstance(delay, bool) or not isinstance(delay, int | np.integer):
        raise TypeError(f"delay must be an int >= 0, got {delay!r} ({type(delay).__name__})")
    if isinstance(blend, bool) or not isinstance(blend, int | float | np.integer | np.floating):
        raise TypeError(f"blend must be a number in [0, 1], got {blend!r} ({type(blend).__name__})")
    delay, blend = int(delay), float(blend)
    if fragments is None:
        if delay or blend:
            raise ValueError(
                f"delay={delay} and blend={blend} apply to fragments, got fragments=None: "
                "give fragments (an int, e.g. fragments=1 for the whole model in one "
                "fragment), or leave delay=0 and blend=0.0"
            )
        return delay, blend
    if isinstance(fragments, bool):
        raise TypeError(f"fragments must be an int, a tree or a function, got {fragments!r}")
    if isinstance(fragments, int | np.integer):
        count = _checks.require_positive_int("fragments", fragments)
        if period % count:
            raise ValueError(
                f"communication_period={period} must be a multiple of fragments={count}: "
                f"each fragment syncs every {period} steps, one every {period} / {count} "
                f"steps (choose a period of {multiples(period, count)}); nothing is rounded"
            )
    if not 0 <= delay <= period:
        raise ValueError(
            f"delay must be between 0 and communication_period={period}, got {delay}: a "
            "fragment's new centre must be blended in before its next sync"
        )
    if not 0.0 <= blend <= 1.0:
        raise ValueError(f"blend must be in [0, 1], got {blend}")
    return delay, blend


def _packed_mean(
    layout: Layout,
    pseudo: Callable[[int], list],
    count: jax.Array,
    reduced_mean: Callable[[Any], Any],
    axes: frozenset,
) -> Callable[[int], list]:
    """The mean of this step's fragment, reduced outside any branch.

    With a fragment syncing on every step (`count` is that fragment's number + 1; 0 on
    the first step, which syncs none), the fragment's pseudo-gradient is laid out flat
    in a buffer as long as the largest fragment (a `lax.switch` of local copies), the
    buffer is reduced on every step, and `packed(p)` cuts fragment p's leaves out of
    the mean (read only inside fragment p's sync branch). `axes`: the mesh axes the
    pseudo-gradients may vary over (under `jax.shard_map`).
    """
    shapes = [
        [(x.shape, x.dtype) for x in jax.eval_shape(functools.partial(pseudo, p))]
        for p in range(layout.count)
    ]
    sizes = [[int(np.prod(s, dtype=np.int64)) for s, _ in f] for f in shapes]
    length = max(sum(f) for f in sizes)
    dtype = jnp.result_type(*(d for f in shapes for _, d in f))

    def flat(p: int) -> jax.Array:
        parts = [jnp.ravel(x).astype(dtype) for x in pseudo(p)]
        out = jnp.concatenate([*parts, jnp.zeros(length - sum(sizes[p]), dtype)])
        return _compat.make_varying(out, axes)  # every branch typed alike

    index = jnp.clip(count - 1, 0, layout.count - 1)
    buffer = lax.switch(index, [functools.partial(flat, p) for p in range(layout.count)])
    (mean,) = reduced_mean([buffer])

    def packed(p: int) -> list:
        out, start = [], 0
        for (shape, d), size in zip(shapes[p], sizes[p], strict=True):
            out.append(mean[start : start + size].reshape(shape).astype(d))
            start += size
        return out

    return packed


def _new_sums(rules: Rules, layout: Layout, schedule: Schedule, state: Any, grads: list, kept):
    """The gradient commit's sums with this step's gradient added: each fragment's
    restarts in the step after its sync step (its old sum was reduced, or is being)."""
    old = jax.tree.leaves(state.storage)
    new = list(old)
    for p, m in enumerate(layout.members):
        offer = _engine.Offer(kept, None, None, state.count == schedule.offset(p))
        added = rules.sums.add([old[i] for i in m], [grads[i] for i in m], offer)
        for i, x in zip(m, added.stores, strict=True):
            new[i] = x
    return new


def _pseudo_gradients(
    rules: Rules, layout: Layout, sums: list, params: list, updates: list, centre: list
) -> tuple[Callable[[int], list], list]:
    """`pseudo(p)`, fragment p's pseudo-gradient, from the values known when the step
    starts (delay >= 1: the params given, the sums before this step's gradient), or
    after this step's local update (delay 0); and the values it reads."""
    if not rules.delta:
        source = jax.tree.leaves(sums[0]) if rules.delay else sums[1]
    elif rules.delay:
        source = params
    else:
        source = [optax.apply_updates(x, u) for x, u in zip(params, updates, strict=True)]

    def pseudo(p: int) -> list:
        m = layout.members[p]
        if not rules.delta:
            return [source[i] / rules.period for i in m]
        dtypes = [rules.sum_dtype(centre[i]) for i in m]
        return [
            (centre[i].astype(d) - source[i].astype(d)) / rules.period
            for i, d in zip(m, dtypes, strict=True)
        ]

    return pseudo, source


def _moved_centres(
    rules: Rules, layout: Layout, syncs: list, pseudo: Callable, packed: Any, state: Any,
    treedef: Any, extra_args: dict,
) -> tuple[list, tuple]:  # fmt: skip
    """The centre's leaves and the outer states after this step's sync: fragment p's
    in a branch of its own, taken when `syncs[p]`."""
    centre, outer_states = treedef.flatten_up_to(state.centre), list(state.outer_state)
    moved_leaves = list(centre)
    for p, m in enumerate(layout.members):

        def commit_fragment(carry: tuple, p: int = p, m: tuple = m) -> tuple:
            leaves, outer_state = carry
            mean = packed(p) if packed is not None else rules.reduced_mean(pseudo(p))
            as_tree = functools.partial(masked, members=m, treedef=treedef)
            moved, outer_state = rules.moved_centre(
                as_tree(mean), as_tree(leaves), outer_state, extra_args
            )
            return jax.tree.leaves(moved), outer_state

        carry = ([centre[i] for i in m], outer_states[p])
        moved, outer_states[p] = _branch.apply_if(syncs[p], commit_fragment, carry)
        for i, c in zip(m, moved, strict=True):
            moved_leaves[i] = c
    return moved_leaves, tuple(outer_states)


def _blended(
    rules: Rules, layout: Layout, blends: list, centre: list, params: list, updates: list
) -> list:
    """The local updates, where a fragment takes its centre: `alpha * (x + u) +
    (1 - alpha) * c` as an update of the params `x` (alpha 0: `c - x`)."""
    out = list(updates)
    for p, m in enumerate(layout.members):
        for i in m:
            pull = (centre[i] - params[i]).astype(updates[i].dtype)
            if rules.blend:
                pull = pull * (1.0 - rules.blend) + updates[i] * rules.blend
            out[i] = _sums.select(blends[p], pull, updates[i])
    return out


def step(
    rules: Rules,
    layout: Layout,
    updates: Any,
    state: Any,
    params: Any,
    local_updates: Any,
    inner_state: Any,
    kept: jax.Array,
    skipped: Any,
    extra_args: dict,
) -> tuple[Any, Any]:
    """agn's step with fragments, after the local step (`local_updates`, `inner_state`,
    whether the gradient was `kept`, the round's `skipped` counts): each fragment syncs
    on its own `Schedule`, and its new centre is blended in `delay` steps later.
    Returns the updates and the new `AGNState`."""
    schedule = Schedule(rules.period, layout.count, rules.delay)
    count, next_count = state.count, schedule.next_count(state.count)
    syncs = [schedule.syncs(p, count, next_count) for p in range(layout.count)]
    p_leaves, treedef = jax.tree.flatten(params)
    u_leaves = treedef.flatten_up_to(local_updates)
    c_leaves = treedef.flatten_up_to(state.centre)
    new_sums = jax.tree.leaves(state.storage)
    if not rules.delta:
        grads = treedef.flatten_up_to(updates)
        new_sums = _new_sums(rules, layout, schedule, state, grads, kept)
    pseudo, source = _pseudo_gradients(
        rules, layout, (state.storage, new_sums), p_leaves, u_leaves, c_leaves
    )
    # One fragment syncs per sync step; with a sync on every step that is known at
    # its start (period == fragments, delay >= 1), one reduction of a fixed-size
    # buffer runs outside any branch, so the compiler may overlap it with the step.
    packed = None
    if rules.delay and rules.period == layout.count and rules.axis_name is not None:
        inputs = [*p_leaves, *c_leaves, *source]
        axes = frozenset().union(*(_compat.varying_axes(x) for x in inputs))
        packed = _packed_mean(layout, pseudo, count, rules.reduced_mean, axes)
    centre, outer_state = _moved_centres(
        rules, layout, syncs, pseudo, packed, state, treedef, extra_args
    )
    synced = functools.reduce(jnp.logical_or, syncs)
    if rules.counted_rounds is not None:
        skipped = _branch.apply_if(synced, rules.counted_rounds, skipped)
    (num_nonfinite, num_skipped), (round_nonfinite, round_skipped) = skipped
    global_step = _counters.increment_if(synced, state.global_step)
    blends = [schedule.blends(p, next_count, global_step) for p in range(layout.count)]
    # With a delay of 2 or more, no fragment is blended in the step that reduces it: the
    # blend reads the centre the step was given, so this step's updates do not wait for
    # its reduction, which may then run until the end of the step.
    taken = c_leaves if rules.delay >= 2 else centre
    new_updates = _blended(rules, layout, blends, taken, p_leaves, u_leaves)
    new_state = state._replace(
        global_step=global_step,
        count=next_count,
        num_nonfinite=num_nonfinite,
        round_nonfinite=round_nonfinite,
        num_skipped=num_skipped,
        round_skipped=round_skipped,
        emitted=synced,
        storage=jax.tree.unflatten(jax.tree.structure(state.storage), new_sums),
        centre=treedef.unflatten(centre),
        inner_state=inner_state,
        outer_state=outer_state,
    )
    return treedef.unflatten(new_updates), new_state


__all__ = ["Layout", "Rules", "Schedule", "checked_args", "layout", "masked", "multiples", "step"]
