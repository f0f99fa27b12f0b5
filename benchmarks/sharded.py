"""The sharded train step (FSDP) on 8 devices, against optax.MultiSteps.

Setup: a (data=2, fsdp=4) mesh on 8 CPU devices, float32 parameters in 8 leaves of
1024 x 1024 (8M parameters), each split over `fsdp` by its rows (`P("fsdp", None)`) and
replicated over `data`, so a device holds a quarter of each; the gradients are inputs
sharded like the params (the optimizer step is measured, not a model). Adam inside,
8 gradients per release. Two ways to write the step, each against the same step with
`optax.MultiSteps(adam, 8)`:

  canonical        `u, s = tx.update(g, s, p); p = optax.apply_updates(p, u)`,
                   returning `(params, opt_state)`, both donated;
  apply_gradients  `optax_accum.apply_gradients(tx, g, s, p)`, same donation and
                   order (for MultiSteps it is the canonical step).

Both sharding modes: `explicit` axis types (`jax.make_mesh`'s default from jax 0.10,
the state straight from `jax.jit(tx.init)`) and `auto` (classic GSPMD, the state from
`jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))`), each under
`jax.set_mesh`. For each: a held step (a transform that never releases) against the
floor `acc + g` (a jit adding the gradient into a donated accumulator sharded like the
params), a whole cycle of 8 steps (7 held, 1 released) against MultiSteps' cycle, and
the per-device bytes `compiled.memory_analysis()` gives (arguments, outputs,
temporaries) against MultiSteps'. The JSON also holds, from the compiled HLO, the
collectives of each step and its copies of a whole parameter shard. Timings are
medians of per-round ratios over interleaved rounds after a warm-up round, in wall-clock
time and in this process's CPU time (the work of all 8 device threads, which other load
on a shared machine disturbs less).

Run from the repository root: `python benchmarks/sharded.py` (`--rounds 3` for a quick
look, `--mode explicit` for one mode, `--quick` for tiny leaves: a smoke test whose
timings mean nothing). Prints the devices and the jax version, a table with the
targets, and writes every figure to `benchmarks/results/sharded.json`. On a GPU or TPU
host it still runs on 8 simulated CPU devices.
"""

from __future__ import annotations

import os

# Before JAX starts: 8 host devices for the mesh.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import functools
import json
import platform
import re
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo.hlo import count_collectives

try:  # part of the package: python -m benchmarks, the tests
    from benchmarks._steps import Contender as TimedStep
    from benchmarks._steps import accumulating_adam, canonical, fused, paired, rotations
except ModuleNotFoundError:  # run as a file: python benchmarks/X.py (see _steps)
    from _steps import Contender as TimedStep
    from _steps import accumulating_adam, canonical, fused, paired, rotations

LEAVES = 8
SIZES = {"8M": (1024, 1024), "64K": (128, 64)}  # a leaf; 8 leaves
EVERY = 8  # gradients per release
NEVER = 2**30  # a count that is never reached: every step holds
MESH = {"data": 2, "fsdp": 4}
SPEC = P("fsdp", None)
MODES = ("explicit", "auto")
PATTERNS = ("canonical", "apply_gradients")
RESULTS = Path(__file__).resolve().parent / "results"
MEMORY = ("argument", "output", "temp")

# (size, pattern, figure) -> (target, "max" or "min"), on the CPU; from issue 21.
TARGETS: dict[tuple[str, str, str], tuple[float, str]] = {
    ("8M", "apply_gradients", "held_vs_floor"): (1.5, "max"),
    ("8M", "apply_gradients", "cycle_speedup"): (2.5, "min"),
}
for _p in PATTERNS:
    TARGETS["8M", _p, "temp_vs_base"] = (1.0, "max")


def mesh(mode: str) -> jax.sharding.Mesh:
    kind = jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
    return jax.make_mesh(
        tuple(MESH.values()),
        tuple(MESH),
        axis_types=(kind,) * len(MESH),
        devices=jax.devices("cpu")[: int(np.prod(list(MESH.values())))],
    )


