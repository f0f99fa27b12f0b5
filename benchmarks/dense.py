"""Dense gradient accumulation in the train steps users write, against optax.MultiSteps.

Setup: Adam inside, 8 gradients per release, float32 parameters in 8 leaves: 8M
parameters everywhere, and 268M on an accelerator. Four ways to write the step, each
against the same step with `optax.MultiSteps(adam, 8)`:

  canonical        `u, s = tx.update(g, s, p); p = optax.apply_updates(p, u)`,
                   returning `(params, opt_state)`, both donated;
  apply_gradients  `optax_accum.apply_gradients(tx, g, s, p)`, same donation and
                   order (for MultiSteps it is the canonical step);
  TrainState       `state.apply_gradients(grads=g)`, the state donated:
                   `optax_accum.TrainState` against Flax's own TrainState;
  NNX              `optimizer.update(model, grads)` on `nnx.merge`d state, the
                   split state donated: `optax_accum.NNXOptimizer` against
                   `nnx.Optimizer`.

For each: a held step (a transform that never releases: `num_required` and
`every_k_schedule` of 2**30) against the floor `acc + g` (a jit adding the gradient
into a donated accumulator), and a whole cycle of 8 steps (7 held, 1 released).
Every figure is a ratio of two timings taken in the same round, median over
interleaved rounds after a warm-up round, so the load of a shared machine hits both
sides alike.

Run from the repository root: `python benchmarks/dense.py` (`--rounds 3` for a quick
look, `--size 268M` to force the big size, `--dtype bfloat16` for bfloat16 params and
gradients, whose sum, here and in the floor, is float32). Prints the device kind and the jax
version, a table with the targets, and writes every figure to
`benchmarks/results/dense.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
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
from flax import nnx
from flax.training import train_state

import optax_accum

try:  # part of the package: python -m benchmarks, the tests
    from benchmarks._steps import accumulating_adam, canonical, fused, paired, rotations
except ModuleNotFoundError:  # run as a file: python benchmarks/X.py (see _steps)
    from _steps import accumulating_adam, canonical, fused, paired, rotations

LEAVES = 8
SIZES = {"8M": (1024, 1024), "268M": (4096, 8192), "64K": (128, 64)}  # a leaf; 8 leaves
EVERY = 8  # gradients per release
NEVER = 2**30  # a count that is never reached: every step holds
RESULTS = Path(__file__).resolve().parent / "results"
PATTERNS = ("canonical", "apply_gradients", "TrainState", "NNX")

# (backend, size, pattern, figure) -> (target, "max" or "min"); from issue 13.
TARGETS: dict[tuple, tuple[float, str]] = {}
for _p, (_held, _cycle) in {
    "canonical": (4.0, 1.2),
    "apply_gradients": (1.5, 2.5),
    "TrainState": (1.5, 2.5),
}.items():
    TARGETS["cpu", "8M", _p, "held_vs_floor"] = (_held, "max")
    TARGETS["cpu", "8M", _p, "cycle_speedup"] = (_cycle, "min")
for _p in PATTERNS:
    TARGETS["gpu", "8M", _p, "held_vs_floor"] = (1.3, "max")
    TARGETS["gpu", "8M", _p, "cycle_speedup"] = (1.0, "min")
for _p in ("apply_gradients", "TrainState"):
    TARGETS["gpu", "268M", _p, "cycle_speedup"] = (2.0, "min")
# Issue 37: XLA:GPU gave the canonical step a params-sized temporary at 268M (1.07 GB).
TARGETS["gpu", "268M", "canonical", "temp_vs_params"] = (0.01, "max")


def random_tree(shape: tuple[int, int], seed: int, scale: float = 1.0, dtype: Any = None) -> dict:
    key = jax.random.key(seed)
    keys = jax.random.split(key, LEAVES)
    return {
        f"layer{i}": (scale * jax.random.normal(keys[i], shape)).astype(dtype or jnp.float32)
        for i in range(LEAVES)
    }


class Contender:
    """A compiled step, the buffers it carries from call to call, and its timing.

    `fn(*carry, grads)` returns what `next_carry` turns into the next carry; the carry
    is donated, the gradient is not. A sample times `EVERY` calls.
    """

    def __init__(self, fn: Callable, carry: tuple, grads: Any, next_carry: Callable):
        self.carry, self.grads, self.next_carry = carry, grads, next_carry
        donate = tuple(range(len(carry)))
        self.compiled = jax.jit(fn, donate_argnums=donate).lower(*carry, grads).compile()

    def sample(self) -> float:
        """Seconds per step over `EVERY` steps."""
        jax.block_until_ready(self.carry)
        start = time.perf_counter()
        for _ in range(EVERY):
            self.carry = self.next_carry(self.compiled(*self.carry, self.grads))
        jax.block_until_ready(self.carry)
        return (time.perf_counter() - start) / EVERY

    def temp_bytes(self) -> int:
        return int(self.compiled.memory_analysis().temp_size_in_bytes)


# --------------------------------------------------------------------------- the steps


class Leaves(nnx.Module):
    """An NNX model whose parameters are the given leaves."""

    def __init__(self, params: dict) -> None:
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))


def contender(pattern: str, ours: bool, every: int, params: dict, grads: dict) -> Contender:
    """The step of `pattern`, with optax_accum (`ours`) or with optax.MultiSteps."""
    tx = accumulating_adam(ours, every)
    params = jax.tree.map(jnp.copy, params)
    if pattern in ("canonical", "apply_gradients"):
        step = fused if pattern == "apply_gradients" and ours else canonical
        return Contender(functools.partial(step, tx), (params, tx.init(params)), grads, tuple)
    if pattern == "TrainState":
        cls = optax_accum.TrainState if ours else train_state.TrainState
        state = cls.create(apply_fn=None, params=params, tx=tx)
        return Contender(lambda s, g: s.apply_gradients(grads=g), (state,), grads, lambda s: (s,))
    model = Leaves(params)
    cls = optax_accum.NNXOptimizer if ours else nnx.Optimizer
    graphdef, state = nnx.split((model, cls(model, tx, wrt=nnx.Param)))

    def nnx_step(state: Any, grads: Any) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    nnx_grads = nnx.state(Leaves(grads), nnx.Param)
    return Contender(nnx_step, (state,), nnx_grads, lambda s: (s,))


def floor(params: dict, grads: dict) -> Contender:
    # The sum is float32 for low-precision params, as optax_accum keeps it.
    acc = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params
    )
    return Contender(
        lambda a, g: jax.tree.map(lambda a, g: a + g.astype(a.dtype), a, g),
        (acc,),
        grads,
        lambda a: (a,),
    )


# --------------------------------------------------------------------------- timing


def interleaved(contenders: dict[str, Contender], rounds: int) -> dict[str, list[float]]:
    """`rounds` samples of each contender after a warm-up round, in an order that
    rotates from round to round."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r, k in rotations(names, rounds):
        t = contenders[k].sample()
        if r:
            samples[k].append(t)
    return samples


