"""One engine that accepts, sums, counts and releases, for every accumulating transform.

Every optax_accum transform that holds gradients back does the same four things, here:

- **accepts** (`judged`): a gradient is summed iff it is fresh, finite, has a good
  weight, is kept by the skip rule and is passed by a wrapper's verdict
  (`_protocol.Call.verdict`); otherwise it is counted as stale, non-finite or skipped.
- **sums**: each param leaf keeps its running sum in a storage kind, a `Storage`
  record of functions (as optax's microbatching `Accumulator` records are): a dense
  sum (typed unreduced where its param is typed reduced), a row buffer for a sparse
  table, dense rows counting each row, a running max or min. The engine is given the
  kinds a transform uses, and for each leaf whether its release is a mean;
  `_storages` defines them.
- **counts** (`counted`, `tallied`): a step's arrivals are int32 counts keyed by the
  state's field names (`count`, `num_dropped`, ...), summed over `axis_name` in one
  all-reduce (with the weight, when the state keeps a `weight_sum`), and added to the
  fields of the same names.
- **releases** (`accumulate`): once `count` reaches `num_required`, the storage kinds
  give the window's aggregate inside a branch (`_branch`), `inner` transforms it, and
  the state advances by name.

`conditional_accumulator` and `sparse_conditional_accumulator` are `accumulate` with
their storage kinds and state type; a nest of them is `accumulate` inside `accumulate`,
through the step protocol. `drop_stale_gradients` and `agn` use the same gate, counts
and branch (docs/design.md, "The engine", says what a new transform must provide).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _compat,
    _counters,
    _extra_args,
    _protocol,
    _spending,
    _sums,
    _unreduced,
)
from optax_accum.indexed_slices import IndexedSlices

# --------------------------------------------------------------------------- accepts


class Judged(NamedTuple):
    """What becomes of one offered gradient. With a wrapper's verdict that drops it,
    every flag is False: the gradient counts nowhere."""

    offered: jax.Array  # fresh, finite, kept by the rules and passed: to be summed
    stale: jax.Array
    nonfinite: jax.Array  # fresh, but holds a NaN or Inf (`skip_nonfinite`)
    skipped: jax.Array  # fresh and finite, but skipped by a rule or a bad weight
    verdict: jax.Array | None

    def passed(self, flag: jax.Array) -> jax.Array:
        """`flag`, and False where the wrapper's verdict dropped the gradient."""
        return flag if self.verdict is None else flag & self.verdict

    def emitted(self, emit: jax.Array, before: jax.Array) -> jax.Array:
        """The state's `emitted` after this update: as it was when the verdict
        dropped the gradient (the update did not happen, for the wrapper)."""
        return emit if self.verdict is None else _sums.select(self.verdict, emit, before)


def judged(
    verdict: jax.Array | None,
    *,
    fresh: jax.Array,
    finite: jax.Array,
    weight_ok: jax.Array,
    rule: jax.Array | None,
) -> Judged:
    """The gate: a gradient is summed iff it is `fresh`, `finite`, has a good weight,
    is not skipped by the `rule` (None: no rule) and is passed by the `verdict` (None:
    no wrapper's verdict)."""
    kept = weight_ok if rule is None else weight_ok & ~rule
    flags = (fresh & finite & kept, ~fresh, fresh & ~finite, fresh & finite & ~kept)
    if verdict is not None:
        flags = tuple(flag & verdict for flag in flags)
    return Judged(*flags, verdict)


# --------------------------------------------------------------------------- sums


class Offer(NamedTuple):
    """A step's gradient as the storage kinds see it."""

    offered: jax.Array  # a bool scalar: the gate says to sum it
    weight: jax.Array | None  # a float32 scalar, or None (each gradient weighs 1)
    axis_name: Any  # the replicas that share the storage, or None
    restart: jax.Array  # a bool scalar: the last step released, the sums restart


