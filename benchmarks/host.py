"""Are the host accumulators at least as fast as TensorFlow's own?

Workloads, each from 1 and from 4 actor threads, every apply tagged with a far-future
`local_step` so nothing is ever stale:

  apply  T threads apply K gradients each, then one take collects them all (its cost
         is included, and forces the asynchronous JAX work to finish): gradients/s.
  take   a learner calls `take_grad(T)` K times while T actor threads keep applying;
         each taken aggregate is materialised: takes/s.

Gradients: dense, 1M float32 (NumPy arrays, as actors produce them); sparse, 4096
sorted unique rows of 64 float32 out of a 100k-row table, from a pool of 8, reduced by
MEAN. Both sides get identical inputs.

TensorFlow is not a dependency. Install it into its own environment (it pins its own
numpy) and point the script at that interpreter:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu
    python benchmarks/host.py --tf-python /tmp/tfvenv/bin/python

The TF half then runs in a subprocess that takes one measurement per request, so the
two sides are measured in interleaved rounds on the same machine; the figures are
medians over rounds. TF's dense accumulator runs eagerly (`tf.compat.v1.
ConditionalAccumulator`); its sparse one only exists in graph mode, so it runs through
a `tf.compat.v1.Session` with fed placeholders, as TF1 code used it. Without
`--tf-python` (and with TF not importable here), only our figures are printed.

The script imports the installed `optax_accum`; to measure a checkout that is not the
installed one, run it with `PYTHONPATH=.` from that checkout (the JSON records which
was imported).

Prints a table with the ratio ours/TF of the median rates and the median of per-round
ratios (paired; target: >= 1.0, at least as fast) and writes
`benchmarks/results/host.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

DENSE_SIZE = 1 << 20
ROWS, ROW_DIM, NNZ, POOL = 100_000, 64, 4096, 8
FUTURE = 10**9  # a local_step no take ever makes stale
RESULTS = Path(__file__).resolve().parent / "results"
CASES = [(kind, op, t) for kind in ("dense", "sparse") for op in ("apply", "take") for t in (1, 4)]


def gradients(kind: str) -> list:
    rng = np.random.default_rng(0)
    if kind == "dense":
        return [rng.standard_normal(DENSE_SIZE, np.float32) for _ in range(POOL)]
    return [
        (
            np.sort(rng.choice(ROWS, NNZ, replace=False)).astype(np.int64),
            rng.standard_normal((NNZ, ROW_DIM), np.float32),
        )
        for _ in range(POOL)
    ]


# --------------------------------------------------------------------------- the two sides


class Ours:
    """optax_accum's host objects (imported lazily: the TF worker has no JAX)."""

    name = "optax_accum"

    def __init__(self, sync_cpu: bool = False) -> None:
        import jax

        if sync_cpu:  # must precede the first use of the CPU backend
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        import optax_accum

        self.jax, self.lib = jax, optax_accum

    def make(self, kind: str) -> Any:
        if kind == "dense":
            return self.lib.ConditionalAccumulator(np.float32, shape=(DENSE_SIZE,))
        return self.lib.SparseConditionalAccumulator(np.float32, shape=(ROWS, ROW_DIM))

    def apply(self, acc: Any, kind: str, grad: Any) -> None:
        if kind == "dense":
            acc.apply_grad(grad, local_step=FUTURE)
        else:
            acc.apply_grad(grad[0], grad[1], local_step=FUTURE)

    def take(self, acc: Any, kind: str, n: int) -> None:
        self.jax.block_until_ready(acc.take_grad(n, timeout=600))


