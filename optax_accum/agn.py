"""AGN: local SGD that syncs a shared centre every `communication_period` steps.

TF1's `tf.contrib.opt.AGNOptimizer` (Accumulated Gradient Normalization, Hermans et
al., ACML 2017) lets each worker take `communication_period` steps on its own
parameters, then commits the normalised sum of its gradients to a shared centre and
restarts from it. `agn` is that rule as an Optax transform: the workers are the
replicas of a mapped axis, the commit is one `pmean` that runs only on sync steps,
and the centre lives in the state, so it checkpoints with everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _compat,
    _counters,
    _engine,
    _extra_args,
    _protocol,
    _storages,
    _streaming,
    _sums,
    _wire,
)

_COMMITS = ("gradients", "delta")


class AGNState(NamedTuple):
    """State of `agn`.

    Attributes:
      global_step: int32, communication rounds so far (TF's global step); with
        `fragments`, the fragment syncs so far (P of them per period).
      count: int32, local steps since the last sync (0 right after one), so
        `num_accumulated(state)` is the number of gradients in this round. With
        `fragments`, the local steps into the current period: 1 to
        `communication_period` (0 before the first step), the schedule every
        fragment's sync reads.
      num_nonfinite: int32, gradients skipped for holding a NaN or Inf (only with
        `skip_nonfinite=True`) in the rounds completed so far, summed over the
        replicas at each sync, so it is the same on every replica.
      round_nonfinite: int32 of shape (1,), this replica's skipped gradients in the
        current round (added to `num_nonfinite` at the next sync). A vector, so that
        under `jax.shard_map` the workers' counts can be split over the mesh axis.
      num_skipped: int32, gradients skipped by `should_skip_update_fn` in the rounds
        completed so far, summed over the replicas at each sync (a non-finite gradient
        under `skip_nonfinite=True` counts in `num_nonfinite` only).
      round_skipped: int32 of shape (1,), this replica's gradients skipped by the rule
        in the current round (added to `num_skipped` at the next sync).
      emitted: bool, whether the last `update` was a sync step (the centre moved and
        the local parameters were pulled to it; with `fragments`, a fragment's centre
        moved, and with a `delay` the local parameters take it later).
      storage: the buffers of the sum of this round's raw gradients, in the
        accumulator dtype (this replica's own); empty in the delta variant, which needs
        no sum. While `emitted` is False they hold the sum; right after a sync they
        still hold the last round's, which the next `update` does not read (it starts
        from zeros). `optax_accum.accumulated(state)` reads this round's sum.
      centre: the shared centre parameters (TF's global centre variables); the same on
        every replica. With a `delay`, a fragment's centre moves in the step that
        reduces its pseudo-gradient (the step after its sync step) and the local
        parameters take it `delay` steps after the sync step.
      inner_state: the local optimizer's state (this replica's own), kept across syncs.
      outer_state: the state of the optimizer that moves the centre; with
        `fragments`, a tuple of one state per fragment, each made by `outer.init` on
        the params with an `optax.MaskedNode` in place of the other fragments' leaves
        (a fragment's schedules count its own syncs).

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.agn(optax.sgd(0.1), communication_period=2)
      >>> params = jnp.ones(2)
      >>> state = tx.init(params)
      >>> u, state = tx.update(jnp.ones(2), state, params)  # a local step
      >>> int(state.count), int(state.global_step), state.centre
      (1, 0, Array([1., 1.], dtype=float32))
    """

    global_step: jax.Array
    count: jax.Array
    num_nonfinite: jax.Array
    round_nonfinite: jax.Array
    num_skipped: jax.Array
    round_skipped: jax.Array
    emitted: jax.Array
    storage: optax.Updates
    centre: optax.Params
    inner_state: optax.OptState
    outer_state: optax.OptState


def _canonical_commit(commit: Any) -> str:
    if isinstance(commit, str) and commit.lower() in _COMMITS:
        return commit.lower()
    raise ValueError(f'commit must be "gradients" or "delta", got {commit!r}')


def agn(
    inner: optax.GradientTransformation,
    communication_period: int,
    *,
    axis_name: Any = None,
    outer: optax.GradientTransformation | None = None,
    commit: str = "gradients",
    accumulator_dtype: Any = None,
    skip_nonfinite: bool = False,
    should_skip_update_fn: Callable[..., Any] | None = None,
    fragments: Any = None,
    delay: int = 0,
    blend: float = 0.0,
    communication_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Local SGD with a centre that moves every `communication_period` steps (AGN).

    Each `update` is one local step: `inner` updates this worker's own parameters
    (the `params` argument, required), the raw gradient is added to an accumulator,
    and `count` advances. Every `communication_period`-th step is a sync step: the
    accumulator divided by the period (the "normalised accumulated gradient") is
    averaged over `axis_name`, `outer` moves the centre with it, `global_step`
    advances, the accumulator resets, and the returned updates take `params` to the
    new centre (`params + updates` is the centre up to the rounding of one
    subtraction; exact whenever the two are within a factor of two). The local
    optimizer's state is kept across syncs, as in TF.

    Only sync steps communicate: the `pmean` and `outer` run only when the step
    counter, the same on every replica, says so, so a local step runs no collective
    and costs `inner` plus one accumulation pass. Initialise every replica from the
    same params (TF's `get_init_op`), so that they start from, and keep, the same
    centre. Under `jax.shard_map`, `state_partition_specs(tx, params, mesh,
    param_axes=(axis,))` gives the state's specs: the accumulator and `inner_state`
    are per worker, the centre, `outer_state` and the counters are replicated.

    Two commits are offered:

    - `commit="gradients"` (default, TF's): the centre follows the averaged gradient
      sum through `outer`, by default the same optimizer as `inner` with its own
      state. The right choice to reproduce TF, and when the centre should take
      optimizer steps of its own (e.g. Adam on the averaged gradient).
    - `commit="delta"` (the paper's, and DiLoCo's): the pseudo-gradient is
      `(centre - local) / communication_period`, where `local` is this step's updated
      local parameters, so everything `inner` did (momentum, Adam scaling, weight
      decay, clipping) reaches the centre. `outer` defaults to `optax.sgd(1.0)`, the
      paper's rule; `optax.sgd(communication_period)` is plain model averaging (the
      centre becomes the mean of the local parameters), and DiLoCo is
      `optax.sgd(0.7 * communication_period, momentum=0.9, nesterov=True)`. It needs
      no accumulator. Right for adaptive or momentum `inner` optimizers, whose
      steps are not proportional to the gradient. For `inner=optax.sgd(lr)` with a
      constant `lr`, the delta commit with `outer=optax.sgd(lr_out / lr)` equals the
      gradient commit with `outer=optax.sgd(lr_out)`.

    **Streaming DiLoCo** (Douillard et al., arXiv 2501.18512): with `fragments`, the
    params are split into P fragments (sets of leaves), and each syncs every
    `communication_period` steps at its own offset, `(p + 1) * period / P` steps into
    each period, so a sync moves one fragment, one every `period / P` steps: the peak
    bytes per sync fall P-fold, the total per period stays. The pseudo-gradient is
    normalised by the period as above, and each fragment's centre has its own `outer`
    state. With `delay` V >= 1 the pseudo-gradient reduced is the one the step is
    given (the local params after the sync step, known before this step's gradient),
    so the reduction can overlap the step's forward and backward passes, and the new
    centre is blended into the local params V steps after the sync step; `blend` alpha
    keeps that share of the local params, `alpha * local + (1 - alpha) * centre` (0:
    every worker restarts from the centre). When every step syncs a fragment
    (`communication_period == P` and V >= 1), the fragment's pseudo-gradient is laid out
    in one flat buffer as long as the largest fragment and reduced on every step
    outside any branch; otherwise each sync runs in a branch of its own. `delay=0`,
    `blend=0.0` and `fragments=1` are DiLoCo (or TF's AGN) again.

    Either way the centre moves once per round by about one step's worth, so with the
    default `outer` the centre advances `communication_period` times fewer steps than
    synchronous SGD on the same data; scale `outer`'s learning rate by the period to
    compensate (see `benchmarks/agn.py`).

    TF counterpart: `tf.contrib.opt.AGNOptimizer(optimizer, num_worker,
    communication_period)`. Differences from TF: the local and centre optimizer states
    are separate (TF shares Adam's beta powers between them, a bug); workers are the
    replicas of `axis_name` rather than parameter-server tasks, and average their
    commits instead of applying them one by one; `num_worker` is not needed; `outer` and
    `commit` are additions.

    Args:
      inner: the local optimizer each worker runs on its own parameters every step.
      communication_period: a positive int, local steps per communication round.
      axis_name: optional name (or tuple of names) of the mapped axis whose replicas
        are the workers (inside `jax.pmap`, `jax.shard_map` or `jax.vmap`).
      outer: the optimizer that moves the centre; its schedules count rounds. Default:
        `inner` (with its own state) for `commit="gradients"`, `optax.sgd(1.0)` for
        `commit="delta"`.
      commit: "gradients" (TF's AGN, default) or "delta" (the paper's and DiLoCo's).
      accumulator_dtype: the dtype of the gradient sum. Default: float32 for float16
        and bfloat16 params, the params' dtype otherwise.
      skip_nonfinite: if True, a gradient holding any NaN or Inf is skipped (the local
        step still counts, so replicas stay in step, but neither `inner` nor the
        accumulator sees it) and counted in `round_nonfinite`, then in
        `num_nonfinite` at the sync. By default it is used as given, as TF does.
      should_skip_update_fn: optional rule with `optax.MultiSteps`' signature,
        `(updates, gradient_step, params) -> bool` (or its pair of a bool and a
        debugging tree, which is discarded), called with the gradient, `global_step`
        (the rounds so far) and this worker's `params`. A gradient it skips is left
        out as `skip_nonfinite` leaves out a non-finite one (the local step still
        counts, so the replicas stay in step) and is counted in `round_skipped`,
        then in `num_skipped` at the sync.
      fragments: None (the whole model syncs at once), an int P (P fragments balanced
        by size: the largest leaves first, each to the fragment with the fewest
        elements), a tree like the params of fragment numbers 0 .. P-1, or a function
        of a leaf's path (its `jax.tree_util` keys) returning its fragment number.
        `communication_period` must be a multiple of P.
      delay: V, an int in [0, communication_period]: the steps between a fragment's
        sync step and the step whose local params take the new centre. 0: the same
        step (the reduction then reads this step's own local update). Needs
        `fragments`.
      blend: alpha in [0, 1], the share of the local params kept when a fragment's new
        centre is taken (the paper's mixing). Needs `fragments`.
      communication_dtype: None (the reduction in the pseudo-gradient's dtype),
        `jnp.bfloat16`, `jnp.int8` or `jnp.float8_e4m3fn`: the sync's values travel in
        that type (int8 and float8 with a float32 scale per block of 256 values), as an
        all-to-all, a float32 sum and an all-gather, so no sum is taken in the narrow
        type; the centre and `outer` stay in their own dtypes. Needs `axis_name`.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is an `AGNState`.
      Extra arguments are passed on to `inner` and `outer`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; at trace time, when
        `params` is missing, for gradients or params whose structure, shapes or
        dtypes do not match the params given to `init`, and for a rule that does not
        return a bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.agn(optax.sgd(0.1), communication_period=3)
      >>> params = jnp.array([1.0])
      >>> state = tx.init(params)
      >>> for t in (1.0, 2.0, 3.0):  # gradient t at local step t
      ...     updates, state = tx.update(jnp.array([t]), state, params)
      ...     params = optax.apply_updates(params, updates)
      ...     print(round(float(params[0]), 4), int(optax_accum.global_step(state)))
      0.9 0
      0.7 0
      0.8 1
      >>> float(state.centre[0])  # 1 - 0.1 * (1 + 2 + 3) / 3
      0.8

      Streaming, two fragments: "w" syncs at steps 1, 3, ..., "b" at 2, 4, ...

      >>> tx = optax_accum.agn(optax.sgd(0.1), 2, fragments={"w": 0, "b": 1}, commit="delta")
      >>> params = {"w": jnp.array([1.0]), "b": jnp.array([1.0])}
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     updates, state = tx.update({"w": jnp.ones(1), "b": jnp.ones(1)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      ...     print(float(state.centre["w"][0]), float(state.centre["b"][0]))
      0.95 1.0
      0.95 0.9
    """
    inner = _checks.require_transformation("inner", inner)
    period = _checks.require_positive_int("communication_period", communication_period)
    axis_name = _checks.require_axis_name("axis_name", axis_name)
    commit = _canonical_commit(commit)
    delta = commit == "delta"
    if outer is not None:
        _checks.require_transformation("outer", outer, optional=True)
    if outer is None:
        outer = optax.sgd(1.0) if delta else inner
    acc_dtype = _checks.floating_dtype("accumulator_dtype", accumulator_dtype)
    skip_nonfinite = _checks.require_bool("skip_nonfinite", skip_nonfinite)
    skip_rule = _checks.require_skip_rule(should_skip_update_fn)
    wire = _wire.wire_dtype("communication_dtype", communication_dtype)
    if wire is not None and axis_name is None:
        raise ValueError(
            f"communication_dtype={np.dtype(wire).name} needs axis_name: without workers "
            "to average over, agn sends nothing"
        )
    delay, blend = _streaming.checked_args(fragments, period, delay, blend)

    sums = _storages.dense_sum(acc_dtype)

    def sum_dtype(x: Any) -> Any:
        return _sums.accumulator_dtype_for(jnp.result_type(x), acc_dtype)

    def reduced_mean(tree: Any) -> Any:
        """The workers' mean of `tree` (in `communication_dtype` on the wire)."""
        if axis_name is None:
            return tree
        if wire is None:
            return lax.pmean(tree, axis_name)
        return _wire.reduced(tree, axis_name, communication_dtype=wire, mean=True)

    def layout_of(params: Any) -> _streaming.Layout | None:
        if fragments is None:
            return None
        layout = _streaming.layout(fragments, params)
        if period % layout.count:
            raise ValueError(
                f"communication_period={period} must be a multiple of the number of "
                f"fragments, {layout.count}: each fragment syncs every {period} steps, "
                f"one every {period} / {layout.count} steps (choose a period of "
                f"{_streaming.multiples(period, layout.count)})"
            )
        return layout

    def init_fn(params: optax.Params) -> AGNState:
        _checks.require_floating_params(params)
        _reject_reduced(params)
        layout = layout_of(params)
        # Built from the params: under shard_map the sum varies over the mesh axes the
        # params vary over, so the state's types are the same before and after update.
        storage = () if delta else jax.tree.map(sums.empty, params)
        leaves, treedef = jax.tree.flatten(params)
        like = leaves[0] if leaves else jnp.zeros(())
        if layout is None:
            outer_state = outer.init(params)
        else:  # each fragment's own outer state, over its leaves only
            outer_state = tuple(
                outer.init(_streaming.masked([leaves[i] for i in m], m, treedef))
                for m in layout.members
            )
        return AGNState(
            global_step=_counters.int32(0),  # one buffer per field, so state can be donated
            count=_counters.int32(0),
            num_nonfinite=_counters.int32(0),
            round_nonfinite=jnp.zeros_like(like, jnp.int32, shape=(1,)),
            num_skipped=_counters.int32(0),
            round_skipped=jnp.zeros_like(like, jnp.int32, shape=(1,)),
            emitted=jnp.asarray(False),
            storage=storage,
            centre=jax.tree.map(_copy, params),
            inner_state=inner.init(params),
            outer_state=outer_state,
        )

    def counted_rounds(skipped: Any) -> Any:
        """The round's skip counts summed over the workers (one all-reduce for both)
        and added to the totals; the round's counts restart."""
        (num_nonfinite, num_skipped), rounds = skipped
        counts, _ = _engine.counted(
            {"num_nonfinite": rounds[0][0], "num_skipped": rounds[1][0]}, axis_name
        )
        totals = {"num_nonfinite": num_nonfinite, "num_skipped": num_skipped}
        num_nonfinite, num_skipped = _engine.tallied(totals, counts).values()
        return (num_nonfinite, num_skipped), jax.tree.map(jnp.zeros_like, rounds)

    def moved_centre(
        pseudo: Any, centre: Any, outer_state: Any, extra_args: dict
    ) -> tuple[Any, Any]:
        """`outer`'s step of the centre on the workers' mean pseudo-gradient."""
        pseudo = optax.tree.cast_like(pseudo, centre)
        moved = _protocol.call_inner(
            outer, pseudo, outer_state, centre, _protocol.Call(), **extra_args
        )
        return optax.apply_updates(centre, moved.updates), moved.state

    streaming = _streaming.Rules(
        period, delay, blend, delta, axis_name, sums, sum_dtype, reduced_mean, moved_centre,
        counted_rounds if skip_nonfinite or skip_rule is not None else None,
    )  # fmt: skip

    def step(
        updates: optax.Updates,
        state: AGNState,
        params: optax.Params | None,
        call: _protocol.Call,
        **extra_args: Any,
    ) -> _protocol.Result:
        if params is None:
            raise ValueError(
                "agn needs params: call update(grads, state, params) with this worker's "
                "current (local) parameters, got params=None"
            )
        _checks.require_state(state, AGNState)
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        _checks.check_tree_matches(updates, state.centre, what="updates")
        _checks.check_tree_matches(params, state.centre, what="params")
        _reject_reduced(params)
        if axis_name is not None:
            _checks.require_bound_axis(axis_name)
        layout = layout_of(params)

        local = _protocol.call_inner(
            inner, updates, state.inner_state, params, _protocol.Call(), **extra_args
        )
        local_updates, inner_state = local.updates, local.state
        # Gradients in another dtype than the params may change the dtypes of `inner`'s
        # state (Adam's moments); the state keeps its own, as optax.MultiSteps does.
        inner_state = optax.tree.cast_like(inner_state, state.inner_state)
        finite = _sums.all_finite(updates) if skip_nonfinite else jnp.asarray(True)
        rule = _sums.skip_rule(skip_rule, updates, state.global_step, params)
        # Every gradient is fresh (a local step has no tag); the gate keeps it or skips it.
        gate = _engine.judged(
            None, fresh=jnp.asarray(True), finite=finite, weight_ok=jnp.asarray(True), rule=rule
        )
        kept = gate.offered
        skips = skip_nonfinite or rule is not None
        if skips:
            local_updates = _sums.tree_select(
                kept, local_updates, optax.tree.zeros_like(local_updates)
            )
            inner_state = _sums.tree_select(kept, inner_state, state.inner_state)
        # This round's skips, counted on this replica alone: no collective on a local step.
        this_round = {}
        if skip_nonfinite:
            this_round["round_nonfinite"] = gate.nonfinite
        if rule is not None:
            this_round["round_skipped"] = gate.skipped
        rounds = _engine.tallied(state, this_round)
        skipped = (
            (state.num_nonfinite, state.num_skipped),
            (
                rounds.get("round_nonfinite", state.round_nonfinite),
                rounds.get("round_skipped", state.round_skipped),
            ),
        )
        if layout is not None:
            new_updates, new_state = _streaming.step(
                streaming, layout, updates, state, params, local_updates, inner_state,
                kept, skipped, extra_args,
            )  # fmt: skip
            _protocol.watch_weight(
                "agn", call, local.read_weight, inner, updates, state.inner_state, params,
                extra_args,
            )  # fmt: skip
            return _protocol.Result(new_updates, new_state, read_weight=local.read_weight)
        storage = state.storage
        if not delta:  # the sum restarts after a sync (see `_sums.restarted`)
            offer = _engine.Offer(kept, None, None, state.emitted)
            added = sums.add(jax.tree.leaves(storage), jax.tree.leaves(updates), offer)
            storage = jax.tree.unflatten(jax.tree.structure(storage), added.stores)
        count = state.count + 1
        sync = count >= period

        def commit_round(carry):
            centre, outer_state, skipped = carry
            if delta:
                local = optax.apply_updates(params, local_updates)
                pseudo = jax.tree.map(
                    lambda c, p: (c.astype(sum_dtype(c)) - p.astype(sum_dtype(c))) / period,
                    centre,
                    local,
                )
            else:
                pseudo = jax.tree.map(lambda a: a / period, storage)
            centre, outer_state = moved_centre(
                reduced_mean(pseudo), centre, outer_state, extra_args
            )
            if skips:  # both rounds' counts in one all-reduce
                skipped = counted_rounds(skipped)
            return centre, outer_state, skipped

        centre, outer_state, skipped = _branch.apply_if(
            sync, commit_round, (state.centre, state.outer_state, skipped)
        )
        (num_nonfinite, num_skipped), (round_nonfinite, round_skipped) = skipped
        pull = optax.tree.cast_like(jax.tree.map(lambda c, p: c - p, centre, params), local_updates)
        new_updates = _sums.tree_select(sync, pull, local_updates)
        new_state = AGNState(
            global_step=_counters.increment_if(sync, state.global_step),
            count=jnp.where(sync, 0, count),
            num_nonfinite=num_nonfinite,
            round_nonfinite=round_nonfinite,
            num_skipped=num_skipped,
            round_skipped=round_skipped,
            emitted=sync,
            storage=storage,
            centre=centre,
            inner_state=inner_state,
            outer_state=outer_state,
        )
        _protocol.watch_weight(
            "agn", call, local.read_weight, inner, updates, state.inner_state, params, extra_args
        )
        return _protocol.Result(new_updates, new_state, read_weight=local.read_weight)

    return _protocol.transformation(init_fn, step)


def _copy(param: Any) -> Any:
    """The centre's leaf: a copy of the param (outside jit, asarray would alias the
    params' buffers, and a train step that donates both params and state would donate
    them twice); zeros of its type for a `jax.ShapeDtypeStruct`, whose values are not
    known (the state of such an init gives shapes and shardings, e.g. a restore's
    target)."""
    if isinstance(param, jax.ShapeDtypeStruct):
        return jnp.zeros_like(param)
    return jnp.copy(param)


def _reject_reduced(params: Any) -> None:
    """A clear error for params typed reduced (`optax_accum.as_reduced`)."""
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        if _compat.sum_types(p)[0]:
            raise TypeError(
                f"agn cannot take params typed reduced (params{jax.tree_util.keystr(path)} "
                f"is {jax.typeof(p)}): every local step applies this worker's own gradient "
                "to its params, so there is no sum to defer. Give agn plain params (each "
                "worker's gradient reduced over its own batch axes), or accumulate the "
                "local steps first with an accumulator inside: agn(conditional_accumulator("
                "inner, k), ...)"
            )


__all__ = ["AGNState", "agn"]
