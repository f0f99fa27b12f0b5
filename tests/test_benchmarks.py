"""The benchmarks run as documented and report every figure (at smoke sizes: their
timings mean nothing here; the figures live in benchmarks/README.md)."""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from optax_accum.demo import tpu

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_one_command_writes_every_benchmarks_report(tmp_path):
    """`python -m benchmarks --quick` runs every registered benchmark and writes the
    JSON, markdown and PNG reports, each naming the device, the jax version and the date."""
    from test_benchmarks_sharded import check_mode

    from benchmarks.__main__ import BENCHMARKS
    from benchmarks.compile_time import REFERENCES, TRANSFORMS
    from benchmarks.dense import PATTERNS

    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    machine = report["machine"]
    assert machine["jax"] == jax.__version__ and machine["device_kind"]
    taken = datetime.datetime.fromisoformat(machine["date"])
    assert abs(datetime.datetime.now(datetime.UTC) - taken) < datetime.timedelta(hours=1)
    assert report["quick"] and report["optax_accum"] == str(ROOT / "optax_accum")
    assert list(report["benchmarks"]) == list(BENCHMARKS)
    cases = {}
    for name, bench in report["benchmarks"].items():
        assert "error" not in bench, (name, bench.get("error"))
        # Without libtpu (off Linux x86_64) the TPU report has no rows, and says why.
        skipped = name == "tpu_compiled" and tpu.unavailable() is not None
        assert bench["rows"] or (skipped and bench["details"] == {"skipped": tpu.unavailable()})
        for row in bench["rows"]:
            assert row["benchmark"] == name and math.isfinite(row["value"]), row
        cases[name] = {r["case"] for r in bench["rows"]}
    assert cases["dense"] == {f"64K {p}" for p in PATTERNS}
    assert cases["train_step"] == {"block tiny", "block tiny apply_gradients"}  # quick
    assert cases["compile_time"] == set(TRANSFORMS) - set(REFERENCES)  # quick: ours only
    assert "sync SGD (cross_shard_optimizer)" in cases["agn"]
    assert {"per leaf, float32", "pack", "agn(sgd, 4, axis_name)"} <= cases["collectives"]
    assert {"dense apply, 1 thread", "sparse take, 4 threads"} <= cases["host"]
    assert cases["sparse"] == {"10,000 x 64"}
    assert cases["ray_host"] == {"64 KB, 4 workers", "1 MB, 4 workers"}
    assert cases["data_parallel"] == {"quick, 8 devices, as_reduced"}
    if not tpu.unavailable():  # where libtpu is installed (the test extra's, Linux x86_64)
        assert cases["tpu_compiled"] == {
            "v5e:2x2 data conditional_accumulator apply_gradients",
            "v5e:2x2 x 2 slices conditional_accumulator canonical",
        }
        assert "### v5e:2x2 x 2 slices" in (tmp_path / "tpu_compiled.md").read_text()
    modes = ("explicit", "auto")
    assert cases["sharded"] == {
        f"64K {m} {p}" for m in modes for p in ("apply_gradients", "canonical")
    }
    # Both sharding modes' layout and per-device memory (test_benchmarks_sharded.py
    # runs the script's own command line for one mode).
    sharded = report["benchmarks"]["sharded"]["details"]
    assert sharded["mesh"] == {"data": 2, "fsdp": 4} and sharded["leaves"] == 8
    assert set(sharded["results"]["64K"]) == set(modes)
    for mode, m in sharded["results"]["64K"].items():
        check_mode(mode, m)

    table = (tmp_path / "report.md").read_text()
    for text in (machine["device_kind"], f"jax {jax.__version__}", machine["date"]):
        assert text in table
    for name in BENCHMARKS:
        assert f"## {name}" in table
    assert "| 64K apply_gradients | cycle of 8, MultiSteps / ours |" in table
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert (tmp_path / "agn.png").exists()


def test_dense_benchmark_command_line_in_bfloat16(tmp_path, monkeypatch, capsys):
    """The script's own command line, its `main` in this process (the refusal below
    runs the script as a file), in bfloat16: every pattern runs in float32 in the test
    above; here the canonical step (`tx.update`) and NNX (`NNXOptimizer`, through
    `apply_gradients`), the two ways the patterns reach optax_accum, with `--pattern`
    repeated. The script's own bfloat16 code (params, gradients, the float32 floor)
    is the same for every pattern."""
    from benchmarks import dense

    dtype, patterns = "bfloat16", ("canonical", "NNX")
    out = tmp_path / "dense.json"
    argv = ["dense.py", "--rounds", "1", "--size", "64K", "--dtype", dtype, "--out", str(out)]
    for pattern in patterns:
        argv += ["--pattern", pattern]
    monkeypatch.setattr(sys, "argv", argv)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as users run it
        dense.main()
    stdout = capsys.readouterr().out
    assert "device: " in stdout and "jax " in stdout and "held/floor" in stdout
    report = json.loads(out.read_text())
    assert report["dtype"] == dtype
    results = report["results"]["64K"]
    assert set(results) == set(patterns)
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


def test_train_step_benchmark_refuses_an_empty_batch(monkeypatch, capsys):
    from benchmarks import train_step

    monkeypatch.setattr(sys, "argv", ["train_step.py", "--batch", "0"])
    with pytest.raises(SystemExit) as exit_:
        train_step.main()
    assert exit_.value.code == 2
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err


# Each model's own branch, once with its default batch and once with a given one: the
# line that picks the batch is the same in both branches.
@pytest.mark.parametrize(("name", "batch"), [("mlp", None), ("block", 3)])
def test_train_step_models_take_their_default_or_a_given_batch(name, batch):
    """The models' batches, at the sizes the full run uses (the quick run builds only
    the tiny block): labels and targets match the inputs' batch size."""
    from benchmarks.train_step import model

    _, (x, y), _ = model(name, quick=False, batch=batch)
    assert x.shape[0] == y.shape[0] == (batch or {"mlp": 64, "block": 4}[name])


def test_compile_time_lists_where_xla_spends_its_compile_time(tmp_path):
    """`--passes`: the compile spans of a jax.profiler trace, MultiSteps' beside the
    transform's (issue 22's evidence of where the compile time goes)."""
    name = "drop_stale_gradients(adam)"
    cmd = ["-m", "benchmarks.compile_time", "--rounds", "1", "--leaves", "4", "--passes"]
    run = subprocess.run(
        [sys.executable, *cmd, "--only", name, "--out", str(tmp_path / "ct.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    listing = run.stdout.split("seconds in XLA's compile spans")[1].splitlines()
    assert listing[1] == name, listing
    spans = listing[2:]
    assert len(spans) == 12, listing
    for line in spans:  # "  0.032 ->  0.038  ThunkEmitter::EmitEntryComputation"
        assert re.fullmatch(r" +\d+\.\d{3} -> +\d+\.\d{3}  \S.*", line), line
