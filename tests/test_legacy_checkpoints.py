"""Checkpoints written by optax_accum 0.1.0 restore into today's states and continue.

tests/legacy_checkpoints.py wrote them (mid-window, with Orbax and flax.serialization)
and recorded the params of the uninterrupted run. 0.1.0's states kept the running sum
in a field named `accumulator` (today's `storage`): restored without a target and read
into the structure of a fresh `tx.init` by `optax_accum.upgrade_checkpoint`, then
continued with today's code, every scenario must end on those params bit for bit.
"""

from __future__ import annotations

import pathlib

import flax.serialization
import jax
import legacy_checkpoints
import numpy as np
import orbax.checkpoint as ocp
import pytest

import optax_accum

ROOT = pathlib.Path(__file__).parent / "data" / "checkpoints-0.1.0"
FINAL = np.load(ROOT / "final_params.npz")


def _restore(scenario: legacy_checkpoints.Scenario, form: str):
    params = scenario.params()
    like = {"params": params, "state": scenario.make().init(params)}
    path = ROOT / scenario.name
    if form == "orbax":
        with ocp.StandardCheckpointer() as checkpointer:
            saved = checkpointer.restore((path / "orbax").resolve())
    else:
        saved = flax.serialization.msgpack_restore((path / "flax.msgpack").read_bytes())
    assert "accumulator" in str(jax.tree_util.tree_structure(saved))  # 0.1.0's name
    return optax_accum.upgrade_checkpoint(saved, like)


@pytest.mark.parametrize("form", ["orbax", "flax"])
@pytest.mark.parametrize("name", sorted(legacy_checkpoints.SCENARIOS))
def test_a_0_1_0_checkpoint_restores_and_continues_bit_for_bit(name, form):
    scenario = legacy_checkpoints.SCENARIOS[name]
    restored = _restore(scenario, form)
    params, _ = legacy_checkpoints.run(
        scenario,
        restored["params"],
        restored["state"],
        legacy_checkpoints.SPLIT,
        legacy_checkpoints.STEPS,
    )
    for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_array_equal(
            np.asarray(leaf), FINAL[f"{name}{jax.tree_util.keystr(key)}"], err_msg=str(key)
        )