def bench_pattern(pattern: str, shape: tuple[int, int], rounds: int, dtype: Any = None) -> dict:
    params, grads = random_tree(shape, 0, dtype=dtype), random_tree(shape, 1, 1e-3, dtype)
    contenders = {
        "ours_held": contender(pattern, True, NEVER, params, grads),
        "base_held": contender(pattern, False, NEVER, params, grads),
        "ours_cycle": contender(pattern, True, EVERY, params, grads),
        "base_cycle": contender(pattern, False, EVERY, params, grads),
        "floor": floor(params, grads),
    }
    samples = interleaved(contenders, rounds)
    return {
        "held_vs_floor": paired(samples, "ours_held", "floor"),
        "base_held_vs_floor": paired(samples, "base_held", "floor"),
        "cycle_speedup": paired(samples, "base_cycle", "ours_cycle"),
        "ours_cycle_ms": 1e3 * statistics.median(samples["ours_cycle"]),
        "base_cycle_ms": 1e3 * statistics.median(samples["base_cycle"]),
        "floor_ms": 1e3 * statistics.median(samples["floor"]),
        "ours_temp_bytes": contenders["ours_cycle"].temp_bytes(),
        "base_temp_bytes": contenders["base_cycle"].temp_bytes(),
    }


# --------------------------------------------------------------------------- report


def backend() -> str:
    platform_name = jax.devices()[0].platform
    return "gpu" if platform_name in ("gpu", "cuda", "rocm") else platform_name


