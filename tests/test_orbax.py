"""Orbax checkpoints taken mid accumulation window continue bit for bit in a fresh process.

For every Case in tests/_cases.py (but the two that are another with an axis name,
`AXIS_TWINS`), and for a shared accumulator whose state is sharded over 8 devices
under `jax.shard_map`: train, save params and optimizer state with
`orbax.checkpoint.StandardCheckpointer` part-way (where the state holds accumulated
gradients, i.e. mid window or mid AGN round), restore in a new Python process
(tests/orbax_worker.py), continue, and require every leaf of the final params and
state to be bit-identical to the run that was never interrupted. The fresh process
reads the session's XLA compilation cache that tests/test_preemption.py's launches
write (`orbax_worker.compile_cache_dir`): the steps of the cases both train come
compiled, the rest it compiles itself.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
from typing import Any

import _session
import jax
import numpy as np
import orbax.checkpoint as ocp
import orbax_worker
import pytest

import optax_accum

TOTAL = 9
# Two cases are their namesake with an axis_name and nothing else (the same state
# types, stacked over the replicas; the same update, plus the psums of its reduction).
# Saving, restoring and continuing them is the namesake's path over stacked leaves, so
# they are not checkpointed (nor restored: the worker restores what was saved). A
# shared accumulator is checkpointed still, sharded over 8 devices.
AXIS_TWINS = {
    "conditional_accumulator_shared": "conditional_accumulator",
    "sparse_conditional_accumulator_shared": "sparse_conditional_accumulator",
}
SCENARIOS = {
    name: scenario for name, scenario in orbax_worker.scenarios().items() if name not in AXIS_TWINS
}


def _holds_accumulated(state) -> bool | None:
    """True when the state holds gradients not yet released; None when it has no count."""
    try:
        return bool(np.any(np.asarray(optax_accum.num_accumulated(state)) > 0))
    except ValueError:
        return None


def _split_step(scenario: orbax_worker.Scenario) -> tuple[int, list[tuple[Any, Any]]]:
    """Runs the scenario uninterrupted; returns where to checkpoint and every (params, state).

    The checkpoint goes after the first step from 3 on where gradients are held.
    """
    params, state = scenario.init()
    history = [(params, state)]
    for i in range(TOTAL):
        params, state = scenario.step(i, params, state)
        history.append((params, state))
    for k in range(3, TOTAL - 1):
        if _holds_accumulated(history[k][1]) is not False:
            return k, history
    raise AssertionError(f"{scenario.name}: no step in 3..{TOTAL - 2} holds gradients")


@pytest.fixture(scope="module")
def restored_runs(tmp_path_factory) -> dict:
    """Every scenario checkpointed, then continued by the worker in one fresh process,
    once per session: under pytest-xdist the workers share one result."""
    cache = orbax_worker.compile_cache_dir(tmp_path_factory)
    return _session.once(
        tmp_path_factory, "orbax", lambda root: _checkpoint_and_restore(root, cache)
    )


def _checkpoint_and_restore(root: pathlib.Path, cache: pathlib.Path) -> dict:
    expected = {}
    checkpointer = ocp.StandardCheckpointer()
    for name, scenario in SCENARIOS.items():
        expected[name] = orbax_worker.attempt(_train_and_save, scenario, checkpointer, root)
    checkpointer.wait_until_finished()
    checkpointer.close()
    result_file = root / "results.pkl"
    worker = pathlib.Path(orbax_worker.__file__)
    env = {
        **os.environ,
        "JAX_NUM_CPU_DEVICES": str(jax.device_count()),
        "JAX_NUMPY_DTYPE_PROMOTION": jax.config.jax_numpy_dtype_promotion,
        # Reads the compiled steps tests/test_preemption.py's launches left in the
        # session's cache (the cases both train), writes nothing: nothing reads after.
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1000000",
    }
    proc = subprocess.run(
        [sys.executable, str(worker), str(root), str(result_file), str(TOTAL)],
        cwd=worker.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"expected": expected, "got": pickle.loads(result_file.read_bytes())}


def _train_and_save(scenario: orbax_worker.Scenario, checkpointer: Any, root: Any) -> dict:
    """Runs the scenario uninterrupted, saving a checkpoint part-way; what to expect."""
    split, history = _split_step(scenario)
    params, state = history[split]
    tree = {"params": params, "state": state}
    checkpointer.save(orbax_worker.checkpoint_dir(root, scenario.name, split), tree)
    final_params, final_state = history[-1]
    return {
        "mid_window": _holds_accumulated(state),
        "saved": orbax_worker.leaves(tree),
        "final": orbax_worker.leaves({"params": final_params, "state": final_state}),
        "state_type": type(final_state).__name__,
        "changed": _any_leaf_differs(params, final_params),
    }


def _any_leaf_differs(a, b) -> bool:
    return any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _assert_bit_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        g, w = got[key], want[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert g.tobytes() == w.tobytes(), f"{key}: {g} != {w}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_restore_in_fresh_process_continues_bit_identically(restored_runs, name):
    want = restored_runs["expected"][name]
    assert "error" not in want, want.get("error")
    got = restored_runs["got"][name]
    assert "error" not in got, got.get("error")
    assert want["mid_window"] is not False  # checkpointed with gradients held
    assert want["changed"]  # the continuation did real work
    _assert_bit_identical(got["restored"], want["saved"])
    assert got["state_type"] == want["state_type"]
    _assert_bit_identical(got["final"], want["final"])


def test_sharded_state_is_restored_over_8_devices(restored_runs):
    got = restored_runs["got"].get("sharded_8_devices", {"error": "not checkpointed"})
    assert "error" not in got, got.get("error")
    assert max(got["devices"]) == orbax_worker.DEVICES
    assert restored_runs["expected"]["sharded_8_devices"]["mid_window"] is True