class Added(NamedTuple):
    """What a storage kind made of an offer: its new stores, whether it took the
    gradient (a kind may refuse it, and a refused gradient is taken by no kind), and
    its arrivals, int32 counts keyed by the state's counter names."""

    stores: list
    accepted: jax.Array
    arrivals: dict[str, jax.Array]


class Window(NamedTuple):
    """What a release knows besides the stores: whether each leaf handed to the kind is
    released as a mean (in the order of its stores), the window's weight sum (for the
    kinds that keep none of their own) and the replicas' axis."""

    means: tuple[bool, ...]
    weight_sum: jax.Array
    axis_name: Any


class Storage(NamedTuple):
    """A kind of running sum: how the engine keeps, fills and releases it.

    Attributes:
      holds: whether a store (a leaf of the state's `storage`) is of this kind.
      empty: `param -> store`, at `init`.
      check: `(where, gradient leaf, store) -> None`: trace-time checks; raises a
        TypeError or ValueError naming `where`.
      finite: `(gradient leaf, store) -> bool scalar`: no NaN or Inf in it.
      add: `(stores, gradient leaves, Offer) -> Added`, for all the leaves of this
        kind at once (a row buffer takes a gradient whole or not at all). Kinds that
        may refuse a gradient come first in a transform's kinds: the others add only
        what was accepted.
      release: `(stores, gradient leaves, Window) -> aggregate leaves`, inside the
        release branch (the gradient leaves give the aggregate's types).
      retyped: `(update leaf, store) -> update leaf`: an update typed like its param
        (reduced where the store is unreduced); a cast that moves nothing.
      after: `(store, emit) -> store`, after the branch: empties the store on a release
        where the next step does not restart it itself.
      held: `zero update leaf -> update leaf`, what a held step returns for this kind.
      spendable: whether the released updates may travel in the stores' buffers (a
        dense sum, which the next step restarts).
      carries_params: whether the fused step (`apply_gradients`) carries this leaf's
        param through the release branch, so that a held step touches it not at all,
        or applies its update after the branch (a row buffer's: on a held step, padding
        rows, which touch no row of the table).
      spent_as: `(update leaf, store) -> update leaf`, the update typed to travel in
        the store's buffer out of the branch, where that differs from `retyped` (a
        dense sum typed unreduced: `_unreduced.in_sum_type`, read back after the
        branch with `_unreduced.out_of_sum_type`); None: `retyped`.
      spent_in: `store -> (array, put)`: the array whose buffer the update travels in
        (a dense leaf's values, not its counts), `put(other) -> store`; default: itself.
      summed: whether that array, typed unreduced, holds the devices' partial sums,
        which the release all-reduces in its own dtype (`_unreduced.reduced_sum`): the
        engine reduces them before the kinds' releases (`_spending.reduced_first`).
    """

    holds: Callable[[Any], bool]
    empty: Callable[[Any], Any]
    check: Callable[[str, Any, Any], None]
    finite: Callable[[Any, Any], jax.Array]
    add: Callable[[list, list, Offer], Added]
    release: Callable[[list, list, Window], list]
    retyped: Callable[[Any, Any], Any]
    after: Callable[[Any, jax.Array], Any]
    held: Callable[[Any], Any]
    spendable: bool
    carries_params: bool = True
    spent_as: Callable[[Any, Any], Any] | None = None
    spent_in: Callable[[Any], tuple[Any, Callable[[Any], Any]]] = lambda s: (s, lambda x: x)
    summed: bool = False


def _is_slices(x: Any) -> bool:
    return isinstance(x, IndexedSlices)


