"""Whole train steps, forward and backward included, against optax.MultiSteps.

`dense.py` times the optimizer alone (gradients are inputs): there the accumulator's
gain is largest. Here each step computes its gradients from a batch first, at sizes
people train, so the forward and backward passes share the clock:

  mlp        a Flax linen MLP 784 -> 2048 -> 1024 -> 10 (3.7M float32 parameters),
             batch of 64, softmax cross-entropy;
  block      one pre-LayerNorm transformer block in Flax linen (d_model 512, 8
             heads, MLP 2048; 3.2M parameters), batch of 4 sequences of 64 tokens,
             mean squared error against a random target.

Adam inside, 8 gradients per release. Three ways to write the step, each against the
same step with `optax.MultiSteps(adam, 8)`: the canonical optax step (`tx.update`,
then `optax.apply_updates`), `optax_accum.apply_gradients` (for MultiSteps, the
canonical step), and `optax_accum.TrainState` against Flax's own TrainState. Each
step takes `(params, opt_state, batch)` (or `(state, batch)`) and donates all but the
batch. The floor is the same forward and backward pass adding its gradient into a
donated accumulator: what a step that only accumulates cannot beat.

Every figure is a ratio of two timings taken in the same round, the median over
interleaved rounds after a warm-up round, in wall-clock and in process CPU time
(steadier on a shared machine). A sample is a whole cycle of 8 steps (7 held, 1
released).

Run from the repository root: `python -m benchmarks.train_step` (`--rounds N`,
`--model mlp|block`, `--batch N` for another batch size, `--quick` for tiny models).
Prints the device kind and the jax version, a table, and writes every figure to
`benchmarks/results/train_step.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import optax_accum

try:  # part of the package: python -m benchmarks, the tests
    from benchmarks._steps import Contender, accumulating_adam, canonical, fused, paired, rotations
except ModuleNotFoundError:  # run as a file: python benchmarks/X.py (see _steps)
    from _steps import Contender, accumulating_adam, canonical, fused, paired, rotations

EVERY = 8  # gradients per release; a sample times one cycle
PATTERNS = ("canonical", "apply_gradients", "TrainState")
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- the models


class MLP(nn.Module):
    """Dense layers of `widths`, ReLU between them."""

    widths: tuple[int, ...]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.widths[-1])(x)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(self.hidden)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


def _classify(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _regress(out: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((out - target) ** 2)


def model(name: str, quick: bool, batch: int | None = None) -> tuple[nn.Module, tuple, Callable]:
    """`(module, batch, loss)`: the module, a batch `(x, y)` (of `batch` examples, or the
    model's default) and `loss(out, y)`."""
    kx, ky = jax.random.split(jax.random.key(1))
    if name == "mlp":
        widths, size, features = ((32, 16, 10), 4, 16) if quick else ((2048, 1024, 10), 64, 784)
        x = jax.random.normal(kx, (batch or size, features))
        return MLP(widths), (x, jax.random.randint(ky, x.shape[:1], 0, widths[-1])), _classify
    d, heads, hidden, size, length = (16, 2, 32, 2, 8) if quick else (512, 8, 2048, 4, 64)
    x = jax.random.normal(kx, (batch or size, length, d))
    return Block(heads, hidden), (x, jax.random.normal(ky, x.shape)), _regress


# --------------------------------------------------------------------------- timing


def contender(pattern: str, ours: bool, module: nn.Module, params: Any, batch: tuple, loss):
    """The train step of `pattern`, with optax_accum (`ours`) or with optax.MultiSteps."""
    tx = accumulating_adam(ours, EVERY)
    params = jax.tree.map(jnp.copy, params)

    def grads_of(params: Any, batch: tuple) -> Any:
        x, y = batch
        return jax.grad(lambda p: loss(module.apply({"params": p}, x), y))(params)

    if pattern == "TrainState":
        cls = optax_accum.TrainState if ours else train_state.TrainState
        state = cls.create(apply_fn=module.apply, params=params, tx=tx)
        return Contender(
            lambda s, b: s.apply_gradients(grads=grads_of(s.params, b)), (state,), batch, EVERY
        )
    apply = fused if pattern == "apply_gradients" and ours else canonical

    def step(params: Any, opt_state: Any, batch: tuple) -> tuple:
        return apply(tx, params, opt_state, grads_of(params, batch))

    return Contender(step, (params, tx.init(params)), batch, EVERY)


def floor(module: nn.Module, params: Any, batch: tuple, loss) -> Contender:
    """The forward and backward pass adding its gradient into a donated accumulator."""

    def step(params: Any, acc: Any, batch: tuple) -> tuple:
        x, y = batch
        grads = jax.grad(lambda p: loss(module.apply({"params": p}, x), y))(params)
        return params, jax.tree.map(jnp.add, acc, grads)

    params = jax.tree.map(jnp.copy, params)
    return Contender(step, (params, jax.tree.map(jnp.zeros_like, params)), batch, EVERY)


def bench_model(
    name: str, rounds: int, quick: bool = False, progress=None, batch: int | None = None
) -> dict[str, Any]:
    """Every pattern on model `name` (`quick`: tiny, and `apply_gradients` only), ours
    against MultiSteps, and the floor, interleaved."""
    module, batch, loss = model(name, quick, batch)
    # `quick`: one compiled init (the same params) instead of an eager op per layer.
    init = jax.jit(module.init) if quick else module.init
    params = init(jax.random.key(0), batch[0])["params"]
    contenders = {"floor": floor(module, params, batch, loss)}
    patterns = ("apply_gradients",) if quick else PATTERNS
    for pattern in patterns:
        for ours in (True, False):
            key = f"{'ours' if ours else 'base'} {pattern}"
            contenders[key] = contender(pattern, ours, module, params, batch, loss)
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    order = list(rotations(list(contenders), rounds))
    for r, k in progress(order, desc=name) if progress else order:
        t, c = contenders[k].sample()
        if r:
            wall[k].append(t)
            cpu[k].append(c)
    out: dict[str, Any] = {
        "params": sum(p.size for p in jax.tree.leaves(params)),
        "batch": batch[0].shape[:-1],
        "floor_ms": 1e3 * statistics.median(wall["floor"]),
        "patterns": {},
    }
    for pattern in patterns:
        ours, base = f"ours {pattern}", f"base {pattern}"
        out["patterns"][pattern] = {
            "cycle_speedup": paired(wall, base, ours),
            "cycle_speedup_cpu": paired(cpu, base, ours),
            "ours_ms": 1e3 * statistics.median(wall[ours]),
            "base_ms": 1e3 * statistics.median(wall[base]),
            "ours_vs_floor": paired(wall, ours, "floor"),
            "base_vs_floor": paired(wall, base, "floor"),
        }
    return out


# --------------------------------------------------------------------------- report


def report(name: str, r: dict[str, Any]) -> None:
    batch = " x ".join(map(str, r["batch"]))
    print(f"\n{name}: {r['params']:,} float32 parameters, batch {batch}, Adam, {EVERY} per release")
    header = (
        f"{'pattern':16} {'cycle x':>8} {'cpu x':>6} {'ours ms':>8} {'theirs ms':>9} "
        f"{'ours/floor':>10} {'theirs/floor':>12}"
    )
    print(header)
    print("-" * len(header))
    for pattern, p in r["patterns"].items():
        print(
            f"{pattern:16} {p['cycle_speedup']:8.2f} {p['cycle_speedup_cpu']:6.2f} "
            f"{p['ours_ms']:8.2f} {p['base_ms']:9.2f} {p['ours_vs_floor']:10.2f} "
            f"{p['base_vs_floor']:12.2f}"
        )
    print(
        f"floor (forward + backward + `acc + g`): {r['floor_ms']:.2f} ms per step. cycle x: "
        "MultiSteps' time for a cycle of 8 steps over ours (cpu x: in process CPU time)"
    )


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: both models (`scale.quick`: a tiny
    transformer block alone, each compile costing the suite seconds)."""
    from benchmarks._report import Row

    rounds = 1 if scale.quick else 5
    results, rows = {}, []
    for name in ("block",) if scale.quick else ("mlp", "block"):
        r = results[name] = bench_model(name, rounds, scale.quick, scale.progress)
        case = f"{name} {r['params'] / 1e6:.2g}M" if r["params"] >= 1e5 else f"{name} tiny"
        rows.append(Row("train_step", case, "forward + backward + `acc + g`", r["floor_ms"], "ms"))
        for pattern, p in r["patterns"].items():
            rows += [
                Row("train_step", f"{case} {pattern}", "cycle of 8, MultiSteps / ours",
                    p["cycle_speedup"]),
                Row("train_step", f"{case} {pattern}", "the same in CPU time",
                    p["cycle_speedup_cpu"]),
                Row("train_step", f"{case} {pattern}", "ours, per step in a cycle", p["ours_ms"],
                    "ms"),
            ]  # fmt: skip
    return rows, {"rounds": rounds, "every": EVERY, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--model", choices=("mlp", "block"), action="append", help="default: both")
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    parser.add_argument(
        "--batch", type=int, help="examples (MLP) or sequences (block) per step; default 64, 4"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "train_step.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, ", end="")
    print(f"optax {optax.__version__}, {args.rounds} rounds")
    out: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "rounds": args.rounds,
        "quick": args.quick,
        "batch": args.batch,
        "results": {},
    }
    for name in args.model or ("mlp", "block"):
        start = time.perf_counter()
        out["results"][name] = r = bench_model(name, args.rounds, args.quick, batch=args.batch)
        report(name, r)
        print(f"({time.perf_counter() - start:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
