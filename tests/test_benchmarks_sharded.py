"""benchmarks/sharded.py runs as documented and reports both sharding modes and both
step shapes (at a smoke size: its timings mean nothing here; the figures live in
benchmarks/README.md). Its memory figures are per device: checked against the bytes of
one FSDP shard of each tree the step takes."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAVES, ROWS, COLS, FSDP = 8, 128, 64, 4  # the script's 64K size on (data=2, fsdp=4)


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    # The subprocess measures this checkout's optax_accum, and starts its own 8 devices.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "benchmarks/sharded.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_sharded_benchmark_reports_both_modes_per_device(tmp_path):
    out = tmp_path / "sharded.json"
    run = _run("--quick", "--out", str(out), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "device: " in run.stdout and "jax " in run.stdout and "held/floor" in run.stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "fsdp": FSDP}
    modes = report["results"]["64K"]
    assert set(modes) == {"explicit", "auto"}
    shard_tree = LEAVES * (ROWS // FSDP) * COLS * 4  # one float32 shard of every leaf
    for mode, m in modes.items():
        assert m["state_laid_out_like_params"], mode
        assert m["shard_shape"] == [ROWS // FSDP, COLS]
        assert set(m["results"]) == {"canonical", "apply_gradients"}
        for figures in m["results"].values():
            for name in ("held_vs_floor", "base_held_vs_floor", "cycle_speedup"):
                assert math.isfinite(figures[name]) and figures[name] > 0, (mode, name, figures)
        # The floor takes the accumulator and the gradient; a train step the params,
        # the gradient and Adam's two moments, plus an accumulator for ours (MultiSteps
        # also keeps one), each a shard per device, and a few scalars.
        memory = {k: p["memory"] for k, p in m["programs"].items()}
        assert memory["floor"]["argument"] == 2 * shard_tree, (mode, memory)
        for name in ("base_cycle", "canonical_cycle", "apply_gradients_cycle"):
            assert 5 * shard_tree <= memory[name]["argument"] < 5 * shard_tree + 1024, (
                mode,
                name,
                memory,
            )
            assert memory[name]["output"] < memory[name]["argument"], (mode, name, memory)
        # The optimizer step alone needs no collective, in either mode.
        for name, program in m["programs"].items():
            assert program["collectives"]["every_step"] == {}, (mode, name, program)


def test_sharded_benchmark_refuses_zero_rounds():
    run = _run("--rounds", "0", timeout=120)
    assert run.returncode == 2 and "--rounds must be at least 1" in run.stderr
