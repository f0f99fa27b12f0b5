"""Checkpoints written by optax_accum 0.1.0, kept to show that later releases restore them.

`tests/data/checkpoints-0.1.0/` holds, for each scenario below, the params and optimizer
state saved mid-window (Orbax's `StandardCheckpointer` and `flax.serialization`'s
msgpack), and the params and updates of the run that went on uninterrupted. They were
written by optax_accum 0.1.0 (commit c61c9ce) with

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" \
    JAX_NUMPY_DTYPE_PROMOTION=strict python tests/legacy_checkpoints.py \
        tests/data/checkpoints-0.1.0

(under the suite's settings, which the root conftest.py sets: XLA:CPU's unoptimised code
rounds differently), and tests/test_legacy_checkpoints.py restores them with today's code
and continues the run. The scenarios use the public API only, and are small (a few
hundred bytes of state each).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

STEPS = 10
SPLIT = 5  # saved after this many steps: mid-window in every scenario


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    make: Callable[[], Any]
    params: Callable[[], Any]
    grads: Callable[[int], Any]
    local_step: Callable[[int, Any], Any]  # (step index, state) -> the tag


def _params() -> dict:
    return {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) / 10, "b": jnp.ones(3)}


def _grads(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }


def _table_params() -> dict:
    return {"table": jnp.zeros((16, 2)), "b": jnp.ones(2)}


def _table_grads(i: int) -> dict:
    rng = np.random.default_rng(100 + i)
    ids = jnp.asarray(rng.integers(0, 16, size=3), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    return {
        "table": optax_accum.IndexedSlices(ids, rows, (16, 2)),
        "b": jnp.asarray(rng.normal(size=2), jnp.float32),
    }


def _tag(i: int, state: Any) -> Any:
    """Every fourth gradient is one step stale: dropped."""
    step = int(optax_accum.global_step(state))
    return step - 1 if i % 4 == 3 else step


def _adam() -> optax.GradientTransformation:
    """optax.adam, traced under standard dtype promotion (its `decay ** count` is float **
    int32, which the suite's strict promotion rejects)."""
    inner = optax.with_extra_args_support(optax.adam(0.1))

    def update(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


SCENARIOS = {
    s.name: s
    for s in [
        Scenario(
            "conditional_accumulator",
            lambda: optax_accum.conditional_accumulator(_adam(), num_required=3),
            _params,
            _grads,
            _tag,
        ),
        Scenario(
            "sparse_conditional_accumulator",
            lambda: optax_accum.sparse_conditional_accumulator(
                optax_accum.sparse_sgd(0.5), num_required=3, capacity=12
            ),
            _table_params,
            _table_grads,
            _tag,
        ),
        Scenario(
            "drop_stale_gradients",
            lambda: optax_accum.drop_stale_gradients(
                optax_accum.conditional_accumulator(optax.sgd(0.1, momentum=0.9), 3), 0
            ),
            _params,
            _grads,
            _tag,
        ),
        Scenario(
            "nest",
            lambda: optax_accum.conditional_accumulator(
                optax_accum.conditional_accumulator(optax.sgd(0.1), 2), 2
            ),
            _params,
            _grads,
            lambda i, state: None,
        ),
        Scenario(
            "agn",
            lambda: optax_accum.agn(optax.sgd(0.1, momentum=0.9), 4),
            _params,
            _grads,
            lambda i, state: None,
        ),
    ]
}


def run(scenario: Scenario, params: Any, state: Any, start: int, stop: int) -> tuple:
    """Steps `start..stop-1` of the scenario's run (canonical optax step, jitted)."""
    tx = scenario.make()

    @jax.jit
    def step(params, state, grads, tag):
        extra = {} if tag is None else {"local_step": tag}
        updates, state = tx.update(grads, state, params, **extra)
        return optax_accum.apply_updates(params, updates), state

    for i in range(start, stop):
        params, state = step(params, state, scenario.grads(i), scenario.local_step(i, state))
    return params, state


def write(root: pathlib.Path) -> None:
    """Runs every scenario, saves the mid-window checkpoints and the final params."""
    import flax.serialization
    import orbax.checkpoint as ocp

    root.mkdir(parents=True, exist_ok=True)
    finals = {}
    for name, scenario in SCENARIOS.items():
        params = scenario.params()
        state = scenario.make().init(params)
        params, state = run(scenario, params, state, 0, SPLIT)
        assert int(optax_accum.num_accumulated(state)) > 0, name  # mid-window
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save((root / name / "orbax").resolve(), {"params": params, "state": state})
        (root / name / "flax.msgpack").write_bytes(
            flax.serialization.to_bytes({"params": params, "state": state})
        )
        final, _ = run(scenario, params, state, SPLIT, STEPS)
        for key, leaf in jax.tree_util.tree_flatten_with_path(final)[0]:
            finals[f"{name}{jax.tree_util.keystr(key)}"] = np.asarray(leaf)
    np.savez(root / "final_params.npz", **finals)


if __name__ == "__main__":
    write(pathlib.Path(sys.argv[1]))