class Layout(NamedTuple):
    """Which kind keeps each store of a storage tree, leaf by leaf (in tree order)."""

    kinds: tuple[Storage, ...]
    of: tuple[int, ...]  # the position in `kinds` of each store's kind
    treedef: Any

    @classmethod
    def of_storage(cls, kinds: tuple[Storage, ...], storage: Any) -> Layout:
        def is_store(x: Any) -> bool:
            return any(k.holds(x) for k in kinds)

        stores, treedef = jax.tree.flatten(storage, is_leaf=is_store)
        of = tuple(next(i for i, k in enumerate(kinds) if k.holds(s)) for s in stores)
        return cls(kinds, of, treedef)

    def stores(self, storage: Any) -> list:
        return self.treedef.flatten_up_to(storage)

    def by_kind(self, leaves: list) -> list[tuple[Storage, list[int]]]:
        """The kinds in use, in their order, each with the positions of its leaves."""
        return [
            (kind, [j for j, k in enumerate(self.of) if k == i])
            for i, kind in enumerate(self.kinds)
            if i in self.of
        ]

    def map(self, fn: Callable[[Storage, Any, Any], Any], leaves: list, stores: list) -> list:
        return [fn(self.kinds[k], g, s) for k, g, s in zip(self.of, leaves, stores, strict=True)]


def _check_updates(layout: Layout, updates: Any, storage: Any) -> list:
    """The gradient's leaves (one per store, `IndexedSlices` whole), checked at trace
    time against the stores: tree structure, then each leaf by its kind."""
    got = jax.tree.structure(updates, is_leaf=_is_slices)
    if got != layout.treedef:
        raise ValueError(
            "updates must have the tree structure of the params given to init: "
            f"expected {layout.treedef}, got {got}"
        )
    flat, _ = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_slices)
    stores = layout.stores(storage)
    for ((path, g), s), k in zip(zip(flat, stores, strict=True), layout.of, strict=True):
        layout.kinds[k].check(f"updates{jax.tree_util.keystr(path)}", g, s)
    return [g for _, g in flat]


def _added(layout: Layout, stores: list, grads: list, offer: Offer) -> Added:
    """Every kind's stores with the gradient added (see `Storage.add`)."""
    stores, accepted, arrivals = list(stores), offer.offered, {}
    for kind, at in layout.by_kind(stores):
        added = kind.add([stores[j] for j in at], [grads[j] for j in at], offer)
        offer = offer._replace(offered=added.accepted)
        for j, s in zip(at, added.stores, strict=True):
            stores[j] = s
        for name, n in added.arrivals.items():
            arrivals[name] = arrivals[name] + n if name in arrivals else n
        accepted = added.accepted
    return Added(stores, accepted, arrivals)


def _released(layout: Layout, stores: list, grads: list, window: Window) -> list:
    """Every kind's aggregate, leaf by leaf in tree order (see `Storage.release`)."""
    out: list[Any] = [None] * len(stores)
    for kind, at in layout.by_kind(stores):
        means = tuple(window.means[j] for j in at)
        for j, a in zip(
            at,
            kind.release(
                [stores[j] for j in at], [grads[j] for j in at], window._replace(means=means)
            ),
            strict=True,
        ):
            out[j] = a
    return out


# --------------------------------------------------------------------------- counts


def counted(
    arrivals: Mapping[str, jax.Array], axis_name: Any, weight: jax.Array | None = None
) -> tuple[dict[str, jax.Array], jax.Array | None]:
    """A step's arrivals (int32 counts by counter name) summed over `axis_name`: one
    all-reduce of them all. A `weight` (a float32 scalar) joins it, the counts then
    travelling in float32 (at most one per replica and name: exact). Returns the
    summed counts and the summed weight (None without one)."""
    names = list(arrivals)
    stacked = jnp.stack([jnp.asarray(arrivals[n]).astype(jnp.int32) for n in names])
    if axis_name is None:
        return dict(zip(names, stacked, strict=True)), weight
    _checks.require_bound_axis(axis_name)
    if weight is None:
        stacked = lax.psum(stacked, axis_name)
        return dict(zip(names, stacked, strict=True)), None
    summed = lax.psum(jnp.append(stacked.astype(weight.dtype), weight), axis_name)
    counts = summed[:-1].astype(jnp.int32)
    return dict(zip(names, counts, strict=True)), summed[-1]


