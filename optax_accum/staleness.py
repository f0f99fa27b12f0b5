"""Dropping gradients computed too many steps ago: TF's DropStaleGradientOptimizer.

In asynchronous training a worker computes a gradient at the global step it last saw
and applies it later, after other workers have moved the parameters on. TF1's
`tf.contrib.opt.DropStaleGradientOptimizer` compares the two steps and drops the whole
update when the gap exceeds a threshold. `drop_stale_gradients` is that rule as an
Optax wrapper: the gap is checked in `update`, and the wrapped optimizer runs only on
accepted steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from optax_accum import (
    _branch,
    _checks,
    _counters,
    _engine,
    _extra_args,
    _protocol,
    _state_tree,
    _unreduced,
)


class DropStaleGradientsState(NamedTuple):
    """State of `drop_stale_gradients`.

    Attributes:
      global_step: int32, the number of accepted updates (TF's global step).
      num_dropped: int32, the number of updates dropped as too stale.
      emitted: bool, whether the last `update` was accepted (and ran `inner`).
      inner_state: the wrapped optimizer's state.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.drop_stale_gradients(optax.sgd(1.0), staleness=0)
      >>> state = tx.init(jnp.zeros(1))
      >>> _, state = tx.update(jnp.ones(1), state, local_step=-1)  # lag 1: dropped
      >>> int(state.global_step), int(state.num_dropped), bool(state.emitted)
      (0, 1, False)
    """

    global_step: jax.Array
    num_dropped: jax.Array
    emitted: jax.Array
    inner_state: optax.OptState


def _check_staleness(staleness: Any) -> Any:
    """Python ints must fit in int32; a Python float s is the int floor(s) (the lag is
    an integer, so `lag <= s` iff `lag <= floor(s)`), saturated to int32; NumPy integer
    arrays saturate to int32; other arrays (traced, or from inject_hyperparams) pass."""
    if isinstance(staleness, bool | complex | str):
        raise TypeError(
            f"staleness must be an int or a float (or an int/float scalar array), got {staleness!r}"
        )
    if isinstance(staleness, float | np.floating):
        if np.isnan(staleness):
            raise ValueError(f"staleness must be a number, got {staleness!r}")
        info = np.iinfo(np.int32)
        return int(np.clip(np.floor(staleness), info.min, info.max))
    if isinstance(staleness, int | np.integer):
        info = np.iinfo(np.int32)
        if not info.min <= staleness <= info.max:
            raise ValueError(
                f"staleness must fit in int32 ([-2**31, 2**31 - 1]), got {staleness!r}"
            )
        return int(staleness)
    if not hasattr(staleness, "dtype") or jnp.ndim(staleness) != 0:
        raise TypeError(f"staleness must be a scalar, got {staleness!r}")
    if isinstance(staleness, np.ndarray) and jnp.issubdtype(staleness.dtype, jnp.integer):
        # Saturate here: JAX without x64 would cast an int64 array to int32 by wrapping.
        return int(_counters.saturate_int32(staleness))
    return staleness


def _lag(global_step: jax.Array, local_step: jax.Array) -> jax.Array:
    """`global_step - local_step` in int32, saturating instead of wrapping."""
    lag = global_step - local_step
    wrapped = ((global_step ^ local_step) & (global_step ^ lag)) < 0
    limit = jnp.where(global_step >= 0, np.iinfo(np.int32).max, np.iinfo(np.int32).min)
    return jnp.where(wrapped, limit, lag).astype(jnp.int32)


def _within(lag: jax.Array, staleness: Any) -> jax.Array:
    """`lag <= staleness`, for an int or floating (possibly traced) staleness."""
    staleness = jnp.asarray(staleness)
    if jnp.issubdtype(staleness.dtype, jnp.floating):
        return lag.astype(staleness.dtype) <= staleness
    if not jnp.issubdtype(staleness.dtype, jnp.integer):
        raise TypeError(f"staleness must be an int or float scalar, got dtype {staleness.dtype}")
    # Saturate, never wrap: a staleness beyond the int32 range accepts (or drops) all.
    info = jnp.iinfo(staleness.dtype)
    low, high = max(info.min, np.iinfo(np.int32).min), min(info.max, np.iinfo(np.int32).max)
    return lag <= jnp.clip(staleness, low, high).astype(jnp.int32)


def drop_stale_gradients(
    inner: optax.GradientTransformation,
    staleness: Any,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Drops updates whose gradient was computed more than `staleness` steps ago.

    Each `update` takes the step its gradient was computed at as the extra argument
    `local_step` (omitted: computed now). The update is accepted iff
    `global_step - local_step <= staleness`: `inner` runs, its updates are returned,
    and `global_step` advances by one. Otherwise it is dropped: the updates are zeros,
    `inner` neither runs nor changes, `global_step` stays, and `num_dropped` grows.
    `staleness` 0 accepts only up-to-date gradients; a negative one drops everything.
    `staleness_percentage(state)` is TF's drop fraction, `num_dropped / (global_step
    + 1)`.

    With `axis_name`, the replicas of that mapped axis take one decision together:
    the step is accepted iff every replica's gradient is fresh enough (one scalar
    all-reduce), and dropped as a whole when any replica's is too stale, so a
    collective inside `inner` (e.g. `cross_shard_optimizer`) is reached by all
    replicas or by none. The state stays identical on all replicas. To keep the
    fresh replicas' gradients and drop only the stragglers', use
    `conditional_accumulator(..., axis_name=...)` instead.

    TF counterpart: `tf.contrib.opt.DropStaleGradientOptimizer(opt, staleness)`.
    Differences from TF: none in the rule. A NaN or Inf in a dropped gradient never
    reaches the state; `staleness` may be a traced scalar (it works under
    `optax.inject_hyperparams`).

    Args:
      inner: the optimizer applied to accepted gradients.
      staleness: the largest accepted gap between the global step and `local_step`:
        a Python int or float, or an int or float scalar array (traced is fine). The
        gap is an integer, so a float `s` accepts the gaps up to `floor(s)`; values
        beyond int32 in an array saturate.
      axis_name: optional name (or tuple of names) of a mapped axis whose replicas
        decide together.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `DropStaleGradientsState`.

    Raises:
      TypeError: at construction for a `staleness` that is not a number or a scalar
        array; at trace time for a non-integer or non-scalar `local_step`.
      ValueError: at trace time, when `axis_name` is not bound by the caller.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.drop_stale_gradients(optax.sgd(1.0), staleness=1)
      >>> state = tx.init(jnp.zeros(1))
      >>> g = jnp.array([1.0])
      >>> u, state = tx.update(g, state, local_step=0)  # lag 0: accepted
      >>> u, state = tx.update(g, state, local_step=0)  # lag 1: accepted
      >>> u, state = tx.update(g, state, local_step=0)  # lag 2: dropped
      >>> u, int(optax_accum.global_step(state)), int(state.num_dropped)
      (Array([0.], dtype=float32), 2, 1)
      >>> round(float(optax_accum.staleness_percentage(state)), 3)  # 1 / (2 + 1)
      0.333
    """
    inner = _checks.require_transformation("inner", inner)
    # An optax_accum accumulator takes the verdict itself; anything else runs in a branch.
    gated = _protocol.takes_verdict(inner)
    staleness = _check_staleness(staleness)
    axis_name = _checks.require_axis_name("axis_name", axis_name)

    def init_fn(params: optax.Params) -> DropStaleGradientsState:
        _checks.require_floating_params(params)
        # Each counter gets its own buffer, so the state can be donated as it comes.
        return DropStaleGradientsState(
            global_step=_counters.int32(0),
            num_dropped=_counters.int32(0),
            emitted=jnp.asarray(False),
            inner_state=inner.init(params),
        )

    def step(
        updates: optax.Updates,
        state: DropStaleGradientsState,
        params: optax.Params | None,
        call: _protocol.Call,
        *,
        local_step: Any = None,
        **extra_args: Any,
    ) -> _protocol.Result:
        _checks.require_state(state, DropStaleGradientsState)
        if not call.checked:
            _extra_args.warn_misspelled(extra_args)
        step = _counters.local_step_or(local_step, state.global_step)
        accept = _within(_lag(state.global_step, step), staleness)
        if axis_name is not None:
            _checks.require_bound_axis(axis_name)
            accept = lax.pmin(accept.astype(jnp.int32), axis_name) > 0

        # A dropped update leaves the inner state as it was (see _branch and _engine).
        if gated:
            result = _protocol.call_inner(
                inner,
                updates,
                state.inner_state,
                params,
                call._replace(verdict=accept),
                **extra_args,
            )
            out = result.updates if result.selection is None else result.selection
            inner_state, new_params, read = result.state, result.params, result.read_weight
        else:
            _reject_unreduced(updates)
            reads: list = []

            def run(inner_state, params, _):
                inner_call = _protocol.Call(defer=not call.apply)
                result = _protocol.call_inner(
                    inner, updates, inner_state, params, inner_call, **extra_args
                )
                reads.append(result.read_weight)
                out = result.updates if result.selection is None else result.selection
                return out, result.state

            branched = _branch.update_if(
                accept,
                run,
                state.inner_state,
                params,
                salt=state.global_step,
                apply=call.apply,
                defer=call.defer,
            )
            out, inner_state, new_params = branched
            read = reads[-1]
        new_state = state._replace(
            global_step=_counters.increment_if(accept, state.global_step),
            emitted=accept,
            inner_state=inner_state,
            **_engine.tallied(state, {"num_dropped": ~accept}),
        )
        _protocol.watch_weight(
            "drop_stale_gradients",
            call,
            read,
            inner,
            updates,
            state.inner_state,
            params,
            extra_args,
        )
        return _protocol.result_of(
            out,
            new_state,
            call,
            part=lambda s: s.inner_state,
            params=new_params,
            read_weight=read,
        )

    return _protocol.transformation(init_fn, step)


def _reject_unreduced(updates: Any) -> None:
    """A clear error for gradients typed unreduced (params typed reduced) that would
    reach an inner optimizer as partial sums."""
    for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
        if _unreduced.unreduced_axes(g):
            raise TypeError(
                f"drop_stale_gradients cannot pass updates{jax.tree_util.keystr(path)}, "
                f"typed unreduced ({jax.typeof(g)}: its param is typed reduced), to an "
                "inner optimizer that is not an optax_accum accumulator: each device holds "
                "a partial sum. Put an accumulator inside, drop_stale_gradients("
                "conditional_accumulator(inner, k), staleness), which keeps the sum "
                "unreduced and reduces it once a window; or reduce the gradients first "
                "(differentiate plain params)"
            )


def _find_state(state: Any) -> DropStaleGradientsState:
    found = _state_tree.find(state, DropStaleGradientsState)
    if found is None:
        raise ValueError(
            f"state holds no DropStaleGradientsState (from drop_stale_gradients); got "
            f"{type(state).__name__}"
        )
    return found


def staleness_percentage(state: Any) -> jax.Array:
    """TF's "staleness percentage": dropped updates / (global step + 1), as a fraction.

    Reads the outermost `drop_stale_gradients` state inside `state` (also inside
    `optax.chain` or `optax.inject_hyperparams` states), as a float32 scalar. As in TF,
    it is not a true fraction of all updates: it exceeds 1 once the drops outnumber
    the accepted updates plus one.

    TF counterpart: the "staleness percentage" that
    `tf.contrib.opt.DropStaleGradientOptimizer` reports.

    Args:
      state: the state of `drop_stale_gradients`, or any state holding one.

    Returns:
      A float32 scalar.

    Raises:
      ValueError: when `state` holds no `DropStaleGradientsState`.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.drop_stale_gradients(optax.sgd(1.0), staleness=-1)
      >>> state = tx.init(jnp.zeros(1))
      >>> _, state = tx.update(jnp.ones(1), state)  # negative staleness drops all
      >>> float(optax_accum.staleness_percentage(state))
      1.0
    """
    found = _find_state(state)
    return found.num_dropped.astype(jnp.float32) / (found.global_step.astype(jnp.float32) + 1.0)


__all__ = ["DropStaleGradientsState", "drop_stale_gradients", "staleness_percentage"]
