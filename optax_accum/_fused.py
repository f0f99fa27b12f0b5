"""The fused train step: updates applied inside the branch that releases them.

`fused_step(tx, grads, opt_state, params)` is `tx.update` then `apply_updates`. While
it runs, a `fused_apply` context is active: an optax_accum transform whose `update`
gets the caller's very `params` applies its updates to them inside its release
branch (see `_branch.update_if`), and records the result in the context's `Sink`.
If the updates `tx` returned are exactly those (something after the transform, as in
a chain, may have changed them), the step takes the parameters from the sink, so a
step that releases nothing never reads or writes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax

from optax_accum import _checks
from optax_accum.indexed_slices import apply_updates


@dataclasses.dataclass
class Sink:
    """What `update_if` applied to `params` inside its branch, by the updates it made."""

    params: Any
    applied: list[tuple[list, Any]] = dataclasses.field(default_factory=list)

    def record(self, updates: Any, new_params: Any) -> None:
        self.applied.append((jax.tree.leaves(updates), new_params))

    def params_for(self, updates: Any) -> Any | None:
        """The params a branch made from exactly these `updates` (by identity), if any."""
        leaves = jax.tree.leaves(updates)
        for recorded, new_params in self.applied:
            if len(recorded) == len(leaves) and all(
                a is b for a, b in zip(recorded, leaves, strict=True)
            ):
                return new_params
        return None


_SINK: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("_SINK", default=None)


@contextlib.contextmanager
def fused_apply(params: Any) -> Iterator[Sink]:
    """While active, `update_if(..., params=params)` also applies its updates in its
    branch; the sink then gives the new params for the updates a transform returned,
    or None when something after the branch changed them (the caller applies them)."""
    sink = Sink(params)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def sink_for(params: Any) -> Sink | None:
    """The active sink if `params` is the very object it was opened with, else None."""
    sink = _SINK.get()
    if sink is None or params is None or params is not sink.params:
        return None
    return sink


def with_params(fn: Callable[[Any], tuple[Any, Any]]) -> Callable[[tuple], tuple]:
    """`fn` (state -> (updates, state)) on a carry `(state, params)` that also applies
    the updates to the params."""

    def run(carry: tuple) -> tuple:
        state, params = carry
        updates, state = fn(state)
        return updates, (state, apply_updates(params, updates))

    return run


def fused_step(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState, optax.Updates]:
    """`tx.update` then `apply_updates`, fused; returns `(params, opt_state, updates)`."""
    # As the canonical step: a `tx` that cannot take the extra arguments raises.
    tx = _checks.require_transformation("tx", tx)
    with fused_apply(params) as sink:
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    new_params = sink.params_for(updates)
    if new_params is None:  # not an optax_accum release, or changed after it
        new_params = apply_updates(params, updates)
    return new_params, opt_state, updates