def tallied(counters: Any, counts: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The counters of `counts`' names (fields of a state, or a dict's entries), each
    plus its count (an int32, or a bool flag for one; saturating: int32 counters never
    wrap), as keyword arguments for `state._replace`."""
    read = counters.__getitem__ if isinstance(counters, Mapping) else counters.__getattribute__

    def add(counter: jax.Array, n: jax.Array) -> jax.Array:
        if jnp.result_type(n) == jnp.bool_:  # a flag: one select, no conversion
            return _counters.increment_if(n, counter)
        return _counters.saturating_add(counter, n)

    return {name: add(read(name), n) for name, n in counts.items()}


# --------------------------------------------------------------------------- the engine


class Rules(NamedTuple):
    """What an accumulating transform hands the engine: its `inner`, when to release,
    the reduction, the replicas' axis, which gradients to skip, and its storage kinds.

    `means(updates)` says, for each leaf of a gradient (in its leaf order, an
    `IndexedSlices` whole), whether it is released as a mean; a leaf that combines by
    max or min has a storage kind of its own, which reads nothing from it."""

    inner: optax.GradientTransformation
    required: Callable[[jax.Array], jax.Array]
    means: Callable[[Any], tuple[bool, ...]]
    axis_name: Any
    skip_nonfinite: bool
    skip_rule: Callable[..., Any] | None
    kinds: tuple[Storage, ...]

    @classmethod
    def checked(
        cls,
        *,
        inner: Any,
        num_required: Any,
        means: Callable[[Any], tuple[bool, ...]],
        axis_name: Any,
        skip_nonfinite: Any,
        should_skip_update_fn: Any,
        kinds: tuple[Storage, ...],
    ) -> Rules:
        """The rules from a transform's public arguments, each checked (a bad one raises
        naming it)."""
        return cls(
            inner=_checks.require_transformation("inner", inner),
            required=_counters.num_required_fn(num_required),
            means=means,
            axis_name=_checks.require_axis_name("axis_name", axis_name),
            skip_nonfinite=_checks.require_bool("skip_nonfinite", skip_nonfinite),
            skip_rule=_checks.require_skip_rule(should_skip_update_fn),
            kinds=kinds,
        )


def init(rules: Rules, state_type: type, params: Any, kind_of: Callable[..., Storage], *more: Any):
    """The fresh state of an accumulating transform: its counters zero, a store per
    param leaf (`kind_of(param, *more_leaves)` picks its kind), and `inner`'s state made
    from the params typed plain. Each counter gets its own buffer, so the state can be
    donated as it comes."""
    _checks.require_floating_params(params)
    storage = jax.tree.map(lambda p, *m: kind_of(p, *m).empty(p), params, *more)
    fields: dict[str, Any] = {}
    for name in state_type._fields:
        if name == "emitted":
            fields[name] = jnp.asarray(False)
        elif name == "weight_sum":
            fields[name] = jnp.zeros((), _sums.WEIGHT_DTYPE)
        elif name not in ("storage", "inner_state"):
            fields[name] = _counters.int32(0)
    return state_type(
        **fields, storage=storage, inner_state=rules.inner.init(_unreduced.plain(params))
    )


def transformation(
    rules: Rules, state_type: type, init: Callable[[Any], Any]
) -> optax.GradientTransformationExtraArgs:
    """An accumulating transform: `init(params)` makes its `state_type` state (with
    `_engine.init`), and its step is `accumulate`, taking a wrapper's verdict."""

    def step(
        updates: optax.Updates,
        state: Any,
        params: optax.Params | None,
        call: _protocol.Call,
        *,
        local_step: Any = None,
        weight: Any = None,
        **extra_args: Any,
    ) -> _protocol.Result:
        _checks.require_state(state, state_type)
        return accumulate(
            rules,
            state,
            updates,
            params,
            call,
            local_step=local_step,
            weight=weight,
            extra_args=extra_args,
        )

    return _protocol.transformation(init, step, takes_verdict=True)


