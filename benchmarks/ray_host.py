"""Is `optax_accum.ray`'s accumulator as fast as the bare Ray floor, how fast does its
actor start, and how much work survives faults?

Throughput and latency. Four worker processes (Ray actors) send float32 gradients of
1 MB and of 16 MB, each as fast as it can, for about the same number of bytes per
size. Each apply's latency (the worker's blocking call, from sending to the answer)
and the aggregate throughput (bytes sent by all four over the wall time from the
first send to the last answer) are measured for:

- ours: `optax_accum.ray.ConditionalAccumulator(..., reduction_type="SUM")`, its
  `apply_grad` (checked, identified, accepted and added by the host core in the
  actor);
- the floor: a bare Ray actor whose method only adds the payload to a NumPy array in
  place (`total += grad`): Ray's transport and nothing else.

Both receive the same NumPy payloads the same way (through Ray's object store). The
two run in turn, `ROUNDS` times (the order alternating), and each figure is the
median of the per-round ratios: this machine is shared, and a single run's ratio
swings by half. Targets: our p50 latency at most 1.3x the floor's, our throughput at
least 0.8x.

Start (full runs): a fresh accumulator's actor, from building the handle to its
first answer, its process's CPU time and memory (resident and unique), against a
bare Ray actor's.

Goodput (full runs): four workers and a chief (each its own process) on an
accumulator with a checkpoint, fault-free, then with one fault every few seconds in
turn (a worker SIGKILLed and replaced, a worker paused for a second, the chief
killed in a take and restarted, the actor SIGKILLed and restarted by Ray): gradients
taken per second, and the ratio.

    python benchmarks/ray_host.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
MB = 1 << 20
# Applies per worker and round: 48 MB of 1 MB gradients, 192 MB of 16 MB ones (a round
# of 16 MB ones lasts a few seconds: shorter ones measured mostly the machine's noise).
FULL = {MB: 48, 16 * MB: 12}
QUICK = {64 * 1024: 8, MB: 4}
ROUNDS = {"full": 5, "quick": 1}
WARMUP = 3  # applies per worker before the timed ones
TARGETS = {"latency": 1.3, "throughput": 0.8}
GOODPUT_SECONDS, FAULT_EVERY = 20.0, 4.0
GOODPUT_SIZE = 16 * 1024  # floats per gradient (64 KB)


def _label(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // 1024} KB"


def _actors() -> tuple[Any, Any, Any]:
    """The worker, floor and bare actor classes (defined once Ray is imported)."""
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
    class Bare:
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Worker:
        def pid(self) -> int:
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

        def push(self, acc: Any, stop: str) -> None:
            """Sends ones (a SUM take's first entry counts its gradients) until `stop`
            exists, tagged with the step it last read."""
            grad, step = np.ones(acc.shape[0], np.float32), acc.global_step
            while not os.path.exists(stop):
                if not acc.apply_grad(grad, local_step=step):
                    step = acc.global_step

        def chief(self, acc: Any, log: str, stop: str) -> None:
            """Takes SUMs of 4 gradients until `stop` exists, logging each take's
            count and time."""
            with open(log, "a", buffering=1) as f:
                while not os.path.exists(stop):
                    try:
                        taken = acc.take_grad(WORKERS, timeout=1.0)
                    except TimeoutError:
                        continue
                    f.write(f"{time.time()} {float(np.asarray(taken)[0])}\n")

    return Floor, Worker, Bare


# --------------------------------------------------------------------------- throughput


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


def _throughput(workers: list, floor_type: Any, size: int, count: int, rounds: int) -> dict:
    import optax_accum.ray

    ours = optax_accum.ray.ConditionalAccumulator(
        np.float32, shape=(size // 4,), reduction_type="SUM"
    )
    floor = floor_type.remote(size // 4)
    runs = []
    for r in range(rounds):  # the order alternates: a quieter moment favours neither
        pair = {}
        for kind in ("floor", "ours") if r % 2 == 0 else ("ours", "floor"):
            pair[kind] = _measure(workers, ours if kind == "ours" else floor, kind, size, count)
        runs.append(pair)
    total = float(np.asarray(ours.take_grad(ours.num_accumulated(), timeout=600))[0])
    assert total == WORKERS * rounds * (count + WARMUP), total  # every apply counted once
    ours.kill()

    def median_ratio(key: str) -> float:
        return statistics.median(p["ours"][key] / p["floor"][key] for p in runs)

    return {
        "ratios": {k: median_ratio(k) for k in ("p50_ms", "p99_ms", "mb_per_s")},
        "ours": {k: statistics.median(p["ours"][k] for p in runs) for k in runs[0]["ours"]},
        "floor": {k: statistics.median(p["floor"][k] for p in runs) for k in runs[0]["floor"]},
        "runs": runs,
    }


# --------------------------------------------------------------------------- start


def _process_figures(pid: int) -> dict:
    import psutil

    process = psutil.Process(pid)
    memory, cpu = process.memory_full_info(), process.cpu_times()
    return {
        "cpu_s": cpu.user + cpu.system,
        "rss_mb": memory.rss / MB,
        "uss_mb": memory.uss / MB,
        "jax": any("jaxlib" in m.path for m in process.memory_maps()),
    }


def _start(bare_type: Any, times: int = 3) -> dict:
    """A fresh accumulator actor's start against a bare actor's (medians)."""
    import ray

    import optax_accum.ray

    figures: dict[str, list] = {"ours": [], "bare": []}
    for _ in range(times):
        begin = time.perf_counter()
        acc = optax_accum.ray.ConditionalAccumulator(np.float32, shape=(1024,))
        pid = acc._call("pid")  # the actor's process, to measure
        figures["ours"].append({"start_s": time.perf_counter() - begin, **_process_figures(pid)})
        acc.kill()
        begin = time.perf_counter()
        bare = bare_type.remote()
        pid = ray.get(bare.pid.remote())
        figures["bare"].append({"start_s": time.perf_counter() - begin, **_process_figures(pid)})
        ray.kill(bare)
    return {
        who: {k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "jax"}
        | {"jax": any(run["jax"] for run in runs)}
        for who, runs in figures.items()
    }


# --------------------------------------------------------------------------- goodput


def _goodput(worker_type: Any, seconds: float, faults: bool) -> dict:
    """Gradients taken per second by a chief from four workers, each in its own
    process, with a fault every FAULT_EVERY seconds if `faults`."""
    import ray

    import optax_accum.ray

    directory = tempfile.mkdtemp(prefix="ray_host_goodput_")
    stop, log = os.path.join(directory, "stop"), os.path.join(directory, "taken")
    name = f"goodput-{os.getpid()}-{faults}"
    acc = optax_accum.ray.ConditionalAccumulator(
        np.float32,
        (GOODPUT_SIZE,),
        name,
        reduction_type="SUM",
        checkpoint_dir=os.path.join(directory, "checkpoint"),
        max_restarts=-1,
    )
    workers = [worker_type.remote() for _ in range(WORKERS)]
    chief = worker_type.remote()
    ray.get([w.pid.remote() for w in [*workers, chief]])
    for w in workers:
        w.push.remote(acc, stop)
    chief.chief.remote(acc, log, stop)
    begin, done, kinds = time.time(), [], ["worker", "pause", "chief", "actor"]
    while time.time() < begin + seconds:
        time.sleep(FAULT_EVERY if faults else seconds)
        if not faults or time.time() >= begin + seconds:
            continue
        kind = kinds[len(done) % len(kinds)]
        if kind == "worker":  # killed, and a new one started
            os.kill(ray.get(workers[0].pid.remote()), signal.SIGKILL)
            workers[0] = worker_type.remote()
            workers[0].push.remote(acc, stop)
        elif kind == "pause":
            pid = ray.get(workers[1].pid.remote())
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(pid, signal.SIGCONT)
        elif kind == "chief":  # killed (wherever it is) and restarted
            os.kill(ray.get(chief.pid.remote()), signal.SIGKILL)
            chief = worker_type.remote()
            chief.chief.remote(acc, log, stop)
        else:  # the actor: Ray restarts it from its checkpoint
            os.kill(acc._call("pid"), signal.SIGKILL)  # the actor's process
        done.append(kind)
    end = time.time()
    Path(stop).touch()
    lines = [line.split() for line in Path(log).read_text().splitlines()]
    taken = sum(float(n) for t, n in lines if begin <= float(t) <= end)
    time.sleep(1.5)  # the loops see `stop` (a take times out within 1 s)
    for process in [*workers, chief]:
        ray.kill(process)
    acc.kill()
    return {"gradients_per_s": taken / (end - begin), "seconds": end - begin, "faults": done}


# --------------------------------------------------------------------------- the run


def run(quick: bool = False, progress: Any = None) -> dict:
    """The figures; starts a local Ray cluster if none is running."""
    import ray

    started = not ray.is_initialized()
    if started:  # its workers import this checkout (the actor and worker classes)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
    try:
        floor_type, worker_type, bare_type = _actors()
        workers = [worker_type.remote() for _ in range(WORKERS)]
        ray.get([w.pid.remote() for w in workers])
        sizes, rounds = (QUICK, ROUNDS["quick"]) if quick else (FULL, ROUNDS["full"])
        figures: dict[str, Any] = {}
        for size, count in (progress or (lambda x, **_: x))(sizes.items(), desc="ray_host"):
            figures[_label(size)] = _throughput(workers, floor_type, size, count, rounds)
        for w in workers:
            ray.kill(w)
        if not quick:
            figures["start"] = _start(bare_type)
            fault_free = _goodput(worker_type, GOODPUT_SECONDS, faults=False)
            faulty = _goodput(worker_type, GOODPUT_SECONDS, faults=True)
            figures["goodput"] = {"fault-free": fault_free, "faults": faulty}
    finally:
        if started:
            ray.shutdown()
    return {
        "workers": WORKERS,
        "rounds": rounds,
        "load_average_at_end": os.getloadavg(),
        "ray": ray.__version__,
        "figures": figures,
    }


def _rows(out: dict) -> list:
    from benchmarks._report import Row

    rows = []
    for label, f in out["figures"].items():
        if label in ("start", "goodput"):
            continue
        case = f"{label}, {WORKERS} workers"
        ours, ratios = f["ours"], f["ratios"]
        for p in ("p50", "p99"):
            rows.append(Row("ray_host", case, f"apply latency {p}, ours", ours[f"{p}_ms"], "ms"))
        rows.append(
            Row.checked(
                "ray_host",
                case,
                "apply latency p50, ours / bare actor",
                ratios["p50_ms"],
                (TARGETS["latency"], "max"),
            )
        )
        rows.append(Row("ray_host", case, "apply latency p99, ours / bare actor", ratios["p99_ms"]))
        rows.append(Row("ray_host", case, "throughput, ours", ours["mb_per_s"], "MB/s"))
        rows.append(
            Row.checked(
                "ray_host",
                case,
                "throughput, ours / bare actor",
                ratios["mb_per_s"],
                (TARGETS["throughput"], "min"),
            )
        )
    start = out["figures"].get("start")
    if start is not None:
        for who in ("ours", "bare"):
            s = start[who]
            case = "actor start, " + ("accumulator" if who == "ours" else "bare Ray actor")
            rows.append(Row("ray_host", case, "first answer", s["start_s"], "s"))
            rows.append(Row("ray_host", case, "process CPU", s["cpu_s"], "s"))
            rows.append(Row("ray_host", case, "resident memory", s["rss_mb"], "MB"))
            rows.append(Row("ray_host", case, "unique memory", s["uss_mb"], "MB"))
    goodput = out["figures"].get("goodput")
    if goodput is not None:
        case = f"goodput, {WORKERS} workers and a chief"
        free, faulty = goodput["fault-free"], goodput["faults"]
        rows.append(Row("ray_host", case, "fault-free", free["gradients_per_s"], "grads/s"))
        rows.append(
            Row(
                "ray_host",
                case,
                f"a fault every {FAULT_EVERY:g} s",
                faulty["gradients_per_s"],
                "grads/s",
            )
        )
        rows.append(
            Row(
                "ray_host",
                case,
                "faults / fault-free",
                faulty["gradients_per_s"] / free["gradients_per_s"],
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
        print(f"{row.case:<38} {row.figure:<38} {row.value:10.3f} {row.unit:<7} {verdict}")
    print(f"load average {load} at start, {out['load_average_at_end']} at end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
