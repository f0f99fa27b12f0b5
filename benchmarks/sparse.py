"""Is `sparse_conditional_accumulator` the fast way to accumulate embedding gradients?

Setup (issue 3): a 1,000,000 x 64 float32 table, gradients of 4096 random rows,
`num_required=8`, `capacity=32768`, `sparse_sgd` inside. The baseline is
`optax.MultiSteps(optax.sgd)` fed the equivalent dense gradient (what a user gets from
`jax.grad` of an embedding lookup). Measured side by side in one run, as medians of
interleaved rounds after a warm-up, every jitted call donating its state (and params):

  (a) `tx.update` alone, averaged over whole 8-call cycles (7 held, 1 released);
  (b) a user's train step, `update` then `apply_updates`, over whole cycles;
  (c) bytes of state.

Targets: (a) at least 20x faster than MultiSteps; (c) state at most 10% of MultiSteps'.

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

ROWS, DIM = 1_000_000, 64
NNZ = 4096
EVERY = 8
CAPACITY = 32768
LEARNING_RATE = 0.1
RESULTS = Path(__file__).resolve().parent / "results"

# ratio name -> (target, "min": must reach at least, "max": must stay at or below)
TARGETS = {
    "update_speedup_vs_multisteps": (20.0, "min"),
    "state_bytes_vs_multisteps": (0.10, "max"),
}


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


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
    """A jitted step with donated carry, called once per gradient of a cycle.

    `step(carry, grad) -> carry`; `run()` times one whole cycle (EVERY calls) and
    returns the seconds per call.
    """

    def __init__(self, step: Callable, carry: Any, grads: list) -> None:
        self.fn = jax.jit(step, donate_argnums=0)
        self.carry = jax.tree.map(jnp.copy, carry)  # `init` may share buffers; donation can't
        self.grads = grads

    def run(self) -> float:
        start = time.perf_counter()
        for g in self.grads:
            self.carry = self.fn(self.carry, g)
        jax.block_until_ready(self.carry)
        return (time.perf_counter() - start) / len(self.grads)


def interleaved(contenders: dict[str, Cycle], rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender, timed in alternation after a warm-up."""
    for c in contenders.values():
        c.run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, c in contenders.items():
            times[name].append(c.run())
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per contender")
    parser.add_argument("--rows", type=int, default=ROWS, help="table rows (smoke tests)")
    args = parser.parse_args()

    sparse_tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(LEARNING_RATE), EVERY, capacity=CAPACITY, sparse=True
    )
    dense_tx = optax.MultiSteps(optax.sgd(LEARNING_RATE), EVERY)
    grads = sparse_gradients(args.rows, 0)
    # The dense equivalent; MultiSteps' cost does not depend on the values, so one
    # dense gradient serves every call (and keeps memory down).
    dense_grad = [grads[0].to_dense()] * EVERY
    table = jnp.asarray(np.random.default_rng(1).standard_normal((args.rows, DIM), np.float32))

    sparse_state, dense_state = sparse_tx.init(table), dense_tx.init(table)
    state_bytes = {"sparse": tree_bytes(sparse_state), "multisteps": tree_bytes(dense_state)}

    def sparse_update(state, g):
        return sparse_tx.update(g, state)[1]

    def dense_update(state, g):
        return dense_tx.update(g, state)[1]

    updates = interleaved(
        {
            "sparse": Cycle(sparse_update, sparse_state, grads),
            "multisteps": Cycle(dense_update, dense_state, dense_grad),
        },
        args.rounds,
    )

    def sparse_step(carry, g):
        params, state = carry
        u, state = sparse_tx.update(g, state, params)
        return optax_accum.apply_updates(params, u), state

    def dense_step(carry, g):
        params, state = carry
        u, state = dense_tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    steps = interleaved(
        {
            "sparse": Cycle(sparse_step, (jnp.copy(table), sparse_tx.init(table)), grads),
            "multisteps": Cycle(dense_step, (table, dense_tx.init(table)), dense_grad),
        },
        args.rounds,
    )

    ratios = {
        "update_speedup_vs_multisteps": updates["multisteps"] / updates["sparse"],
        "train_step_speedup_vs_multisteps": steps["multisteps"] / steps["sparse"],
        "state_bytes_vs_multisteps": state_bytes["sparse"] / state_bytes["multisteps"],
    }
    met = {
        name: (ratios[name] >= target if kind == "min" else ratios[name] <= target)
        for name, (target, kind) in TARGETS.items()
    }

    print(
        f"table {args.rows:,} x {DIM} float32, {NNZ} rows per gradient, every {EVERY}, "
        f"capacity {CAPACITY:,}; medians of {args.rounds} interleaved rounds"
    )
    print(f"{'':28}{'sparse':>14}{'MultiSteps':>14}{'ratio':>10}  target")
    rows = [
        ("update (ms per call)", updates, 1e3, "update_speedup_vs_multisteps"),
        ("train step (ms per call)", steps, 1e3, "train_step_speedup_vs_multisteps"),
        ("state (MB)", state_bytes, 1e-6, "state_bytes_vs_multisteps"),
    ]
    for label, figures, scale, ratio in rows:
        target = TARGETS.get(ratio)
        verdict = "-"
        if target:
            sign = ">=" if target[1] == "min" else "<="
            verdict = f"{sign} {target[0]:g}: {'met' if met[ratio] else 'MISSED'}"
        print(
            f"{label:28}{figures['sparse'] * scale:>14.2f}{figures['multisteps'] * scale:>14.2f}"
            f"{ratios[ratio]:>10.3g}  {verdict}"
        )

    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg(),
            "jax": jax.__version__,
            "devices": str(jax.devices()),
        },
        "setup": {
            "rows": args.rows,
            "dim": DIM,
            "nnz": NNZ,
            "every": EVERY,
            "capacity": CAPACITY,
            "rounds": args.rounds,
        },
        "seconds_per_update": updates,
        "seconds_per_train_step": steps,
        "state_bytes": state_bytes,
        "ratios": ratios,
        "targets": {
            k: {"target": t, "kind": kind, "met": met[k]} for k, (t, kind) in TARGETS.items()
        },
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sparse.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
