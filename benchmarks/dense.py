"""Is `conditional_accumulator` the fast way to accumulate dense gradients?

Setup: 8M parameters in 8 leaves of 1024 x 1024, `optax.adam` inside, 8 gradients per
emission. Every function is jitted with the buffers its caller no longer needs donated,
as a real train step has them. Measured side by side in one run, as medians over
interleaved rounds (after a warm-up round) of per-round ratios:

  (a) a user's train step, `jit(update + optax.apply_updates)` with params and state
      donated, timed over whole 8-step cycles: `optax.MultiSteps` time / ours;
  (b) a held update alone, `jit(tx.update)` with the state donated, against the
      floor, `jit(acc + g)` with the accumulator donated;
  (c) the emitting update alone against plain `jit(adam.update)`, state donated;
  (d) bytes of state, and the compiled train step's temporaries
      (`memory_analysis().temp_size_in_bytes`), against MultiSteps;
  (e) all of the above with bfloat16 params (float32 accumulator, bfloat16 Adam
      moments).

(b) and (c) are also set against hand-fused jits that do only the work any
implementation must do, to tell our overhead from the cost of the task itself.

Run from the repository root: `python benchmarks/dense.py` (`--rounds 5` for a quick
look). Prints a table of ratios with the targets and writes every figure to
`benchmarks/results/dense.json`. The machine may be shared: check `uptime`, and re-run
when the load is low; interleaving and per-round ratios keep the ratios honest under
load, but not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
LEAF_SHAPE = (1024, 1024)  # 8 leaves x 1M = 8M parameters
EVERY = 8  # gradients per emission
RESULTS = Path(__file__).resolve().parent / "results"

# ratio -> (target, "min": must reach at least the target, "max": must stay at most it)
TARGETS = {
    "a_train_step_speedup_vs_multisteps": (2.0, "min"),
    "b_held_update_vs_floor": (1.5, "max"),
    "c_emit_update_vs_adam": (1.2, "max"),
    "d_state_array_bytes_vs_multisteps": (1.0, "max"),
    "d_temp_bytes_vs_multisteps": (1.0, "max"),
}
# No target: how far (b) and (c) are from hand-fused jits that do only the work any
# implementation must do (a held step: add g in place and return zeros; an emit: Adam
# on (acc + g) / n and zero the accumulator), with the same donation.
REFERENCES = {
    "b_held_update_vs_fused_reference": "held update / jit(acc + g, zeros)",
    "c_emit_update_vs_fused_reference": "emit update / jit(adam((acc + g) / n), zeros)",
}


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def fresh(tree: Any) -> Any:
    """A copy of `tree` in new buffers, resident before any timing starts."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def random_tree(dtype: Any, seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layer{i}": jnp.asarray(scale * rng.standard_normal(LEAF_SHAPE, np.float32), dtype)
        for i in range(LEAVES)
    }


class Contender:
    """A compiled function, the buffers it carries from call to call, and its timing.

    `fn(*carry, *feed)` returns outputs from which `next_carry` picks the next carry;
    the carry is donated, the feed is not. `setup()` runs untimed before each sample
    and returns the feeds, one per call; it may also reset `self.carry`. (Donating the
    gradient too would not help: the updates would have to be written into its
    buffers while it is still being read, and XLA copies it first.)
    """

    def __init__(
        self,
        fn: Callable,
        carry: tuple,
        setup: Callable[[Contender], list[tuple]],
        *,
        next_carry: Callable[[Any], tuple] = lambda out: out,
    ):
        self.carry = carry
        self.setup = setup
        self.next_carry = next_carry
        example = setup(self)[0]
        donate = tuple(range(len(self.carry)))
        lowered = jax.jit(fn, donate_argnums=donate).lower(*self.carry, *example)
        self.compiled = lowered.compile()

    def call(self, *feed: Any) -> Any:
        out = self.compiled(*self.carry, *feed)
        self.carry = self.next_carry(out)
        return out

    def sample(self) -> float:
        """Seconds per call over one sample."""
        feeds = self.setup(self)
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        for feed in feeds:
            out = self.call(*feed)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / len(feeds)


def interleaved(contenders: dict[str, Contender], rounds: int) -> dict[str, list[float]]:
    """`rounds` samples of each contender, after one warm-up round.

    Each round times every contender once, in an order that rotates from round to
    round, so a change of load on the machine hits all of them alike.
    """
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds + 1):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t = contenders[k].sample()
            if r:
                samples[k].append(t)
    return samples