def accumulate(
    rules: Rules,
    state: Any,
    updates: Any,
    params: Any,
    call: _protocol.Call,
    *,
    local_step: Any,
    weight: Any,
    extra_args: dict[str, Any],
) -> _protocol.Result:
    """One step of an accumulating transform (see the module docstring).

    `state` has the fields `global_step`, `count`, `emitted`, `storage` and
    `inner_state`, one int32 field per counter its kinds count (`num_dropped`,
    `num_nonfinite`, `num_skipped`, and e.g. `num_overflowed`), and optionally a
    float32 `weight_sum` (the window's weight, for kinds that keep none per row).
    """
    if not call.checked:
        _extra_args.warn_misspelled(extra_args)
    layout = Layout.of_storage(rules.kinds, state.storage)
    stores = layout.stores(state.storage)
    grads = _check_updates(layout, updates, state.storage)
    step = _counters.local_step_or(local_step, state.global_step)
    w, weight_ok = _sums.weight_or_none(weight)
    finite = jnp.asarray(True)
    if rules.skip_nonfinite:
        flags = layout.map(lambda kind, g, s: kind.finite(g, s), grads, stores)
        finite = jnp.stack(flags).all() if flags else finite
    gate = judged(
        call.verdict,
        fresh=step >= state.global_step,
        finite=finite,
        weight_ok=weight_ok,
        rule=_sums.skip_rule(rules.skip_rule, updates, state.global_step, params),
    )
    offered = _per_replica(gate.offered, rules.axis_name)
    added = _added(layout, stores, grads, Offer(offered, w, rules.axis_name, state.emitted))
    arrivals = {
        "count": added.accepted,
        "num_dropped": gate.stale,
        "num_nonfinite": gate.nonfinite,
        "num_skipped": gate.skipped,
        **added.arrivals,
    }
    keeps_weight = "weight_sum" in state._fields
    accepted_weight = None
    if keeps_weight and w is not None:
        accepted_weight = jnp.where(added.accepted, w, jnp.zeros((), w.dtype))
    counts, weight_added = counted(arrivals, rules.axis_name, accepted_weight)
    accepted = counts.pop("count")
    count = _counters.saturating_add(state.count, accepted)
    weight_sum = None
    if keeps_weight:  # without weights, each accepted gradient weighs 1
        added_weight = accepted.astype(_sums.WEIGHT_DTYPE) if weight_added is None else weight_added
        weight_sum = state.weight_sum + added_weight
    emit = gate.passed(count >= rules.required(state.global_step))
    storage = layout.treedef.unflatten(added.stores)
    # The inner's updates are made in the release, not selected after it from the
    # inner's buffers, and typed like the params (reduced where a store is unreduced).
    retyped = any(_unreduced.unreduced_axes(x) for x in jax.tree.leaves(storage))
    spendable = all(layout.kinds[k].spendable for k in layout.of)
    # Released updates that travel in the stores' buffers (not applied in the branch)
    # are typed as the stores there (unreduced), and typed like the params after it.
    in_stores = retyped and spendable and not call.apply
    window = Window(tuple(rules.means(updates)), weight_sum, rules.axis_name)

    def release(inner_state: Any, storage: Any, params: Any, summed: Any = None) -> tuple:
        """The inner's updates and state; `summed`: the storage with its sums reduced
        already (`_spending.reduced_first`), which the kinds release, `storage` giving the
        updates' types."""
        stores = layout.stores(storage)
        aggregate = jax.tree.unflatten(
            jax.tree.structure(updates, is_leaf=_is_slices),
            _released(layout, stores if summed is None else layout.stores(summed), grads, window),
        )
        inner_call = _protocol.Call(defer=spendable and not (call.apply or retyped))
        result = _protocol.call_inner(
            rules.inner,
            aggregate,
            inner_state,
            _unreduced.plain(params),
            inner_call,
            **extra_args,
        )
        if result.selection is not None:
            return result.selection, result.state
        out = jax.tree.leaves(result.updates, is_leaf=_is_slices)
        out = layout.map(lambda kind, u, s: _spending.typed(kind, in_stores)(u, s), out, stores)
        return jax.tree.unflatten(layout.treedef, out), result.state

    if spendable:
        spent, put = _spending.spent(layout, storage)

        def spend(kept: Any, spent: Any, params: Any) -> tuple:
            reduced = _spending.reduced_first(layout, spent, emit)
            updates, kept = release(kept, put(spent), params, put(reduced.totals))
            if call.apply:
                return updates, kept, _spending.cleared(layout, reduced, spent, kept)
            return updates, kept, reduced.left

        branched = _branch.release_if(
            emit, spend, state.inner_state, spent, params, salt=count, apply=call.apply
        )
        if in_stores:
            branched = branched._replace(state=_spending.behind_barrier(branched.state))
        inner_state, storage = branched.state[0], put(branched.state[1])
        part = lambda s: (s.inner_state, _spending.spent(layout, s.storage)[0])  # noqa: E731
    else:
        branched = _branch.update_if(
            emit,
            lambda inner_state, params, storage: release(inner_state, storage, params),
            state.inner_state,
            params,
            salt=count,
            apply=call.apply,
            held=lambda zeros: _held(layout, zeros, stores),
            inputs=storage,  # read, not carried: the release does not change it
            carried=jax.tree.unflatten(
                layout.treedef, [layout.kinds[k].carries_params for k in layout.of]
            ),
        )
        inner_state = branched.state
        part = lambda s: s.inner_state  # noqa: E731
    after = layout.map(lambda kind, _, s: kind.after(s, emit), stores, layout.stores(storage))
    fields = {}
    if keeps_weight:
        fields["weight_sum"] = jnp.where(emit, jnp.zeros((), weight_sum.dtype), weight_sum)
    new_state = state._replace(
        global_step=_counters.increment_if(emit, state.global_step),
        count=jnp.where(emit, 0, count),
        emitted=gate.emitted(emit, state.emitted),
        storage=layout.treedef.unflatten(after),
        inner_state=inner_state,
        **tallied(state, counts),
        **fields,
    )
    updates = branched.updates
    if in_stores:
        updates = _spending.out_of_stores(updates)
    return _protocol.result_of(
        updates,
        new_state,
        call,
        part=part,
        params=branched.params,
        read_weight=weight is not None,
    )


def _per_replica(flag: jax.Array, axis_name: Any) -> jax.Array:
    """`flag` typed as each replica's own under `jax.shard_map` over `axis_name`: each
    replica accepts its own gradient, so what counts it (a dense leaf's per-row counts)
    is per replica even on a step whose tags happen to be the same everywhere."""
    if axis_name is None:
        return flag
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    _checks.require_bound_axis(axis_name)
    tracked = frozenset(n for n in names if n in _compat.varying_axes(lax.axis_index(n)))
    return _compat.make_varying(flag, tracked)


def _held(layout: Layout, zeros: Any, stores: list) -> Any:
    """A held step's updates: each kind's `held` of the zero updates."""
    leaves = jax.tree.leaves(zeros, is_leaf=_is_slices)
    out = layout.map(lambda kind, z, _: kind.held(z), leaves, stores)
    return jax.tree.unflatten(jax.tree.structure(zeros, is_leaf=_is_slices), out)


__all__ = [
    "Added",
    "Judged",
    "Offer",
    "Rules",
    "Storage",
    "Window",
    "accumulate",
    "counted",
    "init",
    "judged",
    "tallied",
    "transformation",
]
