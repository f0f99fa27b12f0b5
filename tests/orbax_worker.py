"""Restores Orbax checkpoints of optax_accum runs in a fresh process and continues them.

tests/test_orbax.py trains every scenario below, saves params and optimizer state with
Orbax part-way (mid accumulation window, mid AGN round), and runs this script:

    JAX_NUM_CPU_DEVICES=8 JAX_NUMPY_DTYPE_PROMOTION=strict \
        python tests/orbax_worker.py CHECKPOINT_ROOT RESULT_FILE TOTAL_STEPS

(the test passes its own process's JAX settings through those variables).

For each scenario saved under CHECKPOINT_ROOT/<name>/step_<k>, it rebuilds the
transform, restores into a target with the fresh process's own shapes, dtypes and
shardings, runs steps k..TOTAL_STEPS-1, and pickles the restored and the final
(params, state) leaves to RESULT_FILE for the test to compare bit for bit with the
uninterrupted run. The scenarios are defined here, once, for both processes.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _cases import CASES, REPLICAS, Case, adam
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum

AXIS = "replicas"
DEVICES = 8


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A deterministic training run: `init()` -> (params, state); `step(i, params, state)`."""

    name: str
    init: Callable[[], tuple[Any, Any]]
    step: Callable[[int, Any, Any], tuple[Any, Any]]


def _stack(trees: list) -> Any:
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def from_case(case: Case) -> Scenario:
    """The case's gradient stream, jitted (under vmap(axis_name) when it needs an axis)."""
    tx = case.make(AXIS if case.needs_axis else None)

    def one(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return case.apply_updates(params, updates), state

    if case.needs_axis:
        fn = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None), axis_name=AXIS))

        def init():
            params = _stack([case.params()] * REPLICAS)
            return params, jax.vmap(tx.init)(params)

        def grads_at(i):
            return _stack([case.replica_grads(i, r) for r in range(REPLICAS)])
    else:
        fn = jax.jit(one)

        def init():
            params = case.params()
            return params, tx.init(params)

        grads_at = case.grads

    return Scenario(
        case.name, init, lambda i, params, state: fn(params, state, grads_at(i), case.extra_args(i))
    )


def sharded() -> Scenario:
    """A shared accumulator under `jax.shard_map` on 8 devices.

    Every device offers its own gradient (one in four stale); the accumulator field of
    the state is per device, so it is saved and restored sharded over all 8.
    """
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax_accum.conditional_accumulator(adam(0.1), num_required=3 * DEVICES, axis_name="data")
    base = Case("sharded_8_devices", make=lambda axis: tx)  # the default params and grads
    spec = optax_accum.state_partition_specs(tx, base.params(), mesh, local_step=0)

    def one(params, state, grads, local_step):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params, local_step=local_step[0])
        return optax.apply_updates(params, updates), state

    fn = jax.jit(
        jax.shard_map(
            one, mesh=mesh, in_specs=(P(), spec, P("data"), P("data")), out_specs=(P(), spec)
        )
    )
    init_fn = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=spec))

    def init():
        params = jax.device_put(base.params(), NamedSharding(mesh, P()))
        return params, init_fn(params)

    def step(i, params, state):
        grads = _stack([base.replica_grads(i, r) for r in range(DEVICES)])
        gs = int(optax_accum.global_step(state))
        local_step = jnp.asarray([gs - (r == i % 4) for r in range(DEVICES)], jnp.int32)
        return fn(params, state, grads, local_step)

    return Scenario("sharded_8_devices", init, step)


def scenarios() -> dict[str, Scenario]:
    found = [from_case(c) for c in CASES] + [sharded()]
    return {s.name: s for s in found}


def compile_cache_dir(tmp_path_factory: Any) -> pathlib.Path:
    """A persistent XLA compilation cache for this test session's checkpoint workers.

    tests/test_preemption.py's launches write it, and this script, run by
    tests/test_orbax.py, reads it: both build their steps with `from_case`, so the
    cases they share compile once. Under pytest-xdist it sits in the directory the
    workers share. A cached executable is the one the compiler would build (same
    program, flags and devices), so the results do not depend on the cache.
    """
    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent
    return base / "checkpoint_xla_cache"


def checkpoint_dir(root: pathlib.Path, name: str, step: int) -> pathlib.Path:
    return root / name / f"step_{step}"


def leaves(tree: Any) -> dict[str, Any]:
    """Host copies of a tree's leaves, keyed by path (gathers sharded arrays)."""
    import numpy as np

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def attempt(fn: Callable[..., dict], *args: Any) -> dict:
    """`fn(*args)`, or {"error": traceback} so one failing scenario spares the others."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _continue(scenario: Scenario, checkpointer: Any, path: pathlib.Path, total: int) -> dict:
    start = int(path.name.removeprefix("step_"))
    params, state = scenario.init()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": params, "state": state},
    )
    restored = checkpointer.restore(path.resolve(), target)
    params, state = restored["params"], restored["state"]
    devices = {len(x.sharding.device_set) for x in jax.tree.leaves(state)}
    for i in range(start, total):
        params, state = scenario.step(i, params, state)
    return {
        "restored": leaves(restored),
        "final": leaves({"params": params, "state": state}),
        "state_type": type(state).__name__,
        "devices": sorted(devices),
    }


def main(argv: list[str]) -> None:
    import orbax.checkpoint as ocp

    root, result_file, total = pathlib.Path(argv[0]), pathlib.Path(argv[1]), int(argv[2])
    results = {}
    checkpointer = ocp.StandardCheckpointer()
    for name, scenario in scenarios().items():
        saved = sorted((root / name).glob("step_*")) if (root / name).exists() else []
        if not saved:
            continue
        (path,) = saved
        results[name] = attempt(_continue, scenario, checkpointer, path, total)
    checkpointer.close()
    result_file.write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
