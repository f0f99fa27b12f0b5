"""Held or released: how every transform branches, chosen per backend in one place.

A transform's work splits into a cheap part that runs on every step (count, add the
gradient) and a dear part that runs only on the steps that release (the inner
optimizer, a collective). `update_if` and `apply_if` run the dear part under a
predicate. On TPU and GPU that is a `lax.cond`. XLA:CPU copies the operands that a
`lax.cond` branch passes through, so there the same branch is a `lax.while_loop`
that runs zero times or once, whose carry stays in its (donated) buffers; the choice
is made with `lax.platform_dependent`, so a program lowered for TPU or GPU holds no
trace of the CPU form. docs/design.md has the measurements behind it.

The branch body is traced once (`jax.make_jaxpr`) and both forms evaluate that
jaxpr, so nesting optax_accum transforms traces the innermost optimizer once per
level rather than once per form. Everything a body reads comes in as an argument:
the state it updates and the params (`fn(state, params)`), which the fused train step
carries through the branch (`apply=True`), so the body reads them from the carry.

`release_if` is `update_if` for a release that consumes a sum, which its caller then
resets lazily (the next step adds to zeros): the released updates travel in the sum's
own buffers and come out as a `_protocol.Selection`, `where(pred, sum, 0)`, so a held
step needs no temporary for its zero updates and the selection fuses into the caller's
`apply_updates`.

On params `as_reduced`, a release all-reduces its unreduced sums. On TPU it does so in
a conditional of its own nested in the branch (`reduced_in_place`), so that each
all-reduce writes into its sum's buffer rather than into one of its own; a release
that applies its updates itself then clears those buffers (`cleared_after`). XLA:CPU
would copy that conditional's operands, and XLA:GPU gave conditionals' outputs buffers
of their own, so elsewhere the all-reduces stand where they are.

A body may return its updates as a `Selection` of buffers in the state it returns (an
accumulator inside `drop_stale_gradients`, or inside another accumulator, asked with
`_protocol.Call(defer=True)`): the branch then carries the selection's predicate
instead of the updates, and returns the selection, read from its own operand, for the
caller to make after it (or to pass on). A nest of transforms costs one selection per
leaf, not one per level (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from optax_accum import _compat, _unreduced
from optax_accum._protocol import Selection
from optax_accum.indexed_slices import apply_updates

# --------------------------------------------------------------------------- tracing


def _deferrable(selection: Selection, new_carry: Any) -> bool:
    """Whether a body's `selection` can be made after its branch: its predicate varies
    over no mesh axis that one of its buffers does not (under `jax.shard_map`)."""
    axes = _compat.varying_axes(selection.pred)
    return all(axes <= _compat.varying_axes(b) for b in jax.tree.leaves(selection.take(new_carry)))


@dataclasses.dataclass(frozen=True)
class _Traced:
    """`fn` traced once: callable on a carry, with the traced consts as operands.

    `selected` is set when `fn` returned its updates as a `Selection` of buffers in its
    new carry (see `of`): the traced function returns the selection's predicate in
    their place, and `selected` keeps how to read the buffers and the updates' types.
    """

    closed: ClosedJaxpr
    out_tree: Any
    out_shapes: Any
    in_shapes: Any
    selected: tuple[Callable[[Any], Any], Any] | None = None

    @classmethod
    def of(cls, fn: Callable, carry: Any, *, defer: bool = False, inputs: Any = ()) -> _Traced:
        """`fn` traced on `carry`, typed so that it can be run on its own output.

        `fn` returns `(updates, new_carry)`. Under `jax.shard_map`, a carry leaf that
        is replica-invariant (a state made by `init` inside the mapped function) may
        come back varying (its update reads a per-replica gradient). A jaxpr traced
        with the invariant type cannot run on the varying one, so the carry is traced
        again, each such leaf typed as varying, until the types hold still; callers
        pass the operand through `in_shapes` (`_run_if` does).

        Updates that `fn` returns as a `Selection` are kept as one (their predicate in
        their place) when `defer` allows it and `_deferrable`; otherwise they are made
        inside the body.

        `inputs` are values `fn(carry, inputs)` reads and does not return: traced as
        inputs, they join the consts (operands of either form). A value a body merely
        closes over becomes a constant of the traced program when it is concrete (an
        eager call), and an array typed unreduced cannot be one.
        """
        found: list[tuple[Callable[[Any], Any], Any] | None] = [None]

        def deferring(carry: Any, inputs: Any) -> Any:
            updates, new = fn(carry, inputs)
            found[0] = None
            if isinstance(updates, Selection):
                if not (defer and _deferrable(updates, new)):
                    return updates.made(new), new
                found[0] = (updates.take, updates.like)
                return updates.pred, new
            return updates, new

        # One jit call: both forms then bind it as one equation that refers to the body,
        # rather than binding each of its equations again (trace time; XLA inlines it).
        deferring.__name__ = "branch_body"
        for _ in range(4):  # each pass can only add varying axes, so this ends fast
            closed, out_shapes = jax.make_jaxpr(jax.jit(deferring), return_shape=True)(
                carry, inputs
            )
            out_tree = jax.tree.structure(out_shapes)
            # The abstract values, not the shapes: they carry the varying mesh axes on
            # every jax (jax 0.8's ShapeDtypeStruct does not).
            out = out_tree.unflatten(closed.out_avals)
            if not _gains_axes(carry, out[1]):
                break
            carry = _varying_as(carry, out[1])
        n = len(jax.tree.leaves(carry))
        in_shapes = jax.tree.structure(carry).unflatten(closed.in_avals[:n])
        jaxpr = closed.jaxpr  # the inputs' variables become constants of the program
        jaxpr = jaxpr.replace(
            constvars=[*jaxpr.constvars, *jaxpr.invars[n:]], invars=jaxpr.invars[:n]
        )
        closed = ClosedJaxpr(jaxpr, [*closed.consts, *jax.tree.leaves(inputs)])
        return cls(closed, out_tree, out, in_shapes, selected=found[0])

    @property
    def consts(self) -> list:
        return list(self.closed.consts)

    def __call__(self, consts: list, carry: Any) -> Any:
        run = jaxpr_as_fun(ClosedJaxpr(self.closed.jaxpr, list(consts)))
        return self.out_tree.unflatten(run(*jax.tree.leaves(carry)))


def _varying_as(tree: Any, like: Any) -> Any:
    """`tree` typed as varying over the mesh axes `like` varies over too (a type-level
    cast under `jax.shard_map`; no data moves)."""
    return jax.tree.map(lambda x, r: _compat.make_varying(x, _compat.varying_axes(r)), tree, like)


def _gains_axes(carry: Any, out: Any) -> bool:
    """Whether some leaf of `out` varies over a mesh axis its `carry` leaf does not."""
    return any(
        _compat.varying_axes(o) - _compat.varying_axes(c)
        for c, o in zip(jax.tree.leaves(carry), jax.tree.leaves(out), strict=True)
    )


def _as_carry(out: Any, carry: Any) -> Any:
    """`out` in the carry's types: each leaf in its carry leaf's dtype and varying axes."""
    out = jax.tree.map(lambda o, c: o if o.dtype == c.dtype else o.astype(c.dtype), out, carry)
    return _varying_as(out, carry)


# --------------------------------------------------------------------------- the two forms
#
# Both run `traced`, a function `operand -> (updates, operand)`, when `pred` holds;
# otherwise they return `(held(salted), operand)`, where `held` builds the updates of
# a held step (zeros, usually) and `salted` says whether to build them from a run-time
# value that XLA cannot fold (see `unmerged_zeros`).


def _cond_form(
    pred: jax.Array, traced: _Traced, operand: Any, consts: list, held: Callable
) -> tuple:
    """TPU and GPU: a `lax.cond`."""
    operand = _varying_as(operand, traced.out_shapes[1])

    def release(op: Any) -> tuple:
        updates, new = traced(consts, op)
        return updates, _as_carry(new, op)

    def hold(op: Any) -> tuple:
        return _varying_as(held(False), traced.out_shapes[0]), op

    return lax.cond(pred, release, hold, operand)


def _tied_to(flag: jax.Array, tree: Any) -> Any:
    """`tree` behind optimization barriers shared with `flag`, keeping each leaf's type:
    read through them, nothing in a loop body whose flag is `flag` is loop-invariant.

    One barrier per distinct set of varying mesh axes: under `jax.shard_map` a
    barrier's outputs all take the union of its operands' varying axes, which would
    turn replica-invariant leaves (e.g. an inner optimizer's state) varying.
    """
    leaves, treedef = jax.tree.flatten(tree)
    by_axes: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        by_axes.setdefault(_compat.varying_axes(x), []).append(i)
    flag_axes = _compat.varying_axes(flag)
    for axes, idx in by_axes.items():
        if not flag_axes <= axes:
            # A per-replica flag would make these leaves per-replica too, against the
            # types the body was traced with; left untied, XLA may only hoist their work.
            continue
        _, tied = lax.optimization_barrier((flag, [leaves[i] for i in idx]))
        for i, x in zip(idx, tied, strict=True):
            leaves[i] = x
    return treedef.unflatten(leaves)


def _loop_form(
    pred: jax.Array, traced: _Traced, operand: Any, consts: list, held: Callable
) -> tuple:
    """XLA:CPU: a `lax.while_loop` that runs zero times or once.

    The carry (the held step's updates and the operand) stays in one set of buffers
    that the body updates in place, so a held step passes it on untouched. Everything
    the body reads, the consts (integers included) and the operand, is tied to the
    loop flag by an optimization barrier, or XLA would hoist work on loop-invariant
    inputs out of the loop and run it on every step. The operand needs it too: a leaf
    the body reads but does not write (a sum that the caller restarts lazily) passes
    through the loop unchanged, so XLA counts it invariant; under `jax.shard_map` the
    release's `psum` of that sum was moved out and all-reduced the whole gradient on
    every step.
    """
    carry = _varying_as((held(True), operand), traced.out_shapes)

    def body(loop: tuple) -> tuple:
        again, value, consts = loop
        out = traced(*_tied_to(again, (consts, value[1])))
        return jnp.logical_not(again), _as_carry(out, value), consts

    return lax.while_loop(lambda loop: loop[0], body, (jnp.asarray(pred), carry, consts))[1]


@dataclasses.dataclass(frozen=True)
class _Spending:
    """`traced` (on an operand `(kept, spent)`) with its updates written over `spent`:
    it returns `((), (new_kept, updates))`, each update in its `spent` leaf's dtype.

    A held step must still return full-size zero updates, and an array that lives only
    within one call is a temporary that XLA:CPU allocates afresh on every call (a page
    fault per 4 KiB page). Carried in the spent tree's buffers (the state's), the
    updates need none: `release_if` selects them after the branch, `where(pred, x, 0)`,
    which fuses into the caller's `apply_updates`.
    """

    traced: _Traced
    selected = None  # its updates are carried, not selected by a branch inside it

    @property
    def consts(self) -> list:
        return self.traced.consts

    @property
    def in_shapes(self) -> Any:
        return self.traced.in_shapes

    @property
    def out_shapes(self) -> Any:
        return (), (self.traced.out_shapes[1][0], self.traced.in_shapes[1])

    def __call__(self, consts: list, carry: Any) -> Any:
        updates, (new_kept, _) = self.traced(consts, carry)
        spent = jax.tree.structure(carry[1]).unflatten(jax.tree.leaves(updates))
        return (), (new_kept, spent)


def _holds_exactly(wide: Any, narrow: Any) -> bool:
    """Whether every value of the dtype `narrow` is a value of the dtype `wide`."""
    if wide == narrow:
        return True
    if not (jnp.issubdtype(wide, jnp.floating) and jnp.issubdtype(narrow, jnp.floating)):
        return False
    w, n = jnp.finfo(wide), jnp.finfo(narrow)
    return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def _can_spend(pred: jax.Array, updates: Any, spent: Any) -> bool:
    """Whether `_Spending` may carry `updates` in `spent`'s buffers: leaf for
    leaf the same shapes, varying mesh axes and reduced/unreduced axes (updates typed
    reduced never travel in an unreduced sum's buffers), a dtype that holds the updates
    exactly (bfloat16 updates in a float32 sum), and a `pred` that varies over no axis
    they do not."""
    u, s = jax.tree.leaves(updates), jax.tree.leaves(spent)
    if len(u) != len(s) or not s:
        return False
    axes = _compat.varying_axes(pred)
    return all(
        a.shape == b.shape
        and _holds_exactly(b.dtype, a.dtype)
        and _compat.varying_axes(a) == _compat.varying_axes(b)
        and _compat.sum_types(a) == _compat.sum_types(b)
        and axes <= _compat.varying_axes(b)
        for a, b in zip(u, s, strict=True)
    )


def _holds_unreduced(tree: Any) -> bool:
    """Whether a leaf of `tree` is typed unreduced over a mesh axis (explicit sharding).

    The partitioner gives a `lax.while_loop`'s carry no sharding of its own: it takes
    the one the body reduces the carry to, and reduces the carry before the loop, on
    every step. A `lax.cond` keeps the reduction in its branch, so such an operand
    takes the `lax.cond` form on XLA:CPU too (docs/design.md).
    """
    return any(_compat.sum_types(x)[1] for x in jax.tree.leaves(tree))


def _run_if(pred: jax.Array, traced: _Traced | _Spending, operand: Any, held: Callable) -> tuple:
    """`traced(operand)` if `pred`, else `(held(...), operand)`, in the form the
    backend runs best (chosen when the program is lowered for it).

    When `traced.selected`, the body's updates come back as a `Selection` of the
    operand the branch returns: a held step carries a False predicate and no updates."""
    selected = traced.selected
    if selected is not None:
        held = lambda salted: jnp.zeros((), jnp.bool_)  # noqa: E731
    operand = _varying_as(operand, traced.in_shapes)
    loop = _loop_form if not _holds_unreduced((operand, traced.consts)) else _cond_form
    first, operand = lax.platform_dependent(
        pred,
        operand,
        traced.consts,
        cpu=lambda p, op, k: loop(p, traced, op, k, held),
        default=lambda p, op, k: _cond_form(p, traced, op, k, held),
    )
    if selected is None:
        return first, operand
    take, like = selected
    return Selection(first, take, like), operand


# --------------------------------------------------------------------------- zeros


# Leaves with fewer elements get plain zeros in `unmerged_zeros`: XLA:CPU spends about
# as long compiling a leaf's own broadcast kernel (milliseconds) as copying a small
# leaf from a shared zero buffer costs over thousands of steps (benchmarks/NOTES.md,
# "Compile time").
_UNMERGED_MIN_SIZE = 1 << 14


def unmerged_zeros(like: Any, salt: jax.Array) -> Any:
    """Zeros shaped like `like`, each large leaf written by its own broadcast.

    XLA merges equal broadcasts of the constant 0 into one buffer and then copies it
    into every output leaf. Leaf i broadcasts `(max(salt, 0) >> 31) & (i + 1)`
    instead: 0 for every int32 `salt`, but a different run-time value to XLA for each
    leaf, so nothing is merged or copied. `salt` is a replicated scalar, so sharded
    leaves need no collective; leaves that must not vary over mesh axes that `salt`
    varies over get plain zeros, and so do leaves of fewer than `_UNMERGED_MIN_SIZE`
    elements, whose copy costs less than compiling a kernel for each.
    """
    high = jnp.maximum(salt.astype(jnp.int32), 0) >> 31
    leaves, treedef = jax.tree.flatten(like)

    def zeros(i: int, s: Any) -> jax.Array:
        small = math.prod(s.shape) < _UNMERGED_MIN_SIZE
        sharding = _compat.explicit_sharding(s)
        if small or _compat.varying_axes(high) - _compat.varying_axes(s):
            return jnp.zeros(s.shape, s.dtype, out_sharding=sharding)
        return jnp.broadcast_to((high & (i + 1)).astype(s.dtype), s.shape, out_sharding=sharding)

    return treedef.unflatten([zeros(i, s) for i, s in enumerate(leaves)])


# --------------------------------------------------------------------------- public helpers


class Branched(NamedTuple):
    """What a branch gives back: the updates (or a `Selection` of `state`'s buffers),
    the state, and the params when the branch applied the updates to them (else None)."""

    updates: Any
    state: Any
    params: Any = None


def apply_if(pred: jax.Array, fn: Callable[[Any], Any], carry: Any) -> Any:
    """`fn(carry)` when `pred` holds, else `carry`, updated in place on the CPU.

    `fn` must return a tree with `carry`'s structure and shapes; each leaf is cast
    back to its `carry` dtype. `pred` must be the same on every replica when `fn`
    holds a collective. Not reverse-mode differentiable on the CPU (optimizer updates
    are never differentiated in this library).
    """
    traced = _Traced.of(lambda c, _: ((), fn(c)), carry)
    return _run_if(pred, traced, carry, held=lambda salted: ())[1]


def _zeros_of(aval: Any) -> jax.Array:
    """Zeros of `aval`'s type: its shape, dtype and (explicit) sharding."""
    return jnp.zeros(aval.shape, aval.dtype, out_sharding=_compat.explicit_sharding(aval))


def _held_zeros(traced: _Traced, salt: jax.Array, held: Callable | None = None) -> Callable:
    """The `held` argument of the forms: the zero updates of a held step, mapped by
    `held` (e.g. to padding row ids); `salted` builds them with `unmerged_zeros`."""
    shapes, finish = traced.out_shapes[0], held or (lambda zeros: zeros)

    def held_updates(salted: bool) -> Any:
        if salted:
            return finish(unmerged_zeros(shapes, salt))
        return finish(jax.tree.map(_zeros_of, shapes))

    return held_updates


def update_if(
    pred: jax.Array,
    fn: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    params: Any,
    *,
    salt: jax.Array,
    apply: bool = False,
    defer: bool = False,
    held: Callable[[Any], Any] | None = None,
    inputs: Any = (),
    carried: Any = None,
) -> Branched:
    """`fn(state, params, inputs)` (a pair `(updates, new_state)`) when `pred` holds,
    else `(zeros, state)`, with the zeros shaped like the updates `fn` would return.

    `new_state` is cast back to `state`'s dtypes, so an inner optimizer whose state
    changes dtype with mixed-precision gradients keeps a fixed state. `salt` is a
    replicated int32 scalar (a counter) for `unmerged_zeros` on the CPU. `held` maps
    the zero updates to what a held step returns (e.g. padding row ids).

    With `apply`, the params travel through the branch and the updates are applied to
    them inside it (`Branched.params`): a held step reads and writes no parameter.
    `carried` (a tree of bools like the params; None: all) says which leaves travel so;
    the others get the branch's updates applied after it (a table updated by
    `IndexedSlices` rows, whose held updates touch no row: carried through the branch,
    TPU's compiler may give the table a layout of its own there, and copy it). With
    `defer` (and no `held`), updates that `fn` returns as a `Selection` of its new
    state come back as a `Selection` of the returned state. `inputs` are values `fn`
    reads and does not change (see `_Traced.of`).
    """
    if apply:
        leaves, treedef = jax.tree.flatten(params)
        through = [True] * len(leaves) if carried is None else treedef.flatten_up_to(carried)

        def applied(params: list, updates: Any, which: bool) -> list:
            """`params` (the leaves `through` marks `which`) plus their updates."""
            ups = [
                u
                for u, t in zip(treedef.flatten_up_to(updates), through, strict=True)
                if t == which
            ]
            return [apply_updates(p, u) for p, u in zip(params, ups, strict=True)]

        def merged(inside: list, outside: list) -> Any:
            inside, outside = iter(inside), iter(outside)
            return treedef.unflatten([next(inside) if t else next(outside) for t in through])

        outside = [p for p, t in zip(leaves, through, strict=True) if not t]

        def applying(operand: tuple, inputs: Any) -> tuple:
            state, inside = operand
            updates, state = fn(state, merged(inside, outside), inputs)
            return updates, (state, applied(inside, updates, True))

        operand = (state, [p for p, t in zip(leaves, through, strict=True) if t])
        traced = _Traced.of(applying, operand, inputs=inputs)
        updates, (state, inside) = _run_if(pred, traced, operand, _held_zeros(traced, salt, held))
        # The leaves not carried take the branch's updates after it (padding when held).
        params = merged(inside, applied(outside, updates, False))
        return Branched(updates, state, params)
    traced = _Traced.of(
        lambda s, inputs: fn(s, params, inputs), state, defer=defer and held is None, inputs=inputs
    )
    updates, state = _run_if(pred, traced, state, _held_zeros(traced, salt, held))
    return Branched(updates, state)


def release_if(
    pred: jax.Array,
    fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    kept: Any,
    spent: Any,
    params: Any,
    *,
    salt: jax.Array,
    apply: bool = False,
) -> Branched:
    """`update_if` for a release that consumes `spent` (a sum of gradients), which the
    caller resets lazily: `fn(kept, spent, params)` returns `(updates, new_kept, left)`
    (`left`: what the release leaves in `spent`'s buffers, `spent` itself or values it
    wrote there), and the result's state is `(new_kept, spent_after)`, or `(kept,
    spent)` when `pred` does not hold.

    After a release `spent_after` holds no meaningful values (`left`, or the updates,
    which travel in its buffers: see `_Spending`); the caller treats it as zeros from then on
    (`_sums.restarted`), so no step spends a pass over it on writing zeros. The updates
    come back as a `Selection` of the returned state where they can (always, unless
    `apply`): the caller makes them, or passes the selection on.
    """

    def whole(operand: tuple, params: Any, _: Any = ()) -> tuple:
        kept, spent = operand
        updates, kept, spent = fn(kept, spent, params)
        if isinstance(updates, Selection):  # of `kept`, read from the operand
            updates = updates.within(lambda operand: operand[0])
        return updates, (kept, spent)

    if apply:  # the params travel through the branch instead
        return update_if(pred, whole, (kept, spent), params, salt=salt, apply=True)
    traced = _Traced.of(lambda operand, _: whole(operand, params), (kept, spent), defer=True)
    if traced.selected is None and _can_spend(pred, traced.out_shapes[0], traced.in_shapes[1]):
        _, operand = _run_if(pred, _Spending(traced), (kept, spent), lambda salted: ())
        return Branched(Selection(pred, lambda operand: operand[1], traced.out_shapes[0]), operand)
    updates, operand = _run_if(pred, traced, (kept, spent), _held_zeros(traced, salt))
    return Branched(updates, operand)


# --------------------------------------------------------------------------- in place


def reduced_in_place(sums: list, pred: jax.Array) -> tuple[list, list]:
    """Unreduced running sums all-reduced in a release's branch (`pred`: its
    predicate): `(left, totals)` (`_unreduced.reduced_in_place`), on TPU in a
    conditional of their own, each all-reduce writing into its sum's buffer (TPU v5e,
    268M params in 8 leaves, Adam: no temporaries, where an output of each's own
    kept one leaf or, as the compiler's memory scheduler chose, all eight)."""
    return lax.platform_dependent(
        sums,
        tpu=lambda sums: _unreduced.reduced_in_place(sums, pred, nest=True),
        default=lambda sums: _unreduced.reduced_in_place(sums, pred, nest=False),
    )


def cleared_after(totals: list, sums: list, left: list, after: Any) -> list:
    """What a release that applies its updates itself returns in the buffers that
    `reduced_in_place` wrote its `totals` into (`left`): on TPU each total times zero,
    typed as its sum and read through an optimization barrier with `after` (the inner
    optimizer's new state), so that it is made in place once the inner has read the
    total. Returned as `left` (the same bits typed as the sums, while the inner read
    them typed as plain arrays), each was copied: 1 GiB of temporaries at 268M. Values
    that no step reads (the next one restarts the sums). Elsewhere `left` itself."""

    def zeroed(operand: tuple) -> list:
        totals, sums = operand
        tied, _ = lax.optimization_barrier((totals, after))
        return [_unreduced.in_sum_type(t * 0, s) for t, s in zip(tied, sums, strict=True)]

    return lax.platform_dependent((totals, sums), tpu=zeroed, default=lambda operand: list(left))


__all__ = [
    "Branched",
    "apply_if",
    "cleared_after",
    "reduced_in_place",
    "release_if",
    "unmerged_zeros",
    "update_if",
]
