"""Reading and setting the step counters of any optax_accum state, like TF's methods.

Every stateful optax_accum transform keeps its counters in its own NamedTuple state
(`ConditionalAccumulatorState`, `SparseConditionalAccumulatorState`,
`DropStaleGradientsState`, `AGNState`). These functions find the outermost such state,
by its type, inside whatever the user holds (the transform's own state, an
`optax.chain` tuple, an `optax.inject_hyperparams` or `optax.MultiSteps` state, a dict
of them, a batch of states made under `jax.vmap`), so `global_step(opt_state)` works
without knowing how the optimizer was composed. `num_accumulated` finds the outermost
state that keeps a count, so it looks through `drop_stale_gradients`, which keeps none.
`cross_shard_optimizer` keeps no counter. The arrays they return are copies, safe to
pass into a jitted step that donates the state they came from.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _checks, _counters, _state_tree, _sums, _unreduced
from optax_accum.accumulator import ConditionalAccumulatorState
from optax_accum.agn import AGNState
from optax_accum.sparse import SparseConditionalAccumulatorState
from optax_accum.staleness import DropStaleGradientsState

# The states that hold a global step, one per stateful transform.
_STEP_STATES = (
    ConditionalAccumulatorState,
    SparseConditionalAccumulatorState,
    DropStaleGradientsState,
    AGNState,
)


def _step_state(state: Any, field: str, *, located: bool = False) -> Any:
    """The outermost step state in `state` that has `field` (with `located`, the pair
    `(path, state)` that `_state_tree.locate` gives).

    A wrapper whose state lacks the field is looked through: `num_accumulated` of
    `drop_stale_gradients(conditional_accumulator(...))` is the accumulator's count.
    """
    holders = tuple(t for t in _STEP_STATES if field in t._fields)
    found = _state_tree.locate(state, holders)
    if found is not None:
        return found if located else found[1]
    outermost = _state_tree.find(state, _STEP_STATES)
    if outermost is None:
        names = ", ".join(t.__name__ for t in _STEP_STATES)
        raise ValueError(
            f"state holds no optax_accum step state (one of {names}); got {type(state).__name__}"
        )
    names = ", ".join(t.__name__ for t in holders)
    raise ValueError(
        f"{type(outermost).__name__} has no {field!r} field, and state holds no step state "
        f"that has one ({names})"
    )


def _own_buffer(value: Any) -> Any:
    """`value` in a buffer of its own, so it may be passed to a jitted step that donates
    the state it came from (TF1's `apply_gradients(..., local_step=global_step)`):
    handing back the state's own buffer would be "a buffer that was previously donated".
    Under tracing (jit, vmap, grad) a value has no buffer, and is returned as it is."""
    if isinstance(value, jax.core.Tracer):
        return value
    return jnp.copy(value)


def global_step(state: Any) -> jax.Array:
    """The global step of the outermost optax_accum transform in `state`.

    Like TF's accumulators, it counts the updates the transform has released (for
    `agn`, the communication rounds).

    TF counterpart: the global step that `tf.ConditionalAccumulator.set_global_step`
    sets and `take_grad` advances, or the `global_step` variable a TF optimizer
    increments.

    Args:
      state: the state of an optax_accum transform, or any state holding one (a
        chain's tuple, an `inject_hyperparams` or `MultiSteps` state, a dict).

    Returns:
      An int32 scalar (an array of them for a batched state), in a buffer of its own:
      it may be passed as `local_step` to a jitted step that donates `state`.

    Raises:
      ValueError: when `state` holds no optax_accum step state: that of
        `conditional_accumulator`, `sparse_conditional_accumulator`,
        `drop_stale_gradients` or `agn`. `cross_shard_optimizer` and `cross_shard` keep
        no counter (every step is an update): count the steps instead, as
        `TrainState.step` and `NNXOptimizer.step` do.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> int(optax_accum.global_step(state))
      0
    """
    return _own_buffer(_step_state(state, "global_step").global_step)


def num_accumulated(state: Any) -> jax.Array:
    """How many gradients the outermost accumulator in `state` holds (TF's num_accumulated).

    The accumulator is the outermost `conditional_accumulator`,
    `sparse_conditional_accumulator` or `agn` state, found inside wrappers that keep no
    count (`drop_stale_gradients(conditional_accumulator(...))` gives the accumulator's).
    Under an `axis_name`, the count is summed over the replicas.

    TF counterpart: `tf.ConditionalAccumulator.num_accumulated()`.

    Args:
      state: the state of an optax_accum transform, or any state holding one (a
        chain's tuple, an `inject_hyperparams` or `MultiSteps` state, a dict).

    Returns:
      An int32 scalar: the gradients accepted since the last release (for `agn`, the
        local steps of this round), in a buffer of its own (safe beside a donated
        `state`).

    Raises:
      ValueError: when `state` holds no optax_accum state that keeps a count (only
        `drop_stale_gradients`', say, which has none).

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=3)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state)
      >>> int(optax_accum.num_accumulated(state))
      1
    """
    return _own_buffer(_step_state(state, "count").count)


def accumulated(state: Any) -> Any:
    """The running sum of gradients in the outermost `conditional_accumulator` or `agn`
    state in `state`: zeros right after a release.

    A release spends the state's `storage` (the next `update` starts from zeros, and on
    the CPU the released updates travel in its buffers), so read the sum here rather
    than from the field. Under an `axis_name`, each replica holds the sum of
    its own gradients.

    TF counterpart: none (TF keeps the sum inside the accumulator op).

    Args:
      state: the state of `conditional_accumulator` or `agn`, or any state holding one
        (a chain's tuple, an `inject_hyperparams` or `MultiSteps` state, a dict, a
        batch of states made under `jax.vmap`).

    Returns:
      A tree like the params, in the accumulator's dtype, in buffers of its own.

    Raises:
      ValueError: when `state` holds no `ConditionalAccumulatorState` or `AGNState`.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state)
      >>> optax_accum.accumulated(state)
      Array([1., 1.], dtype=float32)
      >>> _, state = tx.update(jnp.ones(2), state)  # released
      >>> optax_accum.accumulated(state)
      Array([0., 0.], dtype=float32)
    """
    found = _state_tree.find(state, (ConditionalAccumulatorState, AGNState))
    if found is None:
        raise ValueError(
            "state holds no ConditionalAccumulatorState or AGNState (from "
            f"conditional_accumulator or agn); got {type(state).__name__}"
        )
    spent = jnp.asarray(found.emitted)

    def read(a: jax.Array) -> jax.Array:
        flag = (
            spent if not spent.ndim else spent.reshape(spent.shape + (1,) * (a.ndim - spent.ndim))
        )
        return _sums.select(flag, _unreduced.zeros_like(a), a)  # an unreduced sum stays so

    return jax.tree.map(read, found.storage)


def has_updated(state: Any) -> jax.Array:
    """Whether the last `update` of the outermost transform in `state` released an update.

    TF counterpart: none; in TF, `take_grad` returning (or the optimizer's
    `apply_gradients` op running) says that an update was made.

    Args:
      state: the state of an optax_accum transform, or any state holding one (a
        chain's tuple, an `inject_hyperparams` or `MultiSteps` state, a dict).

    Returns:
      A bool scalar: True when the last `update` released (for `drop_stale_gradients`,
        accepted; for `agn`, synchronised), in a buffer of its own (safe beside a
        donated `state`).

    Raises:
      ValueError: when `state` holds no optax_accum step state.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state)
      >>> bool(optax_accum.has_updated(state))
      True
    """
    return _own_buffer(_step_state(state, "emitted").emitted)


def set_global_step(state: Any, new_global_step: Any) -> Any:
    """Returns `state` with the outermost transform's global step set to `new_global_step`.

    As in TF, a lower value is allowed (it warns when both values are concrete), and the
    accumulated gradients and counts are left alone. Gradients tagged with a step below
    the new global step are stale from then on.

    A batched state (say one made under `jax.vmap`, whose counters have leading batch
    axes) takes a scalar, set in every element, or an integer array of the global
    step's shape, one step per element; it warns if any element is lowered.

    TF counterpart: `tf.ConditionalAccumulator.set_global_step(new_global_step)`.

    Args:
      state: the state of an optax_accum transform, or any state holding one (a
        chain's tuple, an `inject_hyperparams` or `MultiSteps` state, a dict).
      new_global_step: an integer scalar (traced is fine), or for a batched state an
        integer array of the global step's shape. Wider integers saturate to int32.

    Returns:
      `state` with the global step replaced; nothing else changes.

    Raises:
      TypeError / ValueError: for a `new_global_step` that is not an integer scalar (or
        array of the right shape), or a `state` that holds no optax_accum step state.

    Example:
      >>> import jax, optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
      >>> state = optax_accum.set_global_step(tx.init(jnp.zeros(2)), 5)
      >>> _, state = tx.update(jnp.ones(2), state, local_step=4)  # stale: dropped
      >>> int(optax_accum.global_step(state)), int(optax_accum.num_accumulated(state))
      (5, 0)
      >>> batched = jax.vmap(tx.init)(jnp.zeros((3, 2)))  # three optimizers
      >>> optax_accum.global_step(optax_accum.set_global_step(batched, jnp.array([1, 2, 3])))
      Array([1, 2, 3], dtype=int32)
    """
    if new_global_step is None:
        raise TypeError("new_global_step must be an integer scalar, got None")
    path, found = _step_state(state, "global_step", located=True)
    old = found.global_step
    batch_shape = tuple(np.shape(old))
    if not batch_shape or np.ndim(new_global_step) == 0:
        new = _counters.local_step_or(new_global_step, old, argname="new_global_step")
    else:
        new = _batched_steps(new_global_step, batch_shape)
    concrete = not isinstance(new, jax.core.Tracer) and not isinstance(old, jax.core.Tracer)
    if concrete:
        _warn_if_lowered(np.asarray(new), np.asarray(old))
    new = jnp.broadcast_to(jnp.asarray(new, dtype=np.int32), batch_shape)
    return _state_tree.replace(state, path, found._replace(global_step=new))


def _batched_steps(steps: Any, batch_shape: tuple[int, ...]) -> Any:
    """An array of global steps, one per element of a batched state, as int32; wider
    integers saturate (a step from the far future stays in the future)."""
    if not hasattr(steps, "dtype"):  # a nested list
        steps = np.asarray(steps)
    dtype = _checks.integer_dtype("new_global_step", steps, expected="an integer scalar or array")
    if tuple(steps.shape) != batch_shape:
        raise ValueError(
            f"new_global_step must be an integer scalar or have the global step's shape "
            f"{batch_shape} (a batched state), got shape {tuple(steps.shape)}"
        )
    info, int32 = jnp.iinfo(dtype), np.iinfo(np.int32)
    low, high = max(info.min, int32.min), min(info.max, int32.max)
    if isinstance(steps, jax.Array):
        return jnp.clip(steps, np.asarray(low, dtype), np.asarray(high, dtype)).astype(np.int32)
    return np.clip(np.asarray(steps), low, high).astype(np.int32)


def _warn_if_lowered(new: np.ndarray, old: np.ndarray) -> None:
    lowered = np.broadcast_to(new, old.shape) < old
    if not lowered.any():
        return
    if old.ndim == 0:
        where = f"new global step {int(new)} is lower than the current {int(old)}"
    else:
        first = tuple(int(i) for i in np.argwhere(lowered)[0])
        where = (
            f"new global step is lower than the current one in {int(lowered.sum())} of "
            f"{old.size} batch elements (first at index {first}: "
            f"{int(np.broadcast_to(new, old.shape)[first])} < {int(old[first])})"
        )
    warnings.warn(
        f"set_global_step: {where}; gradients tagged with older steps are accepted again",
        stacklevel=3,
    )


__all__ = ["accumulated", "global_step", "has_updated", "num_accumulated", "set_global_step"]