def verdict(key: tuple, value: float) -> str:
    if key not in TARGETS:
        return ""
    target, kind = TARGETS[key]
    ok = value <= target if kind == "max" else value >= target
    return f"{'<=' if kind == 'max' else '>='} {target:g} {'ok' if ok else 'MISSED'}"


def report(size: str, results: dict[str, dict], dtype: str = "float32") -> None:
    print(f"\n{size} {dtype} parameters ({LEAVES} leaves), Adam, {EVERY} gradients per release")
    header = (
        f"{'pattern':16} {'held/floor':>10} {'target':>14} {'MultiSteps':>10} "
        f"{'cycle x':>8} {'target':>14} {'ours ms':>8} {'theirs ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for pattern, r in results.items():
        where = (backend() if dtype == "float32" else "", size, pattern)  # float32 targets
        held = verdict((*where, "held_vs_floor"), r["held_vs_floor"])
        cycle = verdict((*where, "cycle_speedup"), r["cycle_speedup"])
        print(
            f"{pattern:16} {r['held_vs_floor']:10.2f} {held:>14} {r['base_held_vs_floor']:10.2f} "
            f"{r['cycle_speedup']:8.2f} {cycle:>14} {r['ours_cycle_ms']:8.3f} "
            f"{r['base_cycle_ms']:9.3f}"
        )
    print(
        "held/floor: a held step over `acc + g` (MultiSteps: its held step over the same "
        "floor); cycle x: MultiSteps' cycle of 8 steps over ours; ms: per step in a cycle"
    )


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: float32, every pattern, 8M (and 268M on
    an accelerator; 64K with `scale.quick`)."""
    from benchmarks._report import Row

    sizes = ["64K"] if scale.quick else (["8M", "268M"] if scale.accelerator else ["8M"])
    rounds = 1 if scale.quick else 5
    where = backend()
    cases = [(size, pattern) for size in sizes for pattern in PATTERNS]
    results: dict[str, dict] = {size: {} for size in sizes}
    rows = []
    for size, pattern in scale.progress(cases, desc="dense"):
        r = results[size][pattern] = bench_pattern(pattern, SIZES[size], rounds)
        case = f"{size} {pattern}"
        rows += [
            Row.checked(
                "dense",
                case,
                "held step / `acc + g`",
                r["held_vs_floor"],
                TARGETS.get((where, size, pattern, "held_vs_floor")),
            ),
            Row("dense", case, "MultiSteps' held step / `acc + g`", r["base_held_vs_floor"]),
            Row.checked(
                "dense",
                case,
                "cycle of 8, MultiSteps / ours",
                r["cycle_speedup"],
                TARGETS.get((where, size, pattern, "cycle_speedup")),
            ),
            Row("dense", case, "ours, per step in a cycle", r["ours_cycle_ms"], unit="ms"),
            Row("dense", case, "temporaries, ours / MultiSteps", _ratio(r)),
            Row.checked(
                "dense",
                case,
                "temporaries, ours / params",
                r["ours_temp_bytes"] / (LEAVES * SIZES[size][0] * SIZES[size][1] * 4),
                TARGETS.get((where, size, pattern, "temp_vs_params")),
            ),
        ]
    details = {"rounds": rounds, "leaves": LEAVES, "every": EVERY, "results": results}
    return rows, details


def _ratio(r: dict) -> float:
    return r["ours_temp_bytes"] / max(r["base_temp_bytes"], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument(
        "--size", choices=sorted(SIZES), action="append", help="default: 8M, and 268M off the CPU"
    )
    parser.add_argument("--pattern", choices=PATTERNS, action="append", help="default: all")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="params and gradients (default float32; the targets are for float32)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "dense.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    sizes = args.size or (["8M"] if backend() == "cpu" else ["8M", "268M"])

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({backend()}), jax {jax.__version__}, ", end="")
    print(f"optax {optax.__version__}, {args.rounds} rounds")
    out: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_kind": device.device_kind,
        "backend": backend(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "rounds": args.rounds,
        "dtype": args.dtype,
        "results": {},
    }
    for size in sizes:
        results = {}
        for pattern in args.pattern or PATTERNS:
            results[pattern] = bench_pattern(pattern, SIZES[size], args.rounds, args.dtype)
        out["results"][size] = results
        report(size, results, args.dtype)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
