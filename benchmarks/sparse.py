"""Is `sparse_conditional_accumulator` the fast way to accumulate embedding gradients?

Setup (issues 3 and 13): a float32 table of 1,000,000 x 64 (and, on an accelerator,
10,000,000 x 64), gradients of 4096 distinct random rows, `num_required=8`,
`capacity=32768`, `sparse_sgd` inside. The baseline is `optax.MultiSteps(optax.sgd)`
fed the equivalent dense gradient (what a user gets from `jax.grad` of an embedding
lookup). Measured side by side in one run, as medians of interleaved rounds after a
warm-up, every jitted call donating what it carries:

  (a) the canonical optax train step, `u, s = tx.update(g, s, p)` then
      `p = apply_updates(p, u)`, returning `(params, opt_state)`, both donated,
      averaged over whole 8-call cycles (7 held, 1 released);
  (b) `tx.update` alone (the state donated), over whole cycles;
  (c) bytes of state.

Targets: on this CPU, (b) at least 20x faster than MultiSteps; on a GPU, (a) at least
10x faster at 1M rows and 20x at 10M; everywhere, (c) at most 10% of MultiSteps'.

Runs on whatever backend JAX finds and prints its device kind and the jax version. The
10M table is measured only off the CPU (it needs about 10 GB); `--check-lowering`
lowers both train steps at every size for TPU and GPU from here, without running them.

Run: `python benchmarks/sparse.py` (add `--rounds 3` for a quick look). Prints a table
of ratios with the targets and writes everything to `benchmarks/results/sparse.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

SIZES = {"cpu": (1_000_000,), "accelerator": (1_000_000, 10_000_000)}
DIM = 64
NNZ = 4096
EVERY = 8
CAPACITY = 32768
LEARNING_RATE = 0.1
RESULTS = Path(__file__).resolve().parent / "results"

# (backend, rows or None for any) -> {ratio name: (target, "min" | "max")}
TARGETS = {
    ("cpu", None): {
        "update_speedup_vs_multisteps": (20.0, "min"),
        "state_bytes_vs_multisteps": (0.10, "max"),
    },
    ("gpu", 1_000_000): {
        "train_step_speedup_vs_multisteps": (10.0, "min"),
        "state_bytes_vs_multisteps": (0.10, "max"),
    },
    ("gpu", 10_000_000): {
        "train_step_speedup_vs_multisteps": (20.0, "min"),
        "state_bytes_vs_multisteps": (0.10, "max"),
    },
}


def targets_for(backend: str, rows: int) -> dict:
    return TARGETS.get((backend, rows), TARGETS.get((backend, None), {}))


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def make_transforms() -> tuple[Any, Any]:
    sparse_tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(LEARNING_RATE), EVERY, capacity=CAPACITY, sparse=True
    )
    return sparse_tx, optax.MultiSteps(optax.sgd(LEARNING_RATE), EVERY)


def train_step(tx: Any, apply_updates: Callable) -> Callable:
    """The canonical optax step, as users write it."""

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        params = apply_updates(params, updates)
        return params, opt_state

    return step


def update_only(tx: Any) -> Callable:
    def step(opt_state, grads):
        return (tx.update(grads, opt_state)[1],)

    return step


def sparse_gradients(rows: int, seed: int) -> list[optax_accum.IndexedSlices]:
    """EVERY gradients, each of NNZ distinct random rows (as an embedding batch gives)."""
    rng = np.random.default_rng(seed)
    grads = []
    for _ in range(EVERY):
        ids = rng.choice(rows, size=NNZ, replace=False).astype(np.int32)
        values = rng.standard_normal((NNZ, DIM), np.float32)
        grads.append(optax_accum.IndexedSlices(jnp.asarray(ids), jnp.asarray(values), (rows, DIM)))
    return grads


class Cycle:
    """A jitted step whose carried arguments are donated, called once per gradient.

    `step(*carry, grad) -> carry`; `run()` times one whole cycle (EVERY calls) and
    returns the seconds per call.
    """

    def __init__(self, step: Callable, carry: tuple, grads: list) -> None:
        self.fn = jax.jit(step, donate_argnums=tuple(range(len(carry))))
        self.carry = jax.tree.map(jnp.copy, carry)  # `init` may share buffers; donation can't
        self.grads = grads

    def run(self) -> float:
        start = time.perf_counter()
        for g in self.grads:
            self.carry = self.fn(*self.carry, g)
        jax.block_until_ready(self.carry)
        return (time.perf_counter() - start) / len(self.grads)

    def close(self) -> None:
        self.carry = None


def interleaved(contenders: dict[str, Cycle], rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender, timed in alternation after a warm-up."""
    for c in contenders.values():
        c.run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, c in contenders.items():
            times[name].append(c.run())
    for c in contenders.values():
        c.close()
    return {name: statistics.median(t) for name, t in times.items()}


