"""Every figure the README and benchmarks/README.md quote, in one command.

    python -m benchmarks --out DIR            # every benchmark
    python -m benchmarks --quick --out DIR    # tiny sizes: a smoke test, a few minutes
    python -m benchmarks --gpu --out DIR      # on a GPU lease: what the last GPU run missed

Runs every benchmark registered in `BENCHMARKS` on whatever backend JAX has (on a GPU
or TPU, with the accelerator sizes too: 268M dense parameters, a 10M x 64 table) and
writes `DIR/report.json` (every figure), `DIR/report.md` (a table per benchmark) and
`DIR/report.png` (every ratio against its target), each with the device kind, the
jax version and the date. The JSON and markdown reports are rewritten after each
benchmark, so a run cut short keeps what it measured (the plot is drawn at the end); a
benchmark that fails is reported as failed and the others still run (exit status 1).

Run it from the repository root: `python -m` puts the current folder first on the
path, so the checkout's `optax_accum` is measured (`report.json` records which).
"""

from __future__ import annotations

import os

# Before anything imports JAX: collectives.py and agn.py need 8 devices; on a GPU or
# TPU host they run on these simulated CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import dataclasses
import importlib
import shlex
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from benchmarks import _report


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A module of this folder whose `report_rows(scale)` gives its figures."""

    module: str
    question: str


# The one place to register a benchmark: add its module here (in run order).
BENCHMARKS: dict[str, Benchmark] = {
    "dense": Benchmark(
        "benchmarks.dense",
        "Is `conditional_accumulator` the fast way to accumulate dense gradients, in the "
        "train steps users write (canonical, `apply_gradients`, TrainState, NNX)?",
    ),
    "train_step": Benchmark(
        "benchmarks.train_step",
        "In a whole train step, forward and backward included (a 3.7M MLP, a 3.2M "
        "transformer block), how much faster is `conditional_accumulator` than MultiSteps?",
    ),
    "sparse": Benchmark(
        "benchmarks.sparse",
        "Is `sparse_conditional_accumulator` the fast way to accumulate embedding gradients?",
    ),
    "sharded": Benchmark(
        "benchmarks.sharded",
        "Under `jax.jit` on a (data=2, fsdp=4) mesh with FSDP-sharded params, is the "
        "held step still an `acc + g` pass, and the state no bigger than MultiSteps'?",
    ),
    "compile_time": Benchmark(
        "benchmarks.compile_time",
        "Does a holding transform, or a nest of three, compile as fast as `optax.MultiSteps`?",
    ),
    "agn": Benchmark(
        "benchmarks.agn",
        "Does `agn` (local SGD) match synchronous SGD with fewer all-reduces?",
    ),
    "collectives": Benchmark(
        "benchmarks.collectives",
        "How many collectives, and how many bytes, does a data-parallel step issue?",
    ),
    "host": Benchmark(
        "benchmarks.host",
        "Are the host `ConditionalAccumulator` objects at least as fast as TF's own? "
        "(TF's side only with `--tf-python`)",
    ),
    "ray_host": Benchmark(
        "benchmarks.ray_host",
        "Does `optax_accum.ray`'s accumulator take four worker processes' gradients as fast "
        "as a bare Ray actor that only sums them?",
    ),
    "data_parallel": Benchmark(
        "benchmarks.data_parallel",
        "Data parallel on 8 devices, params `as_reduced`: does one reduction per window "
        "make the whole train step faster than reducing every step (ours and MultiSteps)?",
    ),
    "tpu_compiled": Benchmark(
        "benchmarks.tpu_compiled",
        "What does the TPU compiler make of each step (compiled for TPU topologies, not "
        "run): temporaries, every-step bytes over the floor, collectives and transfers "
        "between slices, ours beside MultiSteps?",
    ),
}


# `--gpu`: what the last GPU run (benchmarks/README.md, "On a GPU") missed, within one
# short lease: the canonical step's temporaries at 268M and every step form's 8M cycle
# against MultiSteps (dense), and the whole train steps (train_step).
GPU = ("dense", "train_step")


def _progress_bars():
    """`progress(iterable, desc=..., total=...)`: a tqdm bar if tqdm is installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _report.no_progress

    def progress(iterable, desc: str = "", total: int | None = None):
        return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)

    return progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the report")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--only", action="append", choices=sorted(BENCHMARKS), help="default: every benchmark"
    )
    parser.add_argument(
        "--accelerator-sizes",
        action="store_true",
        help="add the accelerator sizes on the CPU too (about 20 GB of memory)",
    )
    parser.add_argument("--tf-python", help="a Python that can import tensorflow (host.py)")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU lease's command: " + ", ".join(GPU) + " at the accelerator sizes "
        "(what the last GPU run missed; with --quick it runs anywhere, at tiny sizes)",
    )
    args = parser.parse_args(argv)

    import jax  # after XLA_FLAGS

    import optax_accum

    devices = jax.devices()
    if args.gpu:
        if devices[0].platform not in ("gpu", "cuda", "rocm") and not args.quick:
            parser.error(f"--gpu measures a GPU, but JAX sees {devices[0].platform}")
        args.only = args.only or list(GPU)
    accelerator = devices[0].platform != "cpu" or args.accelerator_sizes
    progress = _progress_bars()
    scale = _report.Scale(
        quick=args.quick,
        accelerator=accelerator,
        progress=progress,
        options={"tf_python": args.tf_python, "out": args.out},
    )
    report = {
        "command": shlex.join(["python", "-m", "benchmarks", *(argv or sys.argv[1:])]),
        "quick": args.quick,
        "accelerator_sizes": accelerator,
        "machine": _report.machine(
            devices, jax.__version__, datetime.now(UTC).isoformat(timespec="seconds")
        ),
        "optax_accum": str(Path(optax_accum.__file__).parent),
        "benchmarks": {},
    }
    names = args.only or list(BENCHMARKS)
    print(
        f"{report['machine']['device_kind']} ({devices[0].platform}), jax {jax.__version__}, "
        f"optax_accum from {report['optax_accum']}: {', '.join(names)}",
        flush=True,
    )
    failed = []
    for name in progress(names, desc="benchmarks"):
        bench = BENCHMARKS[name]
        entry: dict = {"question": bench.question}
        start = time.perf_counter()
        try:
            rows, details = importlib.import_module(bench.module).report_rows(scale)
            if args.quick:  # tiny sizes: a target says nothing there
                rows = [dataclasses.replace(r, met=None) for r in rows]
            entry["rows"] = [dataclasses.asdict(r) for r in rows]
            entry["details"] = details
        except Exception as e:  # one failure must not lose the other figures
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
            failed.append(name)
        entry["seconds"] = time.perf_counter() - start
        report["benchmarks"][name] = entry
        report["seconds"] = sum(b["seconds"] for b in report["benchmarks"].values())
        _report.write(report, args.out, png=False)  # the figures so far, if cut short
        print(f"{name}: {entry['seconds']:.0f} s" + (" FAILED" if name in failed else ""))
    _report.write(report, args.out)
    print(_report.markdown(report))
    print(f"wrote {args.out / 'report.json'}, report.md and report.png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