class TensorFlow:
    """TF's own accumulators: dense eagerly, sparse through a v1 Session."""

    name = "tensorflow"

    def __init__(self) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf

        self.tf = tf
        self.version = tf.__version__
        # Eager accumulators without a shared_name share one resource name, and
        # deleting one destroys the next one's resource: keep every one alive, named.
        self.alive: list = []

    def make(self, kind: str) -> Any:
        tf = self.tf
        if kind == "dense":
            acc = tf.compat.v1.ConditionalAccumulator(
                tf.float32, shape=(DENSE_SIZE,), shared_name=f"bench{len(self.alive)}"
            )
            self.alive.append(acc)
            return acc
        graph = tf.Graph()
        with graph.as_default():
            acc = tf.compat.v1.SparseConditionalAccumulator(tf.float32, shape=(ROWS, ROW_DIM))
            indices = tf.compat.v1.placeholder(tf.int64, [None])
            values = tf.compat.v1.placeholder(tf.float32, [None, ROW_DIM])
            n = tf.compat.v1.placeholder(tf.int32, [])
            ops = {
                "apply": acc.apply_grad(indices, values, local_step=FUTURE),
                "take": acc.take_grad(n),
                "indices": indices,
                "values": values,
                "n": n,
            }
        return tf.compat.v1.Session(graph=graph), ops

    def apply(self, acc: Any, kind: str, grad: Any) -> None:
        if kind == "dense":
            acc.apply_grad(grad, local_step=FUTURE)
        else:
            session, ops = acc
            session.run(ops["apply"], {ops["indices"]: grad[0], ops["values"]: grad[1]})

    def take(self, acc: Any, kind: str, n: int) -> None:
        if kind == "dense":
            acc.take_grad(n).numpy()  # an eager CPU tensor: a view, no copy
        else:
            session, ops = acc
            session.run(ops["take"], {ops["n"]: n})


# --------------------------------------------------------------------------- workloads


