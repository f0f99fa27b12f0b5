"""benchmarks/dense.py runs as documented and reports every pattern (at a smoke size:
its timings mean nothing here; the figures live in benchmarks/README.md)."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_benchmark_reports_every_pattern(tmp_path, dtype):
    out = tmp_path / "dense.json"
    cmd = [
        sys.executable,
        "benchmarks/dense.py",
        "--rounds",
        "1",
        "--size",
        "64K",
        "--dtype",
        dtype,
    ]
    run = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "device: " in run.stdout and "jax " in run.stdout
    report = json.loads(out.read_text())
    assert report["dtype"] == dtype
    results = report["results"]["64K"]
    assert set(results) == {"canonical", "apply_gradients", "TrainState", "NNX"}
    for figures in results.values():
        for name in ("held_vs_floor", "base_held_vs_floor", "cycle_speedup"):
            assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures)


def test_dense_benchmark_refuses_zero_rounds():
    run = subprocess.run(
        [sys.executable, "benchmarks/dense.py", "--rounds", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--rounds must be at least 1" in run.stderr