def default_mode() -> str:
    """The axis type `jax.make_mesh` gives when none is asked for, on this jax."""
    m = jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])
    types = getattr(m, "axis_types", None) or ("auto",)
    return "explicit" if "explicit" in str(types[0]).lower() else "auto"


def random_tree(shape: tuple[int, int], seed: int, where: jax.sharding.Mesh, scale=1.0) -> dict:
    keys = jax.random.split(jax.random.key(seed), LEAVES)
    sharding = NamedSharding(where, SPEC)
    return {
        f"layer{i}": jax.device_put(
            np.asarray(scale * jax.random.normal(keys[i], shape), np.float32), sharding
        )
        for i in range(LEAVES)
    }


class Contender(TimedStep):
    """A compiled step timed as in `_steps` (the gradients are its batch, `EVERY` calls a
    sample), with the compiled program's memory per device."""

    def __init__(self, fn: Callable, carry: tuple, grads: Any):
        super().__init__(fn, carry, grads, EVERY)

    def memory(self) -> dict[str, int]:
        """Per-device bytes of the compiled program (one partition of the SPMD program)."""
        m = self.compiled.memory_analysis()
        return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in (*MEMORY, "alias")}

    def hlo(self, shard_shape: tuple[int, ...]) -> dict[str, Any]:
        """The compiled program's collectives, and its copies of a whole param shard."""
        text = self.compiled.as_text()
        dims = ",".join(map(str, shard_shape))
        copies = len(re.findall(rf"= f32\[{dims}\]\S* copy\(", text))
        return {"collectives": count_collectives(text), "shard_copies": copies}


# --------------------------------------------------------------------------- the steps


def init(tx: Any, params: Any, mode: str) -> Any:
    """The state as the guide says to make it: explicit sharding gives the params'
    layout from `init` itself; auto sharding needs `state_shardings`."""
    if mode == "auto":
        return jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))(params)
    return jax.jit(tx.init)(params)


def contender(pattern: str, ours: bool, every: int, params: dict, grads: dict, mode: str):
    tx = accumulating_adam(ours, every)
    params = jax.tree.map(jnp.copy, params)
    step = fused if pattern == "apply_gradients" and ours else canonical
    return Contender(functools.partial(step, tx), (params, init(tx, params, mode)), grads)


def floor(params: dict, grads: dict) -> Contender:
    acc = jax.tree.map(lambda p: jax.device_put(np.zeros(p.shape, p.dtype), p.sharding), params)
    return Contender(lambda a, g: jax.tree.map(jnp.add, a, g), (acc,), grads)


# --------------------------------------------------------------------------- timing


