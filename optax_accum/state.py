"""Reading and setting the step counters of any optax_accum state, like TF's methods.

Every stateful optax_accum transform keeps its counters in a NamedTuple with a
`global_step` field. These functions find the outermost such state inside whatever the
user holds (the transform's own state, an `optax.chain` tuple, an
`optax.inject_hyperparams` state, a dict of them), so
`global_step(opt_state)` works without knowing how the optimizer was composed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _common


def _is_step_state(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields") and "global_step" in node._fields


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(key, child) pairs of a container node that may hold a step state."""
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [(f, getattr(node, f)) for f in node._fields]
    if isinstance(node, list | tuple):
        return list(enumerate(node))
    return []


def _find(node: Any, match: Callable[[Any], bool] = _is_step_state) -> Any | None:
    """The outermost node of `node` for which `match` holds (breadth first), or None.

    By default, the outermost step state.
    """
    frontier = [node]
    while frontier:
        nxt = []
        for n in frontier:
            if match(n):
                return n
            nxt.extend(child for _, child in _children(n))
        frontier = nxt
    return None


def _replace(node: Any, target: Any, new: Any) -> Any:
    """`node` with the object `target` (found by identity) replaced by `new`."""
    if node is target:
        return new
    if isinstance(node, dict):
        return type(node)((k, _replace(v, target, new)) for k, v in node.items())
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return node._replace(**{f: _replace(getattr(node, f), target, new) for f in node._fields})
    if isinstance(node, list | tuple):
        return type(node)(_replace(v, target, new) for v in node)
    return node


def _step_state(state: Any, field: str) -> Any:
    found = _find(state)
    if found is None:
        raise ValueError(
            "state holds no optax_accum step state (a NamedTuple with a global_step field); "
            f"got {type(state).__name__}"
        )
    if field not in found._fields:
        raise ValueError(f"{type(found).__name__} has no {field!r} field")
    return found


def global_step(state: Any) -> jax.Array:
    """The global step of the outermost optax_accum transform in `state`.

    Like TF's accumulators, it counts the updates the transform has released (for
    `agn`, the communication rounds).

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> state = tx.init(jnp.zeros(2))
      >>> int(optax_accum.global_step(state))
      0
    """
    return _step_state(state, "global_step").global_step


def num_accumulated(state: Any) -> jax.Array:
    """How many gradients the outermost accumulator in `state` holds (TF's num_accumulated).

    Under an `axis_name`, the count is summed over the replicas.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=3)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state)
      >>> int(optax_accum.num_accumulated(state))
      1
    """
    return _step_state(state, "count").count


def has_updated(state: Any) -> jax.Array:
    """Whether the last `update` of the outermost transform in `state` released an update.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.ones(2), state)
      >>> bool(optax_accum.has_updated(state))
      True
    """
    return _step_state(state, "emitted").emitted


def set_global_step(state: Any, new_global_step: Any) -> Any:
    """Returns `state` with the outermost transform's global step set to `new_global_step`.

    As in TF, a lower value is allowed (it warns when both values are concrete), and the
    accumulated gradients and counts are left alone. Gradients tagged with a step below
    the new global step are stale from then on.

    Example:
      >>> import optax, optax_accum, jax.numpy as jnp
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
      >>> state = optax_accum.set_global_step(tx.init(jnp.zeros(2)), 5)
      >>> _, state = tx.update(jnp.ones(2), state, local_step=4)  # stale: dropped
      >>> int(optax_accum.global_step(state)), int(optax_accum.num_accumulated(state))
      (5, 0)
    """
    if new_global_step is None:
        raise TypeError("new_global_step must be an integer scalar, got None")
    found = _step_state(state, "global_step")
    new = _common.local_step_or(new_global_step, found.global_step, argname="new_global_step")
    old = found.global_step
    concrete = not isinstance(new, jax.core.Tracer) and not isinstance(old, jax.core.Tracer)
    if concrete and int(new) < int(old):
        warnings.warn(
            f"set_global_step: new global step {int(new)} is lower than the current "
            f"{int(old)}; gradients tagged with older steps are accepted again",
            stacklevel=2,
        )
    new = jnp.asarray(new, dtype=np.int32)
    return _replace(state, found, found._replace(global_step=new))


__all__ = ["global_step", "has_updated", "num_accumulated", "set_global_step"]
