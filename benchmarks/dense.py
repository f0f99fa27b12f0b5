"""Is `conditional_accumulator` the fast way to accumulate dense gradients?

Setup: 8M parameters in 8 leaves, `optax.adam` inside, 8 gradients per emission,
every jitted step donating its state (and params) as a real train step does. Measured
side by side in one run, as medians of interleaved rounds after a warm-up:

  (a) a user's train step, `jit(update + optax.apply_updates)`, averaged over whole
      8-step cycles: optax_accum against `optax.MultiSteps`;
  (b) a held update alone (`jit(tx.update)`) against the floor, `jit(acc + g)`;
  (c) the emitting update alone against plain `jit(adam.update)`;
  (d) bytes of state and the compiled temporaries of the train step, against
      MultiSteps;
  (e) all of the above with bfloat16 params (float32 accumulator).

Run: `python benchmarks/dense.py` (add `--rounds 5` for a quick look). Prints a table of
ratios with the targets and writes everything to `benchmarks/results/dense.json`.
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

LEAVES = 8
LEAF_SHAPE = (1024, 1024)  # 8 x 1M = 8M parameters
EVERY = 8
RESULTS = Path(__file__).resolve().parent / "results"

# ratio name -> (target, "max" when the ratio must stay at or below the target,
# "min" when it must reach at least the target)
TARGETS = {
    "train_step_speedup_vs_multisteps": (2.0, "min"),
    "held_update_vs_floor": (1.5, "max"),
    "emit_update_vs_adam": (1.2, "max"),
    "state_bytes_vs_multisteps": (1.0, "max"),
    "temp_bytes_vs_multisteps": (1.0, "max"),
}


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def block(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def distinct(tree: Any) -> Any:
    """A copy of `tree` whose leaves own distinct buffers (`init` may share zeros)."""
    return block(jax.tree.map(jnp.copy, tree))


def make_tree(dtype: Any, seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}": jnp.asarray(scale * rng.standard_normal(LEAF_SHAPE, np.float32), dtype)
        for i in range(LEAVES)
    }


class Contender:
    """One compiled function with donated buffers, and the loop that times it.

    The function's first `len(carry)` arguments are donated and threaded through the
    calls: `next_carry(outputs)` picks them out of what it returns. `run(n)` calls it
    `n` times in a row, blocks, and returns the wall time per call.
    """

    def __init__(
        self, fn: Callable, carry: tuple, fixed: tuple, next_carry: Callable = lambda out: out
    ):
        self.carry = carry
        self.fixed = fixed  # arguments passed unchanged after the carried ones
        self.next_carry = next_carry
        donate = tuple(range(len(carry)))
        self.compiled = jax.jit(fn, donate_argnums=donate).lower(*carry, *fixed).compile()
        self.outputs: Any = None

    def step(self) -> None:
        self.outputs = self.compiled(*self.carry, *self.fixed)
        self.carry = self.next_carry(self.outputs)

    def run(self, n: int) -> float:
        block(self.carry)
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        block(self.outputs)
        return (time.perf_counter() - start) / n


def interleaved(contenders: dict[str, tuple[Contender, int, Callable | None]], rounds: int):
    """Medians (seconds per call) of `rounds` interleaved rounds, after one warm-up.

    Each entry is (contender, calls per sample, setup before each sample or None). The
    order of the contenders rotates every round, so load on the machine hits all alike.
    """
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            contender, calls, setup = contenders[k]
            if setup is not None:
                setup()
            t = contender.run(calls)
            if r:  # round 0 is the warm-up
                samples[k].append(t)
    return {k: statistics.median(v) for k, v in samples.items()}, samples


def train_step(tx: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def update_only(tx: optax.GradientTransformation) -> Callable:
    """`tx.update` alone, returning `(state, updates)`.

    State first: `jax.jit` pairs donated input buffers with outputs of the same shape
    in order, so with `(updates, state)` the first updates leaf would take over the
    buffer of the first state leaf, and every state leaf would shift onto its
    neighbour's buffer, which costs a full copy of the state per call.
    """

    def step(state, grads):
        updates, state = tx.update(grads, state)
        return state, updates

    return step


def new_state(outputs: tuple) -> tuple:
    """The carry of an update-only contender: the state it returned."""
    return (outputs[0],)


def memory(contender: Contender) -> dict:
    ma = contender.compiled.memory_analysis()
    return {
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
    }


def count_copies(contender: Contender) -> int:
    """Full-size `copy` instructions in the optimized HLO (0 is the goal)."""
    text = contender.compiled.as_text()
    return sum(
        1 for line in text.splitlines() if " copy(" in line and "[]" not in line.split("copy(")[0]
    )


def bench(param_dtype: Any, rounds: int) -> dict:
    """All measurements for one parameter dtype."""
    params = make_tree(param_dtype, 0)
    grads = make_tree(param_dtype, 1, 1e-2)
    adam = optax.adam(1e-3)
    ours = optax_accum.conditional_accumulator(adam, num_required=EVERY)
    multi = optax.MultiSteps(adam, every_k_schedule=EVERY).gradient_transformation()

    def fresh(tx, p=params):
        return distinct(p), distinct(tx.init(p))

    # (a) whole cycles of a user's train step.
    train = {
        "optax_accum": Contender(train_step(ours), fresh(ours), (grads,)),
        "multisteps": Contender(train_step(multi), fresh(multi), (grads,)),
    }
    # (b) a held update alone vs the floor; (c) the emit alone vs plain Adam.
    # The held contender's state is reset to "just emitted" before each sample, so the
    # EVERY - 1 calls of a sample are all held; the emit contender is primed with
    # EVERY - 1 held calls before each single timed call.
    held = Contender(update_only(ours), (distinct(ours.init(params)),), (grads,), new_state)
    emit = Contender(update_only(ours), (distinct(ours.init(params)),), (grads,), new_state)
    floor = Contender(
        lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g),
        (distinct(ours.init(params).accumulator),),
        (grads,),
        lambda out: (out,),
    )
    plain = Contender(update_only(adam), (distinct(adam.init(params)),), (grads,), new_state)
    empty = distinct(ours.init(params))

    def reset_held():
        held.carry = (distinct(empty),)

    def prime_emit():
        emit.carry = (distinct(empty),)
        for _ in range(EVERY - 1):
            emit.step()

    medians, samples = interleaved(
        {
            "train_optax_accum": (train["optax_accum"], EVERY, None),
            "train_multisteps": (train["multisteps"], EVERY, None),
            "held_update": (held, EVERY - 1, reset_held),
            "floor": (floor, EVERY - 1, None),
            "emit_update": (emit, 1, prime_emit),
            "adam_update": (plain, 1, None),
        },
        rounds,
    )
    state_ours = ours.init(params)
    state_multi = multi.init(params)
    mem = {k: memory(c) for k, c in train.items()}
    result = {
        "param_dtype": jnp.dtype(param_dtype).name,
        "seconds_per_call": medians,
        "samples": samples,
        "state_bytes": {"optax_accum": tree_bytes(state_ours), "multisteps": tree_bytes(state_multi)},
        "train_step_memory": mem,
        "update_memory": {"held": memory(held), "adam": memory(plain), "floor": memory(floor)},
        "copies": {
            "train_optax_accum": count_copies(train["optax_accum"]),
            "train_multisteps": count_copies(train["multisteps"]),
            "update_optax_accum": count_copies(held),
        },
        "ratios": {
            "train_step_speedup_vs_multisteps": medians["train_multisteps"]
            / medians["train_optax_accum"],
            "held_update_vs_floor": medians["held_update"] / medians["floor"],
            "emit_update_vs_adam": medians["emit_update"] / medians["adam_update"],
            "state_bytes_vs_multisteps": tree_bytes(state_ours) / tree_bytes(state_multi),
            "temp_bytes_vs_multisteps": mem["optax_accum"]["temp_bytes"]
            / max(mem["multisteps"]["temp_bytes"], 1),
        },
    }
    return result


def verdict(name: str, value: float) -> str:
    target, kind = TARGETS[name]
    ok = value >= target if kind == "min" else value <= target
    return f"{'ok' if ok else 'MISSED'} ({'>=' if kind == 'min' else '<='} {target:g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--out", type=Path, default=RESULTS / "dense.json")
    args = parser.parse_args()

    runs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        runs[jnp.dtype(dtype).name] = bench(dtype, args.rounds)

    print(f"{'ratio':36} {'float32':>9} {'bfloat16':>9}  target")
    for name in TARGETS:
        f32, bf16 = (runs[k]["ratios"][name] for k in ("float32", "bfloat16"))
        print(f"{name:36} {f32:9.2f} {bf16:9.2f}  {verdict(name, f32)} / {verdict(name, bf16)}")
    for dtype, run in runs.items():
        ms = {k: round(1e3 * v, 2) for k, v in run["seconds_per_call"].items()}
        print(f"{dtype} ms per call: {ms}")
        print(f"{dtype} full-size copies in the optimized HLO: {run['copies']}")

    report = {
        "script": "benchmarks/dense.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "jax": jax.__version__,
            "optax": optax.__version__,
            "backend": jax.default_backend(),
        },
        "setup": {"leaves": LEAVES, "leaf_shape": LEAF_SHAPE, "every": EVERY, "rounds": args.rounds},
        "targets": TARGETS,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
