"""The functional ConditionalAccumulator: step-tagged gradient accumulation.

TF1's `tf.ConditionalAccumulator` collects gradients tagged with the step they were
computed at, silently drops stale ones, and releases their mean (or sum) once enough
have arrived. `conditional_accumulator` is the same rule as a pure, jit-able Optax
transform: the release feeds a wrapped optimizer, which runs only on releasing steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _counters,
    _extra_args,
    _gate,
    _protocol,
    _sums,
    _unreduced,
)


class ConditionalAccumulatorState(NamedTuple):
    """State of `conditional_accumulator`.

    Attributes:
      global_step: int32, the number of updates released so far (TF's global step).
        A gradient is accepted iff its `local_step >= global_step`.
      count: int32, accepted gradients since the last release (summed over replicas
        under an `axis_name`).
      weight_sum: float32, the sum of the accepted gradients' `weight`s since the last
        release (each 1 by default, so then it equals `count`; summed over replicas).
      num_dropped: int32, stale gradients dropped so far (summed over replicas).
      num_nonfinite: int32, gradients skipped for holding a NaN or Inf (only with
        `skip_nonfinite=True`; summed over replicas).
      num_skipped: int32, fresh gradients skipped by `should_skip_update_fn`, or for a
        traced `weight` that is negative, NaN or infinite (summed over replicas). A
        non-finite gradient under `skip_nonfinite=True` counts in `num_nonfinite` only.
      emitted: bool, whether the last `update` released an update.
      accumulator: the running sum of accepted gradients, in the accumulator dtype
        (under an `axis_name`, each replica holds the sum of its own gradients). A
        release spends it: while `emitted` is True it holds no sum (on the CPU, the
        released updates travel in its buffers) and the next `update` starts from
        zeros. `optax_accum.accumulated(state)` reads the sum, zeros after a release.
      inner_state: the wrapped optimizer's state.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state, local_step=0)
      >>> _, state = tx.update(jnp.ones(2), state, local_step=-1)  # stale
      >>> int(state.count), int(state.num_dropped), state.accumulator
      (1, 1, Array([1., 1.], dtype=float32))
    """

    global_step: jax.Array
    count: jax.Array
    weight_sum: jax.Array
    num_dropped: jax.Array
    num_nonfinite: jax.Array
    num_skipped: jax.Array
    emitted: jax.Array
    accumulator: optax.Updates
    inner_state: optax.OptState


def conditional_accumulator(
    inner: optax.GradientTransformation,
    num_required: _counters.NumRequired,
    *,
    reduction: str = "mean",
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    skip_nonfinite: bool = False,
    should_skip_update_fn: Callable[..., Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Accumulates step-tagged gradients and releases their mean to `inner`.

    Each `update` offers one gradient, tagged with the extra argument `local_step`
    (the global step it was computed at; omitted means up to date). It is accepted
    iff `local_step >= global_step`; a stale gradient is dropped, counted in
    `num_dropped`, and changes nothing else. Once `count` accepted gradients reach
    `num_required`, their aggregate is released: MEAN divides the sum by `count`
    (all accepted gradients), SUM does not. `inner` transforms the release, its
    updates are returned, `global_step` advances by one, and the aggregate resets.
    On every other step the updates are zeros, and `inner` neither runs nor changes.

    A gradient may carry a `weight` (extra argument: a non-negative scalar, 1 if
    omitted), e.g. the number of tokens its micro-batch held. MEAN then releases
    `sum(weight * g) / sum(weight)` over the accepted gradients, SUM `sum(weight * g)`;
    a window whose weights sum to 0 releases zeros. A release still comes after
    `num_required` accepted gradients, whatever their weights. A gradient that is not
    accepted adds no weight; one of weight 0 adds nothing to the sum, not even a NaN.

    With `axis_name`, the accumulator is shared by the replicas of that axis (inside
    `jax.pmap`, `jax.shard_map` or `jax.vmap`). Each replica offers its own gradient
    with its own `local_step` and keeps its own running sum. Every step sums the
    acceptance counts across replicas (one all-reduce of 4 numbers, 5 with a
    `weight`), so all replicas release together; only a releasing step sums the
    replicas' gradients: one all-reduce per leaf, which XLA may pack into one, inside
    the release's branch on every backend (the CPU's loop form included). A held
    step moves nothing gradient-sized across replicas. A straggler whose gradient is
    stale is simply not counted: TF's backup workers.

    Under `jax.jit` with explicit sharding, a param typed reduced over mesh axes
    (`optax_accum.as_reduced`) gets a running sum typed unreduced over them, which
    takes the unreduced gradients `jax.grad` (or `optax_accum.unreduced_grad`) gives
    for it: a held step adds each device's partial sum locally and moves nothing
    across those axes; the release reduces the window's sum, one all-reduce per leaf
    (which XLA may pack into one), inside its branch. `inner` then runs on the plain,
    reduced values, and the updates come back typed as the params.

    TF counterpart: `tf.ConditionalAccumulator` (its `apply_grad`, `take_grad` and
    `set_global_step`), as used by `tf.train.SyncReplicasOptimizer`. Differences from
    TF: it is a transform, not a blocking queue (see `ConditionalAccumulator` for
    that); malformed gradients raise even when stale; float16/bfloat16 accumulate in
    float32 by default; a non-finite value in a dropped gradient never reaches the
    state (selection, not a 0/1 multiply).

    Cost: a held step adds the gradient to the sum (in place, when the update is
    jitted with the state donated); `inner` runs on releasing steps only. `update` can
    be forward- but not reverse-mode differentiated on the CPU. `docs/design.md` says
    how the held and released steps compile on each backend.

    Args:
      inner: the optimizer that transforms each released aggregate.
      num_required: a positive int, or a schedule `f(global_step) -> int` (as
        `optax.MultiSteps`' `every_k_schedule`).
      reduction: "mean" (default) or "sum", in any case.
      accumulator_dtype: the dtype of the running sum. Default: float32 for float16
        and bfloat16 params, the params' dtype otherwise. Updates come back in the
        gradients' dtypes.
      axis_name: optional name (or tuple of names) of a mapped axis whose replicas
        share the accumulator.
      skip_nonfinite: if True, a gradient holding any NaN or Inf is skipped (neither
        accumulated nor counted as accepted) and counted in `num_nonfinite`. By
        default it is accumulated as given, as TF does.
      should_skip_update_fn: optional rule with `optax.MultiSteps`' signature,
        `(updates, gradient_step, params) -> bool` (or `optax.MultiSteps`' pair of
        a bool and a debugging tree, which is discarded), called with the gradient,
        `global_step` and the `params` given to `update`: `optax.skip_not_finite`,
        say, or `functools.partial(optax.skip_large_updates, max_squared_norm=...)`.
        A fresh gradient it skips is neither accumulated nor counted as accepted, and
        is counted in `num_skipped`; nothing else changes.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `ConditionalAccumulatorState`.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; at trace time, for
        gradients whose structure, shapes or dtypes do not match the params, for a
        non-integer or non-scalar `local_step`, for a non-scalar `weight` or a
        concrete one that is negative or not finite (a traced one cannot raise: its
        gradient is skipped and counted in `num_skipped`), and for a rule that does
        not return a bool scalar.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> u, state = tx.update(jnp.array([1.0, 2.0]), state, local_step=0)
      >>> u  # held: zeros
      Array([0., 0.], dtype=float32)
      >>> u, state = tx.update(jnp.array([9.0, 9.0]), state, local_step=-1)  # stale
      >>> u, state = tx.update(jnp.array([3.0, 4.0]), state, local_step=0)
      >>> u  # minus the mean of the two accepted gradients
      Array([-2., -3.], dtype=float32)
      >>> int(optax_accum.global_step(state)), int(state.num_dropped)
      (1, 1)
      >>> # Weighted: (1 * [1, 2] + 3 * [3, 4]) / (1 + 3)
      >>> _, state = tx.update(jnp.array([1.0, 2.0]), state, weight=1)
      >>> u, state = tx.update(jnp.array([3.0, 4.0]), state, weight=3)
      >>> u
      Array([-2.5, -3.5], dtype=float32)
    """
    inner = _checks.require_transformation("inner", inner)
    required = _counters.num_required_fn(num_required)
    mean = _checks.canonical_reduction(reduction) == "mean"
    acc_dtype = _checks.floating_dtype("accumulator_dtype", accumulator_dtype)
    axis_name = _checks.require_axis_name("axis_name", axis_name)
    skip_nonfinite = _checks.require_bool("skip_nonfinite", skip_nonfinite)
    skip_rule = _checks.require_skip_rule(should_skip_update_fn)

    def init_fn(params: optax.Params) -> ConditionalAccumulatorState:
        _checks.require_floating_params(params)
        # Each counter gets its own buffer, so the state can be donated as it comes.
        return ConditionalAccumulatorState(
            global_step=_counters.int32(0),
            count=_counters.int32(0),
            weight_sum=jnp.zeros((), _sums.WEIGHT_DTYPE),
            num_dropped=_counters.int32(0),
            num_nonfinite=_counters.int32(0),
            num_skipped=_counters.int32(0),
            emitted=jnp.asarray(False),
            accumulator=jax.tree.map(lambda p: _sums.zeros_accumulator(p, acc_dtype), params),
            inner_state=inner.init(_unreduced.plain(params)),
        )

    def step(
        updates: optax.Updates,
        state: ConditionalAccumulatorState,
        params: optax.Params | None,
        call: _protocol.Call,
        *,
        local_step: Any = None,
        weight: Any = None,
        **extra_args: Any,
    ) -> _protocol.Result:
        _checks.require_state(state, ConditionalAccumulatorState)
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        _checks.check_tree_matches(updates, state.accumulator, what="updates")
        _unreduced.check_sum_types(updates, state.accumulator)
        step = _counters.local_step_or(local_step, state.global_step)
        w, weight_ok = _sums.weight_or_none(weight)
        judged = _gate.judged(
            call.verdict,
            fresh=step >= state.global_step,
            finite=_sums.all_finite(updates) if skip_nonfinite else jnp.asarray(True),
            weight_ok=weight_ok,
            rule=_sums.skip_rule(skip_rule, updates, state.global_step, params),
        )
        accepted = judged.offered
        arrived = jnp.stack([accepted, judged.stale, judged.nonfinite, judged.skipped])
        arrived = arrived.astype(jnp.int32)
        # Without a weight, each accepted gradient weighs 1. With one, the weight joins
        # the counts in one float32 all-reduce (the counts, at most one per replica, are
        # exact in float32).
        added = None if w is None else jnp.where(accepted, w, jnp.zeros((), w.dtype))
        if axis_name is not None:
            _checks.require_bound_axis(axis_name)
            if added is None:
                arrived = lax.psum(arrived, axis_name)
            else:
                summed = lax.psum(jnp.append(arrived.astype(w.dtype), added), axis_name)
                arrived, added = summed[:-1].astype(jnp.int32), summed[-1]
        if added is None:
            added = arrived[0].astype(_sums.WEIGHT_DTYPE)
        count = _counters.saturating_add(state.count, arrived[0])
        weight_sum = state.weight_sum + added
        emit = judged.passed(count >= required(state.global_step))
        accumulator = jax.tree.map(
            lambda a, g: _sums.continued(a, state.emitted, accepted, g, w),
            state.accumulator,
            updates,
        )
        # Updates typed reduced (reduced params) are made in the release, not selected
        # after it from the inner's plain buffers.
        retyped = any(_unreduced.unreduced_axes(a) for a in jax.tree.leaves(accumulator))

        # A held step is the addition above, in place, and passes the inner state and
        # the sum on untouched; the release feeds the sum to `inner`, and the next step
        # restarts the sum (see _branch).
        def release(inner_state, accumulator, params):
            # An unreduced sum (under jit) is reduced here, once a window; the inner
            # optimizer runs on plain values, its updates typed as the params are.
            total = jax.tree.map(_unreduced.reduced_sum, accumulator)
            if axis_name is not None:
                total = lax.psum(total, axis_name)
            if mean:
                divide = _sums.mean_divider(weight_sum, jax.tree.leaves(total))
                total = jax.tree.map(divide, total)
            aggregate = optax.tree.cast_like(total, updates)
            inner_call = _protocol.Call(defer=not (call.apply or retyped))
            result = _protocol.call_inner(
                inner, aggregate, inner_state, _unreduced.plain(params), inner_call, **extra_args
            )
            if result.selection is not None:
                return result.selection, result.state
            return _unreduced.like_params(result.updates, accumulator), result.state

        branched = _branch.release_if(
            emit, release, state.inner_state, accumulator, params, salt=count, apply=call.apply
        )
        inner_state, accumulator = branched.state
        new_state = ConditionalAccumulatorState(
            global_step=_counters.increment_if(emit, state.global_step),
            count=jnp.where(emit, 0, count),
            weight_sum=jnp.where(emit, jnp.zeros((), weight_sum.dtype), weight_sum),
            num_dropped=_counters.saturating_add(state.num_dropped, arrived[1]),
            num_nonfinite=_counters.saturating_add(state.num_nonfinite, arrived[2]),
            num_skipped=_counters.saturating_add(state.num_skipped, arrived[3]),
            emitted=judged.emitted(emit, state.emitted),
            accumulator=accumulator,
            inner_state=inner_state,
        )
        return _protocol.result_of(
            branched.updates,
            new_state,
            call,
            part=lambda s: (s.inner_state, s.accumulator),
            params=branched.params,
            read_weight=weight is not None,
        )

    return _protocol.transformation(init_fn, step, takes_verdict=True)


__all__ = ["ConditionalAccumulatorState", "conditional_accumulator"]