def measure(rows: int, rounds: int) -> dict:
    """Every figure for one table size."""
    sparse_tx, dense_tx = make_transforms()
    grads = sparse_gradients(rows, 0)
    # The dense equivalent; MultiSteps' cost does not depend on the values, so one
    # dense gradient serves every call (and keeps memory down).
    dense_grad = [grads[0].to_dense()] * EVERY
    table = jnp.asarray(np.random.default_rng(1).standard_normal((rows, DIM), np.float32))
    state_bytes = {
        "sparse": tree_bytes(jax.eval_shape(sparse_tx.init, table)),
        "multisteps": tree_bytes(jax.eval_shape(dense_tx.init, table)),
    }
    steps = interleaved(
        {
            "sparse": Cycle(
                train_step(sparse_tx, optax_accum.apply_updates),
                (table, sparse_tx.init(table)),
                grads,
            ),
            "multisteps": Cycle(
                train_step(dense_tx, optax.apply_updates), (table, dense_tx.init(table)), dense_grad
            ),
        },
        rounds,
    )
    updates = interleaved(
        {
            "sparse": Cycle(update_only(sparse_tx), (sparse_tx.init(table),), grads),
            "multisteps": Cycle(update_only(dense_tx), (dense_tx.init(table),), dense_grad),
        },
        rounds,
    )
    return {
        "seconds_per_train_step": steps,
        "seconds_per_update": updates,
        "state_bytes": state_bytes,
        "ratios": {
            "train_step_speedup_vs_multisteps": steps["multisteps"] / steps["sparse"],
            "update_speedup_vs_multisteps": updates["multisteps"] / updates["sparse"],
            "state_bytes_vs_multisteps": state_bytes["sparse"] / state_bytes["multisteps"],
        },
    }


