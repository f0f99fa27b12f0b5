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
import optax

from optax_accum import (
    _checks,
    _counters,
    _engine,
    _reductions,
    _storages,
    _wire,
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
      storage: the buffers of the running sum of accepted gradients, shaped like the
        params, in the accumulator dtype (under an `axis_name`, each replica keeps the
        sum of its own gradients). While `emitted` is False they hold the sum; a
        release spends them (the released updates travel in them, on the CPU) and the
        next `update` starts from zeros, so right after a release they hold no sum.
        `optax_accum.accumulated(state)` reads the sum at every step. A leaf whose
        `reduction` is "max" or "min" holds a `RunningMax` or `RunningMin`: the
        window's running max (min), restarted the same way.
      inner_state: the wrapped optimizer's state.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state, local_step=0)
      >>> _, state = tx.update(jnp.ones(2), state, local_step=-1)  # stale
      >>> int(state.count), int(state.num_dropped), optax_accum.accumulated(state)
      (1, 1, Array([1., 1.], dtype=float32))
    """

    global_step: jax.Array
    count: jax.Array
    weight_sum: jax.Array
    num_dropped: jax.Array
    num_nonfinite: jax.Array
    num_skipped: jax.Array
    emitted: jax.Array
    storage: optax.Updates
    inner_state: optax.OptState


def conditional_accumulator(
    inner: optax.GradientTransformation,
    num_required: _counters.NumRequired,
    *,
    reduction: Any = "mean",
    accumulator_dtype: Any = None,
    axis_name: Any = None,
    skip_nonfinite: bool = False,
    should_skip_update_fn: Callable[..., Any] | None = None,
    communication_dtype: Any = None,
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

    With `communication_dtype` (bfloat16, int8 or float8_e4m3fn), the release's one
    reduction, over `axis_name` or over the mesh axes of params typed reduced, sends
    the window's sums in that type (int8 and float8 with a float32 scale per block of
    256 values, or per row where rows are longer): an all-to-all, a float32 sum of each
    replica's share, an all-gather, so no sum is taken in the narrow type and every
    replica gets the same bits. int8 and float8 send at most 1/3.9 of float32's bytes,
    bfloat16 half; the sums, the counts and `inner` stay in their own dtypes. Held
    steps are unchanged. docs/guide.md, "Quantized releases", has the error and costs.

    Leaves may combine differently: `reduction` can be a tree (or a function of the
    leaf path) of "mean", "sum", "max" and "min". A "max" leaf keeps the running
    elementwise max of the window's accepted gradients and releases it (an FP8 amax
    history: `optax.MultiSteps` would average it, so the scale is set from a mean of
    the micro-batches' maxima and clips the largest); "min" the min. A max has no
    weights: every accepted gradient takes part in it, whatever its `weight`. Under
    `axis_name` each replica keeps its own and the release takes one max over them;
    a held step moves nothing. Such a leaf takes dense gradients; on a param typed
    reduced, each device's own value typed unreduced (each device keeps its own max,
    the release takes one max over them; docs/guide.md, "Quantized releases and leaves
    that combine by max").

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
      reduction: "mean" (default), "sum", "max" or "min", in any case, for every
        leaf; or a tree of them shaped like the params (or a prefix of it, e.g.
        `{"params": "mean", "fp8_meta": "max"}`), or a function of a leaf's path (the
        key tuple `jax.tree_util.tree_flatten_with_path` gives) returning one. A
        "max" ("min") leaf whose param is typed reduced takes each device's own value
        (its gradient typed unreduced) and the release one max (min) over them.
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
      communication_dtype: the type the release's reduction sends the sums in: None
        (default: their own dtype, an all-reduce; float32 is the same),
        `jnp.bfloat16`, `jnp.int8` or `jnp.float8_e4m3fn`. Only a reduction across
        replicas or devices uses it (`axis_name`, params typed reduced); "max" and
        "min" leaves are reduced exactly.

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
      >>> import jax, jax.numpy as jnp, optax, optax_accum
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
      >>> # Per leaf: an amax statistic keeps the window's max, the weights their mean.
      >>> tx = optax_accum.conditional_accumulator(
      ...     optax.identity(), 2, reduction={"w": "mean", "amax": "max"})
      >>> state = tx.init({"w": jnp.zeros(2), "amax": jnp.zeros(1)})
      >>> _, state = tx.update({"w": jnp.ones(2), "amax": jnp.array([8.0])}, state)
      >>> u, state = tx.update({"w": jnp.zeros(2), "amax": jnp.array([2.0])}, state)
      >>> u["w"], u["amax"]
      (Array([0.5, 0.5], dtype=float32), Array([8.], dtype=float32))
      >>> # The release's reduction over replicas sent in int8 (a scale per 256 values).
      >>> tx = optax_accum.conditional_accumulator(
      ...     optax.identity(), 1, axis_name="i", communication_dtype=jnp.int8)
      >>> step = lambda g: tx.update(g, tx.init(g))[0]
      >>> jax.vmap(step, axis_name="i")(jnp.array([[1.0, 2.0], [3.0, -4.0]]))
      Array([[ 2.      , -1.007874],
             [ 2.      , -1.007874]], dtype=float32)
      >>> # The mean is [2, -1]: the sum's -2 went as -64 in steps of 4/127 (its max).
    """
    acc_dtype = _checks.floating_dtype("accumulator_dtype", accumulator_dtype)
    reductions = _reductions.Reduction.of(reduction)
    sums = _storages.dense_sum(
        acc_dtype, _wire.wire_dtype("communication_dtype", communication_dtype)
    )
    extrema = {how: _storages.extremum(how, acc_dtype) for how in _reductions.EXTREMA}
    rules = _engine.Rules.checked(
        inner=inner,
        num_required=num_required,
        means=reductions.means(),
        axis_name=axis_name,
        skip_nonfinite=skip_nonfinite,
        should_skip_update_fn=should_skip_update_fn,
        kinds=(sums, *extrema.values()),
    )

    def kind_of(param: Any, choice: _reductions.Choice) -> _engine.Storage:
        if choice.how in extrema:
            return extrema[choice.how]
        return sums

    def init_fn(params: optax.Params) -> ConditionalAccumulatorState:
        return _engine.init(
            rules, ConditionalAccumulatorState, params, kind_of, reductions.tree(params)
        )

    # A held step adds the gradient to the sum, in place, and passes the inner state on
    # untouched; the release feeds the sum to `inner` (see _engine and _branch).
    return _engine.transformation(rules, ConditionalAccumulatorState, init_fn)


__all__ = ["ConditionalAccumulatorState", "conditional_accumulator"]