def interleaved(contenders: dict[str, Contender], rounds: int) -> tuple[dict, dict]:
    """`rounds` samples of each contender after a warm-up round, in an order that
    rotates from round to round: wall-clock and CPU seconds per step."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r, k in rotations(names, rounds):
        t, c = contenders[k].sample()
        if r:
            wall[k].append(t)
            cpu[k].append(c)
    return wall, cpu


def bench_mode(mode: str, shape: tuple[int, int], rounds: int) -> dict[str, Any]:
    """Every pattern in one sharding mode: the figures of each pattern, and the
    contenders' memory and HLO counts."""
    where = mesh(mode)
    shard = (shape[0] // MESH["fsdp"], shape[1])
    with jax.set_mesh(where):
        params, grads = random_tree(shape, 0, where), random_tree(shape, 1, where, 1e-3)
        contenders = {"floor": floor(params, grads)}
        contenders["base_held"] = contender("canonical", False, NEVER, params, grads, mode)
        contenders["base_cycle"] = contender("canonical", False, EVERY, params, grads, mode)
        for pattern in PATTERNS:
            contenders[f"{pattern}_held"] = contender(pattern, True, NEVER, params, grads, mode)
            contenders[f"{pattern}_cycle"] = contender(pattern, True, EVERY, params, grads, mode)
        laid_out = _laid_out_like_params(contenders, shard)
        samples, cpu = interleaved(contenders, rounds)
    programs = {
        k: {"memory": c.memory(), **c.hlo(shard)}
        for k, c in contenders.items()
        if k.endswith("_cycle") or k == "floor"
    }
    base = programs["base_cycle"]["memory"]
    results: dict[str, Any] = {}
    for pattern in PATTERNS:
        ours = programs[f"{pattern}_cycle"]["memory"]
        results[pattern] = {
            "held_vs_floor": paired(samples, f"{pattern}_held", "floor"),
            "base_held_vs_floor": paired(samples, "base_held", "floor"),
            "cycle_speedup": paired(samples, "base_cycle", f"{pattern}_cycle"),
            "ours_cycle_ms": 1e3 * statistics.median(samples[f"{pattern}_cycle"]),
            "base_cycle_ms": 1e3 * statistics.median(samples["base_cycle"]),
            "ours_held_ms": 1e3 * statistics.median(samples[f"{pattern}_held"]),
            "floor_ms": 1e3 * statistics.median(samples["floor"]),
            "held_vs_floor_cpu": paired(cpu, f"{pattern}_held", "floor"),
            "cycle_speedup_cpu": paired(cpu, "base_cycle", f"{pattern}_cycle"),
            **{f"{k}_vs_base": ours[k] / max(base[k], 1) for k in MEMORY},
        }
    return {
        "results": results,
        "programs": programs,
        "state_laid_out_like_params": laid_out,
        "shard_shape": list(shard),
        "samples_ms": {k: [1e3 * t for t in v] for k, v in samples.items()},
        "cpu_samples_ms": {k: [1e3 * t for t in v] for k, v in cpu.items()},
    }


def _laid_out_like_params(contenders: dict[str, Contender], shard: tuple[int, ...]) -> bool:
    """Whether every param-shaped array each step carries holds one param shard per
    device (so the memory figures compare sharded states)."""
    for c in contenders.values():
        for leaf in jax.tree.leaves(c.carry):
            if leaf.ndim == 2 and leaf.addressable_shards[0].data.shape != shard:
                return False
    return True


# --------------------------------------------------------------------------- report


def verdict(size: str, pattern: str, figure: str, value: float) -> str:
    key = (size, pattern, figure)
    if key not in TARGETS or jax.devices()[0].platform != "cpu":
        return ""
    target, kind = TARGETS[key]
    ok = value <= target if kind == "max" else value >= target
    return f"{'<=' if kind == 'max' else '>='} {target:g} {'ok' if ok else 'MISSED'}"


def report(size: str, results: dict[str, dict]) -> None:
    print(
        f"\n{size} float32 parameters ({LEAVES} leaves, P('fsdp', None) on a "
        f"(data=2, fsdp=4) mesh), Adam, {EVERY} gradients per release"
    )
    header = (
        f"{'mode':9} {'pattern':16} {'held/floor':>10} {'target':>12} {'cpu':>5} "
        f"{'MultiSteps':>10} {'cycle x':>8} {'target':>12} {'cpu':>5} {'temp/MS':>8} "
        f"{'target':>10} {'arg/MS':>7} {'out/MS':>7} {'ours ms':>8} {'MS ms':>8}"
    )
    print(header)
    print("-" * len(header))
    for mode, m in results.items():
        for pattern, r in m["results"].items():
            print(
                f"{mode:9} {pattern:16} {r['held_vs_floor']:10.2f} "
                f"{verdict(size, pattern, 'held_vs_floor', r['held_vs_floor']):>12} "
                f"{r['held_vs_floor_cpu']:5.2f} "
                f"{r['base_held_vs_floor']:10.2f} {r['cycle_speedup']:8.2f} "
                f"{verdict(size, pattern, 'cycle_speedup', r['cycle_speedup']):>12} "
                f"{r['cycle_speedup_cpu']:5.2f} "
                f"{r['temp_vs_base']:8.2f} "
                f"{verdict(size, pattern, 'temp_vs_base', r['temp_vs_base']):>10} "
                f"{r['argument_vs_base']:7.2f} {r['output_vs_base']:7.2f} "
                f"{r['ours_cycle_ms']:8.2f} {r['base_cycle_ms']:8.2f}"
            )
    print(
        "held/floor: a held step over `acc + g` (MultiSteps: its held step over the same "
        "floor); cycle x: MultiSteps' cycle of 8 steps over ours; cpu: the same ratio in "
        "process CPU time (less disturbed by other load); temp, arg, out /MS: "
        "per-device temporary, argument and output bytes over MultiSteps'; ms: per step "
        "in a cycle"
    )
    for mode, m in results.items():
        for name, prog in m["programs"].items():
            mem = prog["memory"]
            col = prog["collectives"]
            print(
                f"  {mode:9} {name:22} per device: args {mem['argument'] / 2**20:7.2f} MiB, "
                f"outputs {mem['output'] / 2**20:7.2f} MiB, temps {mem['temp'] / 2**20:7.2f} "
                f"MiB; collectives every step {col['every_step'] or 'none'}, on release "
                f"{col['when_taken'] or 'none'}; shard copies {prog['shard_copies']}"
            )


def run(
    quick: bool = False, rounds: int | None = None, modes: tuple[str, ...] = MODES
) -> dict[str, Any]:
    """Measures every mode and pattern: the figures, keyed by size then mode (what the
    JSON holds under "results")."""
    size = "64K" if quick else "8M"
    rounds = rounds if rounds is not None else (1 if quick else 10)
    return {size: {mode: bench_mode(mode, SIZES[size], rounds) for mode in modes}}


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: both modes, both patterns, 8M (64K with
    `scale.quick`)."""
    from benchmarks._report import Row

    rounds = 1 if scale.quick else 5
    size = "64K" if scale.quick else "8M"
    on_cpu = jax.devices()[0].platform == "cpu"
    results = {size: {}}
    rows = []
    for mode in scale.progress(MODES, desc="sharded"):
        m = results[size][mode] = bench_mode(mode, SIZES[size], rounds)
        for pattern, r in m["results"].items():
            case = f"{size} {mode} {pattern}"

            def target(figure: str, pattern: str = pattern) -> Any:
                return TARGETS.get((size, pattern, figure)) if on_cpu else None

            rows += [
                Row.checked(
                    "sharded",
                    case,
                    "held step / `acc + g`",
                    r["held_vs_floor"],
                    target("held_vs_floor"),
                ),
                Row("sharded", case, "held step / `acc + g`, CPU time", r["held_vs_floor_cpu"]),
                Row("sharded", case, "MultiSteps' held step / `acc + g`", r["base_held_vs_floor"]),
                Row.checked(
                    "sharded",
                    case,
                    "cycle of 8, MultiSteps / ours",
                    r["cycle_speedup"],
                    target("cycle_speedup"),
                ),
                Row("sharded", case, "ours, per step in a cycle", r["ours_cycle_ms"], unit="ms"),
                Row.checked(
                    "sharded",
                    case,
                    "per-device temporaries, ours / MultiSteps",
                    r["temp_vs_base"],
                    target("temp_vs_base"),
                ),
                Row("sharded", case, "per-device arguments, ours / MultiSteps",
                    r["argument_vs_base"]),
            ]  # fmt: skip
    details = {"rounds": rounds, "leaves": LEAVES, "every": EVERY, "mesh": MESH, "results": results}
    return rows, details


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10)")
    parser.add_argument("--mode", choices=MODES, action="append", help="default: both")
    parser.add_argument("--quick", action="store_true", help="tiny leaves: a smoke test")
    parser.add_argument("--out", type=Path, default=RESULTS / "sharded.json")
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if len(jax.devices("cpu")) < 8:
        parser.error(f"needs 8 CPU devices, found {len(jax.devices('cpu'))} (set XLA_FLAGS)")
    modes = tuple(args.mode or MODES)
    rounds = args.rounds or (1 if args.quick else 10)

    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({device.platform}); mesh (data=2, fsdp=4) on 8 CPU "
        f"devices; jax {jax.__version__}, optax {optax.__version__}; make_mesh default: "
        f"{default_mode()}; {rounds} rounds; load average {os.getloadavg()[0]:.2f}"
    )
    start_load = os.getloadavg()
    results = run(args.quick, rounds, modes)
    (size,) = results
    report(size, results[size])
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "make_mesh_default": default_mode(),
        "load_average": {"start": start_load, "end": os.getloadavg()},
        "rounds": rounds,
        "leaves": LEAVES,
        "every": EVERY,
        "mesh": MESH,
        "spec": str(SPEC),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
