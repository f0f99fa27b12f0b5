"""Is `optax_accum.ray`'s accumulator as fast as the bare Ray floor?

Four worker processes (Ray actors) send float32 gradients of 4 MB and of 64 MB, each
as fast as it can, for about the same number of bytes per size. Each apply's latency
(the worker's blocking call, from sending to the answer) and the aggregate throughput
(bytes sent by all four over the wall time from the first send to the last answer)
are measured for:

- ours: `optax_accum.ray.ConditionalAccumulator(..., reduction_type="SUM")`, its
  `apply_grad` (checked, accepted, added by the in-process object in the actor);
- the floor: a bare Ray actor whose method only adds the payload to a NumPy array in
  place (`total += grad`): Ray's transport and nothing else.

Both receive the same NumPy payloads the same way (through Ray's object store).
Targets: our p50 and p99 latency at most 1.3x the floor's, our throughput at least
0.8x. The workers are processes of one local Ray cluster on this machine.

    python benchmarks/ray_host.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS = 4
MB = 1 << 20
# Bytes sent per worker and size (4 MB: 24 applies each; 64 MB: 6): the same work.
FULL = {4 * MB: 24, 64 * MB: 6}
QUICK = {64 * 1024: 8, MB: 4}
WARMUP = 5  # applies per worker before the timed ones (the actor compiles its kernels)
TARGETS = {"latency": 1.3, "throughput": 0.8}


def _label(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // 1024} KB"


def _actors() -> tuple[Any, Any]:
    """The worker and floor actor classes (defined once Ray is imported)."""
    import ray

    @ray.remote(num_cpus=0)
    class Floor:
        """Ray's transport and a NumPy add: the least an accumulator actor can do."""

        def __init__(self, size: int) -> None:
            self.total = np.zeros(size, np.float32)

        def add(self, grad: np.ndarray) -> bool:
            self.total += grad
            return True

    @ray.remote(num_cpus=0)
    class Worker:
        def ready(self) -> int:
            return os.getpid()

        def prepare(self, target: Any, kind: str, size: int, warmup: int) -> None:
            """Sets the target and the payload, and sends `warmup` untimed applies."""
            grad = np.ones(size, np.float32)
            if kind == "ours":
                self.apply = lambda: target.apply_grad(grad)
            else:
                self.apply = lambda: ray.get(target.add.remote(grad))
            for _ in range(warmup):
                self.apply()

        def send(self, count: int) -> dict:
            latencies, start = [], time.time()
            for _ in range(count):
                begin = time.perf_counter()
                assert self.apply()
                latencies.append(time.perf_counter() - begin)
            return {"start": start, "end": time.time(), "latencies": latencies}

    return Floor, Worker


def _measure(workers: list, target: Any, kind: str, size: int, count: int) -> dict:
    import ray

    ray.get([w.prepare.remote(target, kind, size // 4, WARMUP) for w in workers])
    runs = ray.get([w.send.remote(count) for w in workers])  # all four at once
    latencies = np.concatenate([r["latencies"] for r in runs]) * 1e3
    seconds = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {
        "p50_ms": float(np.percentile(latencies, 50)),
        "p99_ms": float(np.percentile(latencies, 99)),
        "mb_per_s": WORKERS * count * size / MB / seconds,
        "applies": int(latencies.size),
    }


def run(quick: bool = False, progress: Any = None) -> dict:
    """Ours and the floor at each size; starts a local Ray cluster if none is running."""
    import ray

    import optax_accum.ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        floor_type, worker_type = _actors()
        workers = [worker_type.remote() for _ in range(WORKERS)]
        ray.get([w.ready.remote() for w in workers])
        sizes = QUICK if quick else FULL
        figures = {}
        for size, count in (progress or (lambda x, **_: x))(sizes.items(), desc="ray_host"):
            ours = optax_accum.ray.ConditionalAccumulator(
                np.float32, shape=(size // 4,), reduction_type="SUM"
            )
            floor = floor_type.remote(size // 4)
            # Floor first, then ours, then the floor again: the ratios use the floor's
            # better run, so a quieter moment helps the floor, never us.
            first = _measure(workers, floor, "floor", size, count)
            mine = _measure(workers, ours, "ours", size, count)
            second = _measure(workers, floor, "floor", size, count)
            best = {
                "p50_ms": min(first["p50_ms"], second["p50_ms"]),
                "p99_ms": min(first["p99_ms"], second["p99_ms"]),
                "mb_per_s": max(first["mb_per_s"], second["mb_per_s"]),
            }
            total = float(np.asarray(ours.take_grad(ours.num_accumulated(), timeout=600))[0])
            assert total == WORKERS * (count + WARMUP), total  # every apply counted once
            figures[_label(size)] = {"ours": mine, "floor": best, "floor_runs": [first, second]}
            ours.kill()
            ray.kill(floor)
        for w in workers:
            ray.kill(w)
    finally:
        if started:
            ray.shutdown()
    return {
        "workers": WORKERS,
        "load_average_at_end": os.getloadavg(),
        "ray": ray.__version__,
        "figures": figures,
    }


def _rows(out: dict) -> list:
    from benchmarks._report import Row

    rows = []
    for label, f in out["figures"].items():
        case = f"{label}, {WORKERS} workers"
        ours, floor = f["ours"], f["floor"]
        for p in ("p50", "p99"):
            rows.append(Row("ray_host", case, f"apply latency {p}, ours", ours[f"{p}_ms"], "ms"))
            rows.append(
                Row.checked(
                    "ray_host",
                    case,
                    f"apply latency {p}, ours / bare actor",
                    ours[f"{p}_ms"] / floor[f"{p}_ms"],
                    (TARGETS["latency"], "max"),
                )
            )
        rows.append(Row("ray_host", case, "throughput, ours", ours["mb_per_s"], "MB/s"))
        rows.append(
            Row.checked(
                "ray_host",
                case,
                "throughput, ours / bare actor",
                ours["mb_per_s"] / floor["mb_per_s"],
                (TARGETS["throughput"], "min"),
            )
        )
    return rows


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`."""
    out = run(scale.quick, scale.progress)
    return _rows(out), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", type=Path, default=RESULTS / "ray_host.json")
    args = parser.parse_args()
    load = os.getloadavg()
    out = run(args.quick)
    out["load_average_at_start"] = load
    for row in _rows(out):
        verdict = "" if row.met is None else ("met" if row.met else "NOT met")
        print(f"{row.case:<18} {row.figure:<38} {row.value:10.3f} {row.unit:<5} {verdict}")
    print(f"load average {load} at start, {out['load_average_at_end']} at end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