def paired(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of `num / den`, both timed in the same round."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den], strict=True))


def train_step(tx: optax.GradientTransformation) -> Callable:
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def update_alone(tx: optax.GradientTransformation) -> Callable:
    """`tx.update` alone, returning `(state, updates)`.

    State first: `jax.jit` pairs donated input buffers with outputs of the same shape
    in order. With `(updates, state)` the first updates leaf would take over the first
    state leaf's buffer, each state leaf would land on its neighbour's, and every call
    would copy the whole state (NOTES.md).
    """

    def step(state, grads):
        updates, state = tx.update(grads, state)
        return state, updates

    return step


def memory(contender: Contender) -> dict:
    stats = contender.compiled.memory_analysis()
    return {
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
    }


def full_size_copies(contender: Contender) -> int:
    """`copy` instructions on arrays in the optimized HLO (what copy insertion added)."""
    lines = contender.compiled.as_text().splitlines()
    return sum(1 for ln in lines if " copy(" in ln and "[]" not in ln.split(" copy(")[0])


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w-]+)\((.*)")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.-]+)\s.*\{\s*$")
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while"}
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def hlo_traffic(contender: Contender) -> dict[str, Any]:
    """Bytes read and written per call by the optimized HLO, counted without a clock.

    Every array-valued instruction counts its result and its array operands once (an
    operand that a fusion only slices counts at the slice's size). Work outside loops
    runs on every call; each 0-or-1-trip loop's body is listed apart, since which of
    them run depends on the step (held or emitting).
    """
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in contender.compiled.as_text().splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)

    def sliced_params(name: str) -> dict[int, int]:
        """Parameter number -> bytes read, for parameters a fusion only slices."""
        params, users, sizes = {}, {}, {}
        for line in comps.get(name, []):
            d = _DEFINITION.match(line)
            if d is None:
                continue
            dims = [int(x) for x in d.group(3).split(",") if x]
            sizes[d.group(1)] = int(np.prod(dims)) * _ITEMSIZE[d.group(2)]
            if d.group(4) == "parameter":
                params[d.group(1)] = int(d.group(5).split(")")[0])
            for operand in re.findall(r"%([\w.-]+)", d.group(5).split("),")[0]):
                users.setdefault(operand, []).append((d.group(4), sizes[d.group(1)]))
        return {
            number: sum(size for _, size in users[p])
            for p, number in params.items()
            if users.get(p) and all(op == "slice" for op, _ in users[p])
        }

    def traffic(name: str) -> tuple[int, list[str]]:
        sizes: dict[str, int] = {}
        total, loops = 0, []
        for line in comps[name]:
            if " while(" in line:
                loops.append(re.search(r"body=%([\w.-]+)", line).group(1))
            d = _DEFINITION.match(line)
            if d is None:
                continue
            dims = [int(x) for x in d.group(3).split(",") if x]
            sizes[d.group(1)] = int(np.prod(dims)) * _ITEMSIZE[d.group(2)]
            if dims and d.group(4) not in _NO_TRAFFIC:
                operands = re.findall(r"%([\w.-]+)", d.group(5).split("),")[0])
                called = re.search(r"calls=%([\w.-]+)", line)
                sliced = sliced_params(called.group(1)) if called else {}
                total += sizes[d.group(1)] + sum(
                    sliced.get(i, sizes.get(o, 0)) for i, o in enumerate(operands)
                )
        return total, loops

    outside, loops = traffic(entry)
    return {"outside_loops": outside, "loop_bodies": [traffic(body)[0] for body in loops]}