def measure(side: Any, kind: str, op: str, threads: int, per_thread: int, grads: list) -> float:
    """One timed run of a workload on a fresh accumulator; returns events per second."""
    acc = side.make(kind)
    side.apply(acc, kind, grads[0])  # warm up every kernel this run will use
    side.take(acc, kind, 1)
    errors: list[BaseException] = []

    def guarded(fn: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as e:
                errors.append(e)

        return run

    if op == "apply":

        def actor(seed: int) -> None:
            for i in range(per_thread):
                side.apply(acc, kind, grads[(seed + i) % len(grads)])

        workers = [threading.Thread(target=guarded(actor), args=(s,)) for s in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join(600)
        side.take(acc, kind, threads * per_thread)
        elapsed = time.perf_counter() - start
        events = threads * per_thread
    else:
        stop = threading.Event()

        def actor(seed: int) -> None:
            i = seed
            while not stop.is_set():
                side.apply(acc, kind, grads[i % len(grads)])
                i += 1

        workers = [threading.Thread(target=guarded(actor), args=(s,)) for s in range(threads)]
        for w in workers:
            w.start()
        start = time.perf_counter()
        for _ in range(per_thread):
            side.take(acc, kind, threads)
        elapsed = time.perf_counter() - start
        stop.set()
        for w in workers:
            w.join(600)
        events = per_thread
    if errors:
        raise errors[0]
    return events / elapsed


def tf_worker() -> None:
    """Serves measurements for the parent, one JSON request per line on stdin."""
    side = TensorFlow()
    cache = {kind: gradients(kind) for kind in ("dense", "sparse")}
    print(json.dumps({"version": side.version}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        rate = measure(side, req["kind"], req["op"], req["threads"], req["k"], cache[req["kind"]])
        print(json.dumps({"rate": rate}), flush=True)


class RemoteTF:
    """The TF side, running `tf_worker` under another interpreter."""

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen(
            [python, __file__, "--tf-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the TF worker under {python} failed to start")
        self.version = json.loads(hello)["version"]

    def measure(self, kind: str, op: str, threads: int, k: int) -> float:
        request = {"kind": kind, "op": op, "threads": threads, "k": k}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["rate"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def tf_in_process() -> Any:
    try:
        side = TensorFlow()
    except ImportError:
        return None
    cache = {kind: gradients(kind) for kind in ("dense", "sparse")}

    class Local:
        version = side.version

        def measure(self, kind: str, op: str, threads: int, k: int) -> float:
            return measure(side, kind, op, threads, k, cache[kind])

        def close(self) -> None:
            pass

    return Local()


# --------------------------------------------------------------------------- main


def run(
    tf_python: str | None = None,
    rounds: int = 5,
    k: dict[str, int] | None = None,
    only: str = "",
    sync_cpu: bool = False,
    progress: Any = None,
) -> dict:
    """Every figure: rates per workload for both sides (TF's when it can run), as
    medians over `rounds` interleaved rounds after a warm-up round."""
    k = k or {"dense": 100, "sparse": 50}
    ours = Ours(sync_cpu=sync_cpu)
    print(f"optax_accum from {Path(ours.lib.__file__).parent}")
    tf = RemoteTF(tf_python) if tf_python else tf_in_process()
    if tf is None:
        print("TensorFlow is not importable here and --tf-python was not given: no ratios.")
    grads = {kind: gradients(kind) for kind in ("dense", "sparse")}
    cases = [(kind, op, t) for kind, op, t in CASES if only in f"{kind}_{op}_{t}t"]
    samples: dict[str, dict[str, list[float]]] = {
        f"{kind}_{op}_{t}t": {"ours": [], "tf": []} for kind, op, t in cases
    }
    work = [(r, c) for r in range(rounds + 1) for c in cases]
    try:
        # Round 0 warms up (compilations, allocator, buffer growth) and is discarded.
        for round_, (kind, op, t) in progress(work, desc="host") if progress else work:
            key = f"{kind}_{op}_{t}t"
            rate = measure(ours, kind, op, t, k[kind], grads[kind])
            theirs = tf.measure(kind, op, t, k[kind]) if tf is not None else None
            if round_:
                samples[key]["ours"].append(rate)
                samples[key]["tf"].append(theirs)
    finally:
        if tf is not None:
            tf.close()

    unit = {"apply": "grads/s", "take": "takes/s"}
    figures = {}
    for kind, op, t in cases:
        key = f"{kind}_{op}_{t}t"
        mine = statistics.median(samples[key]["ours"])
        figures[key] = {"unit": unit[op], "optax_accum": mine}
        if tf is not None:
            theirs = statistics.median(samples[key]["tf"])
            paired = statistics.median(
                a / b for a, b in zip(samples[key]["ours"], samples[key]["tf"], strict=True)
            )
            figures[key].update(tensorflow=theirs, ratio=mine / theirs, paired_ratio=paired)
    return {
        "script": "host.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "tensorflow": tf.version if tf is not None else None,
        "optax_accum": ours.lib.__file__,
        "setup": {
            "dense_size": DENSE_SIZE,
            "sparse": {"rows": ROWS, "row_dim": ROW_DIM, "nnz": NNZ, "pool": POOL},
            "rounds": rounds,
            "per_thread": k,
            "jax_cpu_enable_async_dispatch": not sync_cpu,
        },
        "figures": figures,
        "samples": samples,
    }


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: our rates, and ours / TF's (paired) when
    `--tf-python` names a Python with TensorFlow (or TF is importable here)."""
    from benchmarks._report import Row

    k = {"dense": 4, "sparse": 4} if scale.quick else {"dense": 100, "sparse": 50}
    out = run(
        scale.options.get("tf_python"),
        1 if scale.quick else 5,
        k,
        progress=scale.progress,
    )
    rows = []
    for key, f in out["figures"].items():
        kind, op, threads = key.split("_")
        case = f"{kind} {op}, {threads[:-1]} thread{'s' if threads != '1t' else ''}"
        rows.append(Row("host", case, "ours", f["optax_accum"], f["unit"]))
        if "paired_ratio" in f:
            rows.append(
                Row.checked("host", case, "ours / TF (paired)", f["paired_ratio"], (1.0, "min"))
            )
    return rows, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf-python", help="a Python interpreter that can import tensorflow")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dense-k", type=int, default=100, help="gradients per thread")
    parser.add_argument("--sparse-k", type=int, default=50, help="gradients per thread")
    parser.add_argument("--only", default="", help="run the workloads whose name has this")
    parser.add_argument(
        "--sync-cpu",
        action="store_true",
        help="run JAX's CPU kernels inline (jax_cpu_enable_async_dispatch=False)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "host.json")
    parser.add_argument("--tf-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tf_worker:
        tf_worker()
        return

    k = {"dense": args.dense_k, "sparse": args.sparse_k}
    report = run(args.tf_python, args.rounds, k, args.only, args.sync_cpu)
    print(
        f"{'workload':<24}{'optax_accum':>12}{'tensorflow':>12}{'ratio':>7}{'paired':>8}"
        "  (median rates; paired = median of per-round ratios; target >= 1.0)"
    )
    for key, f in report["figures"].items():
        line = f"{key + ' ' + f['unit']:<24}{f['optax_accum']:>12.1f}"
        if "paired_ratio" in f:
            met = "met" if f["paired_ratio"] >= 1.0 else "NOT met"
            line += f"{f['tensorflow']:>12.1f}{f['ratio']:>7.2f}{f['paired_ratio']:>8.2f}  {met}"
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
