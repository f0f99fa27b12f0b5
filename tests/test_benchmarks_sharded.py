"""benchmarks/sharded.py runs as documented and reports both sharding modes and both
step shapes (at a smoke size: its timings mean nothing here; the figures live in
benchmarks/README.md). Its memory figures are per device: checked against the bytes of
one FSDP shard of each tree the step takes.

Both modes are measured once, by `python -m benchmarks --quick` in
tests/test_benchmarks.py, which checks them with `check_mode` below. Here the script's
own command line: its refusal of zero rounds (run as a file, as the README says), and
its `main` at `--quick` for one mode (in this process, whose 8 CPU devices the script
would otherwise start itself: the measurement is the one the runner makes).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAVES, ROWS, COLS, FSDP = 8, 128, 64, 4  # the script's 64K size on (data=2, fsdp=4)


def check_mode(mode: str, m: dict) -> None:
    """The figures of one sharding mode at the 64K size: both step shapes, the state
    laid out like the params, and per-device memory."""
    assert m["state_laid_out_like_params"], mode
    assert m["shard_shape"] == [ROWS // FSDP, COLS]
    assert set(m["results"]) == {"canonical", "apply_gradients"}
    for figures in m["results"].values():
        for name in ("held_vs_floor", "base_held_vs_floor", "cycle_speedup"):
            assert math.isfinite(figures[name]) and figures[name] > 0, (mode, name, figures)
    shard_tree = LEAVES * (ROWS // FSDP) * COLS * 4  # one float32 shard of every leaf
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


def test_sharded_benchmark_command_line_reports_a_mode_per_device(tmp_path, monkeypatch, capsys):
    from benchmarks import sharded

    out = tmp_path / "sharded.json"
    argv = ["sharded.py", "--quick", "--mode", "explicit", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as users run it
        sharded.main()
    stdout = capsys.readouterr().out
    assert "device: " in stdout and "jax " in stdout and "held/floor" in stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "fsdp": FSDP} and report["rounds"] == 1
    modes = report["results"]["64K"]
    assert set(modes) == {"explicit"}
    check_mode("explicit", modes["explicit"])


def test_sharded_benchmark_refuses_zero_rounds():
    # The subprocess runs this checkout's script as a file, and starts its own 8 devices.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run(
        [sys.executable, "benchmarks/sharded.py", "--rounds", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--rounds must be at least 1" in run.stderr