def bench(param_dtype: Any, rounds: int) -> dict:
    """Every measurement for one parameter dtype."""
    params = random_tree(param_dtype, 0)
    grads = random_tree(param_dtype, 1, 1e-2)
    adam = optax.adam(1e-3)
    ours = optax_accum.conditional_accumulator(adam, num_required=EVERY)
    multi = optax.MultiSteps(adam, every_k_schedule=EVERY).gradient_transformation()

    def add(acc: Any, g: Any) -> Any:
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)

    def fused_emit(adam_state: Any, acc: Any, g: Any) -> tuple:
        total = jax.tree.map(lambda t, b: (t / EVERY).astype(b.dtype), add(acc, g), g)
        updates, adam_state = adam.update(total, adam_state)
        return adam_state, jax.tree.map(jnp.zeros_like, acc), updates

    def cycle(_: Contender) -> list[tuple]:
        return [(grads,)] * EVERY

    def fresh_grads(n: int) -> Callable:
        return lambda _: [(fresh(grads),) for _ in range(n)]

    def held_from_start(c: Contender) -> list[tuple]:
        c.carry = (fresh(ours.init(params)),)
        return [(fresh(grads),) for _ in range(EVERY - 1)]

    def primed_to_emit(c: Contender) -> list[tuple]:
        c.carry = (fresh(ours.init(params)),)
        if hasattr(c, "compiled"):  # after construction: run the held steps untimed
            for _ in range(EVERY - 1):
                c.call(fresh(grads))
        return [(fresh(grads),)]

    def new_state(out: tuple) -> tuple:
        return (out[0],)

    contenders = {
        # (a) whole cycles; the state runs on from sample to sample.
        "train_ours": Contender(train_step(ours), (fresh(params), fresh(ours.init(params))), cycle),
        "train_multisteps": Contender(
            train_step(multi), (fresh(params), fresh(multi.init(params))), cycle
        ),
        # (b) EVERY - 1 held updates from a fresh state, against as many floor passes.
        "held_update": Contender(update_alone(ours), (), held_from_start, next_carry=new_state),
        "floor": Contender(
            add,
            (fresh(ours.init(params).accumulator),),
            fresh_grads(EVERY - 1),
            next_carry=lambda out: (out,),
        ),
        # (c) the emitting update (primed with EVERY - 1 untimed held ones) vs Adam.
        "emit_update": Contender(update_alone(ours), (), primed_to_emit, next_carry=new_state),
        "adam_update": Contender(
            update_alone(adam),
            (fresh(adam.init(params)),),
            fresh_grads(1),
            next_carry=new_state,
        ),
        "held_reference": Contender(
            lambda acc, g: (add(acc, g), jax.tree.map(jnp.zeros_like, g)),
            (fresh(ours.init(params).accumulator),),
            fresh_grads(EVERY - 1),
            next_carry=lambda out: (out[0],),
        ),
        "emit_reference": Contender(
            fused_emit,
            (fresh(adam.init(params)), fresh(ours.init(params).accumulator)),
            fresh_grads(1),
            next_carry=lambda out: out[:2],
        ),
    }
    samples = interleaved(contenders, rounds)
    medians = {k: statistics.median(v) for k, v in samples.items()}

    state_ours, state_multi = ours.init(params), multi.init(params)

    def array_bytes(state: Any) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim)

    mem = {k: memory(contenders[k]) for k in ("train_ours", "train_multisteps")}
    ratios = {
        "a_train_step_speedup_vs_multisteps": paired(samples, "train_multisteps", "train_ours"),
        "b_held_update_vs_floor": paired(samples, "held_update", "floor"),
        "c_emit_update_vs_adam": paired(samples, "emit_update", "adam_update"),
        "d_state_array_bytes_vs_multisteps": array_bytes(state_ours) / array_bytes(state_multi),
        "d_temp_bytes_vs_multisteps": mem["train_ours"]["temp_bytes"]
        / max(mem["train_multisteps"]["temp_bytes"], 1),
        "b_held_update_vs_fused_reference": paired(samples, "held_update", "held_reference"),
        "c_emit_update_vs_fused_reference": paired(samples, "emit_update", "emit_reference"),
    }
    traffic = {k: hlo_traffic(c) for k, c in contenders.items()}
    return {
        "param_dtype": jnp.dtype(param_dtype).name,
        "ratios": ratios,
        "hlo_traffic_bytes": traffic,
        "ratios_of_fastest": {
            "a_train_step_speedup_vs_multisteps": min(samples["train_multisteps"])
            / min(samples["train_ours"]),
            "b_held_update_vs_floor": min(samples["held_update"]) / min(samples["floor"]),
            "c_emit_update_vs_adam": min(samples["emit_update"]) / min(samples["adam_update"]),
        },
        "median_seconds_per_call": medians,
        "samples": samples,
        "state_bytes": {
            "optax_accum": {"arrays": array_bytes(state_ours), "all": tree_bytes(state_ours)},
            "multisteps": {"arrays": array_bytes(state_multi), "all": tree_bytes(state_multi)},
        },
        "memory": {k: memory(c) for k, c in contenders.items()},
        "full_size_copies_in_hlo": {k: full_size_copies(c) for k, c in contenders.items()},
    }


def verdict(name: str, value: float) -> str:
    target, kind = TARGETS[name]
    met = value >= target if kind == "min" else value <= target
    return f"{'>=' if kind == 'min' else '<='} {target:<4g} {'met' if met else 'MISSED'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--out", type=Path, default=RESULTS / "dense.json")
    args = parser.parse_args()

    load_before = os.getloadavg()
    runs = {jnp.dtype(d).name: bench(d, args.rounds) for d in (jnp.float32, jnp.bfloat16)}

    print(f"{'ratio (median of per-round ratios)':42} {'float32':>8} {'bfloat16':>8}  target")
    for name in TARGETS:
        f32, bf16 = (runs[k]["ratios"][name] for k in ("float32", "bfloat16"))
        verdicts = f"{verdict(name, f32)} / {verdict(name, bf16).split()[-1]}"
        print(f"{name:42} {f32:8.2f} {bf16:8.2f}  {verdicts}")
    for name, what in REFERENCES.items():
        f32, bf16 = (runs[k]["ratios"][name] for k in ("float32", "bfloat16"))
        print(f"{name:42} {f32:8.2f} {bf16:8.2f}  ({what})")
    for dtype, run in runs.items():
        ms = {k: round(1e3 * v, 2) for k, v in run["median_seconds_per_call"].items()}
        print(f"{dtype} median ms per call: {ms}")
    print(f"load average before/after: {load_before} / {os.getloadavg()}")

    report = {
        "script": "benchmarks/dense.py",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "jax": jax.__version__,
            "optax": optax.__version__,
            "backend": jax.default_backend(),
        },
        "setup": {
            "leaves": LEAVES,
            "leaf_shape": LEAF_SHAPE,
            "every": EVERY,
            "rounds": args.rounds,
        },
        "targets": TARGETS,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
