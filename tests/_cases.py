"""The registry of exported transforms that the cross-cutting suites run over.

Each `Case` builds one optax_accum transform at a small size with a deterministic
gradient stream, so the contract, Flax, Orbax and preemption suites can test every
transform the same way. A module that exports a transform adds its case(s) here.

Conventions:
- `make(axis_name)` returns the transform; `axis_name` is None, or the name of a
  mapped axis the harness binds (with `jax.vmap(axis_name=...)`, `REPLICAS` wide)
  when `needs_axis` is True.
- `grads(i)` is the gradient tree offered at step i (same structure as `params()`);
  under an axis, `replica_grads(i, r)` lets replicas differ (default: grads(i) * (r+1)).
- `extra_args(i)` returns the extra keyword arguments for step i (e.g. local_step);
  `hold_step(i)` is True when step i holds (no release) and `drop_step(i)` when the
  gradient at step i is dropped, used by the non-finite tests.
- `apply_updates` is how updates are applied (optax_accum.apply_updates for sparse).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

REPLICAS = 2


def _params() -> dict:
    return {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3), "b": jnp.zeros(3)}


def _grads(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Any], optax.GradientTransformationExtraArgs]
    params: Callable[[], Any] = _params
    grads: Callable[[int], Any] = _grads
    extra_args: Callable[[int], dict] = lambda i: {}
    needs_axis: bool = False
    needs_params: bool = False
    hold_step: Callable[[int], bool] = lambda i: False
    drop_step: Callable[[int], bool] = lambda i: False
    apply_updates: Callable[[Any, Any], Any] = optax.apply_updates

    def replica_grads(self, i: int, r: int) -> Any:
        return jax.tree.map(lambda g: g * (r + 1), self.grads(i))


def _stale_every_third(i: int) -> dict:
    # Steps 0,1 | 3,4 | ... are fresh; step 2, 5, ... are tagged one step behind.
    return {"local_step": jnp.int32(-1 if i % 3 == 2 else i // 3)}


CASES: list[Case] = [
    Case(
        name="conditional_accumulator",
        make=lambda axis: optax_accum.conditional_accumulator(
            optax.adam(0.1), num_required=2, axis_name=axis
        ),
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
    Case(
        name="conditional_accumulator_sum_schedule",
        make=lambda axis: optax_accum.conditional_accumulator(
            optax.sgd(0.1, momentum=0.9),
            num_required=lambda step: 2 + step % 2,
            reduction="SUM",
            axis_name=axis,
        ),
        hold_step=lambda i: i == 0,
    ),
    Case(
        name="conditional_accumulator_shared",
        make=lambda axis: optax_accum.conditional_accumulator(
            optax.adam(0.1), num_required=2 * REPLICAS, axis_name=axis or "replicas"
        ),
        needs_axis=True,
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
]

CASE_IDS = [c.name for c in CASES]


def run(case: Case, steps: int, *, tx: Any = None, axis: str = "replicas") -> tuple[Any, Any]:
    """Runs `steps` jitted updates of `case` from scratch; returns (params, state).

    Under `needs_axis`, runs `REPLICAS` replicas with `jax.vmap(axis_name=axis)` and
    returns replica 0's params and state.
    """
    tx = tx if tx is not None else case.make(axis if case.needs_axis else None)
    params = case.params()

    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return case.apply_updates(params, updates), state

    if case.needs_axis:
        stack = lambda t: jax.tree.map(lambda *x: jnp.stack(x), *t)  # noqa: E731
        params = stack([params] * REPLICAS)
        state = jax.vmap(tx.init)(params)
        fn = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None), axis_name=axis))
        for i in range(steps):
            grads = stack([case.replica_grads(i, r) for r in range(REPLICAS)])
            params, state = fn(params, state, grads, case.extra_args(i))
        first = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        return first(params), first(state)
    state = tx.init(params)
    fn = jax.jit(step)
    for i in range(steps):
        params, state = fn(params, state, case.grads(i), case.extra_args(i))
    return params, state