def check_lowering(sizes: tuple[int, ...]) -> dict:
    """Lowers both train steps for TPU and GPU at each size, from abstract shapes (no
    memory, nothing runs): the program an accelerator would get, built here."""
    sparse_tx, dense_tx = make_transforms()
    out = {}
    for rows in sizes:
        table = jax.ShapeDtypeStruct((rows, DIM), jnp.float32)
        grad = optax_accum.IndexedSlices(
            jax.ShapeDtypeStruct((NNZ,), jnp.int32),
            jax.ShapeDtypeStruct((NNZ, DIM), jnp.float32),
            (rows, DIM),
        )
        contenders = {
            "sparse": (train_step(sparse_tx, optax_accum.apply_updates), sparse_tx, grad),
            "multisteps": (train_step(dense_tx, optax.apply_updates), dense_tx, table),
        }
        for name, (step, tx, g) in contenders.items():
            state = jax.eval_shape(tx.init, table)
            for target in ("tpu", "cuda"):
                lowered = jax.jit(step, donate_argnums=(0, 1)).trace(table, state, g)
                text = lowered.lower(lowering_platforms=(target,)).as_text()
                out[f"{name} {rows:,} {target}"] = {
                    "sorts": text.count('"stablehlo.sort"'),
                    "conditionals": text.count('"stablehlo.case"'),
                    "loops": text.count("stablehlo.while"),
                }
    return out


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: 1M rows (and 10M on an accelerator; 10k
    rows with `scale.quick`)."""
    from benchmarks._report import Row

    backend = jax.default_backend()
    sizes = (10_000,) if scale.quick else SIZES["accelerator" if scale.accelerator else "cpu"]
    rounds = 1 if scale.quick else 5
    results, rows = {}, []
    for n in scale.progress(sizes, desc="sparse"):
        figures = results[str(n)] = measure(n, rounds)
        targets, ratios = targets_for(backend, n), figures["ratios"]
        case = f"{n:,} x {DIM}"
        labels = {
            "train_step_speedup_vs_multisteps": "train step, MultiSteps / ours",
            "update_speedup_vs_multisteps": "update, MultiSteps / ours",
            "state_bytes_vs_multisteps": "state bytes, ours / MultiSteps",
        }
        for key, label in labels.items():
            rows.append(Row.checked("sparse", case, label, ratios[key], targets.get(key)))
        for key, label in (
            ("seconds_per_train_step", "train step"),
            ("seconds_per_update", "update"),
        ):
            rows.append(Row("sparse", case, f"{label}, ours", 1e3 * figures[key]["sparse"], "ms"))
    setup = {"dim": DIM, "nnz": NNZ, "every": EVERY, "capacity": CAPACITY, "rounds": rounds}
    return rows, {"setup": setup, "by_rows": results}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per contender")
    parser.add_argument(
        "--rows", type=int, nargs="*", help="table rows (default: 1M, and 10M off the CPU)"
    )
    parser.add_argument(
        "--check-lowering", action="store_true", help="also lower for TPU and GPU from here"
    )
    args = parser.parse_args()

    backend = jax.default_backend()
    device = jax.devices()[0]
    sizes = tuple(args.rows) if args.rows else SIZES["cpu" if backend == "cpu" else "accelerator"]
    print(
        f"jax {jax.__version__} on {backend}: {device.device_kind} "
        f"(x{jax.device_count()}); load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{DIM} float32 columns, {NNZ} rows per gradient, every {EVERY}, capacity "
        f"{CAPACITY:,}; medians of {args.rounds} interleaved rounds"
    )
    results = {}
    for rows in sizes:
        figures = measure(rows, args.rounds)
        ratios = figures["ratios"]
        targets = targets_for(backend, rows)
        met = {
            name: (ratios[name] >= t if kind == "min" else ratios[name] <= t)
            for name, (t, kind) in targets.items()
        }
        figures["targets"] = {
            k: {"target": t, "kind": kind, "met": met[k]} for k, (t, kind) in targets.items()
        }
        results[rows] = figures
        print(f"\ntable {rows:,} x {DIM}")
        print(f"{'':28}{'sparse':>14}{'MultiSteps':>14}{'ratio':>10}  target")
        table_rows = [
            ("train step (ms per call)", "seconds_per_train_step", 1e3, "train_step_speedup"),
            ("update (ms per call)", "seconds_per_update", 1e3, "update_speedup"),
            ("state (MB)", "state_bytes", 1e-6, "state_bytes"),
        ]
        for label, key, scale, ratio in table_rows:
            ratio = f"{ratio}_vs_multisteps"
            verdict = "-"
            if ratio in targets:
                t, kind = targets[ratio]
                sign = ">=" if kind == "min" else "<="
                verdict = f"{sign} {t:g}: {'met' if met[ratio] else 'MISSED'}"
            fig = figures[key]
            print(
                f"{label:28}{fig['sparse'] * scale:>14.2f}{fig['multisteps'] * scale:>14.2f}"
                f"{ratios[ratio]:>10.3g}  {verdict}"
            )

    lowering = None
    if args.check_lowering:
        lowering = check_lowering(SIZES["accelerator"])
        print("\nlowered for TPU and GPU (not run):")
        for name, facts in lowering.items():
            print(f"  {name}: {facts}")

    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
            "jax": jax.__version__,
            "backend": backend,
            "device_kind": device.device_kind,
            "devices": str(jax.devices()),
        },
        "setup": {
            "rows": list(sizes),
            "dim": DIM,
            "nnz": NNZ,
            "every": EVERY,
            "capacity": CAPACITY,
            "rounds": args.rounds,
        },
        "by_rows": {str(rows): figures for rows, figures in results.items()},
        "lowering": lowering,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sparse.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
