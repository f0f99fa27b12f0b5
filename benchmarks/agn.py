"""Does AGN match synchronous SGD with fewer all-reduces? A convergence study on digits.

Eight workers (8 simulated CPU devices, `jax.shard_map`) train the demo's small Flax MLP,
each on its own shard of scikit-learn's digits, and every method sees exactly the same
examples in the same order: `--steps` local steps of `--batch` examples per worker.
Synchronous data-parallel SGD (`cross_shard_optimizer(optax.sgd(lr))`) all-reduces
gradients every step; `agn` all-reduces once per period. Reported per method (mean
over `--seeds`): the final test accuracy and loss of the centre, the number of
all-reduces, and the bytes they carry (one parameter-sized float32 tree each). The
training run is the demo's (`optax_accum.demo.agn.study`); this script gives it more
methods, steps and seeds.

Target: AGN with period 4 within 1 percentage point of synchronous SGD with 4x fewer
all-reduces. A second experiment explains the TF default's shortfall: it gives TF's
AGN with period 4 four times the examples (the same number of all-reduces as
synchronous SGD). A third compares Streaming DiLoCo (`agn(..., fragments=, delay=,
communication_dtype=)`, a fragment per layer) with DiLoCo and synchronous SGD by
traffic, read from each method's compiled train step on the 8 devices (`traffic`):
the bytes a device sends on the heaviest step and per 100 steps, and the step's time
against synchronous SGD's. A last table times one step with 2M parameters against a
plain `optax.adam` step: what agn's local and sync steps add to the compute. The TPU
compiler's schedule of the sync against the step is `benchmarks/agn_tpu.py`'s.

Run: `python benchmarks/agn.py` (about two minutes on two CPU cores). Writes
`benchmarks/results/agn.json` and the plot `benchmarks/results/agn.png` (accuracy
against communication rounds, seed 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import functools
import json
import pathlib
import platform
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import Sizes, hlo, notebook
from optax_accum.demo.agn import (
    LEARNING_RATE,
    WORKERS,
    Method,
    Result,
    streaming,
    study,
)

RESULTS = pathlib.Path(__file__).parent / "results"
SYNC = "sync SGD (cross_shard_optimizer)"
TF_P4 = "agn P=4 (TF: outer = inner)"
SCALED_P4 = "agn P=4, outer sgd(4*lr)"
DILOCO = "agn delta P=4, DiLoCo outer"
SD_F32 = "streaming DiLoCo, 2 layers, P=4, delay 1, float32"
SD_INT8 = "streaming DiLoCo, 2 layers, P=4, delay 1, int8"
SD_EVERY = "streaming DiLoCo, 2 layers, P=2, delay 1, int8"  # a fragment every step
QUICK_METHODS = (SYNC, TF_P4, SCALED_P4, DILOCO, SD_INT8)  # `--quick`'s
# The methods compared by traffic, with their period (steps between a fragment's syncs).
TRAFFIC = {SYNC: 1, DILOCO: 4, SD_F32: 4, SD_INT8: 4, SD_EVERY: 2}


# --------------------------------------------------------------------------- the methods


def methods(lr: float = LEARNING_RATE) -> list[Method]:
    """Synchronous SGD, then AGN as TF runs it, with a scaled outer step, and by delta."""
    sync = Method(
        "sync SGD (cross_shard_optimizer)",
        lambda axis: optax_accum.cross_shard_optimizer(optax.sgd(lr), axis),
        model=lambda params, state: params,
        synced=lambda state: jnp.asarray(True),
    )
    tf_default = [
        Method(
            f"agn P={p} (TF: outer = inner)",
            lambda axis, p=p: optax_accum.agn(optax.sgd(lr), p, axis_name=axis),
        )
        for p in (1, 4, 16)
    ]
    scaled = [
        Method(
            f"agn P={p}, outer sgd({p}*lr)",
            lambda axis, p=p: optax_accum.agn(
                optax.sgd(lr), p, axis_name=axis, outer=optax.sgd(p * lr)
            ),
        )
        for p in (4, 16)
    ]
    delta = [
        Method(
            "agn delta P=4, outer sgd(1) (paper)",
            lambda axis: optax_accum.agn(optax.sgd(lr), 4, axis_name=axis, commit="delta"),
        ),
        Method(
            "agn delta P=4, outer sgd(4) (model avg.)",
            lambda axis: optax_accum.agn(
                optax.sgd(lr), 4, axis_name=axis, commit="delta", outer=optax.sgd(4.0)
            ),
        ),
        Method(
            "agn delta P=4, DiLoCo outer",
            lambda axis: optax_accum.agn(
                optax.sgd(lr),
                4,
                axis_name=axis,
                commit="delta",
                outer=optax.sgd(0.7 * 4, momentum=0.9, nesterov=True),
            ),
        ),
    ]
    every = streaming(lr, jnp.int8)
    fragment_a_step = dataclasses.replace(
        streaming(lr, jnp.int8, period=2),
        name=SD_EVERY,
        # one buffer as long as the larger layer, every step
        wire=lambda params: (max(every.wire(params)),),
    )
    return [
        sync,
        *tf_default,
        *scaled,
        *delta,
        dataclasses.replace(streaming(lr, jnp.float32), name=SD_F32),
        dataclasses.replace(streaming(lr, jnp.int8), name=SD_INT8),
        fragment_a_step,
    ]


# --------------------------------------------------------------------------- report


def _summarise(per_seed: list[list[Result]]) -> list[dict]:
    """Mean and spread over seeds, per method, in the order the methods ran."""
    rows = []
    for runs in zip(*per_seed, strict=True):
        acc = np.array([r.accuracy for r in runs])
        rows.append(
            {
                "method": runs[0].method,
                "accuracy_mean": float(acc.mean()),
                "accuracy_std": float(acc.std()),
                "accuracy_per_seed": acc.tolist(),
                "loss_mean": float(np.mean([r.loss for r in runs])),
                "all_reduces": runs[0].all_reduces,
                "bytes": runs[0].bytes,
                "seconds_mean": float(np.mean([r.seconds for r in runs])),
            }
        )
    return rows


def _table(rows: list[dict], sync: dict) -> str:
    head = ("method", "test acc", "± std", "loss", "Δ acc (pp)", "all-reduces", "fewer", "MB")
    body = [
        (
            r["method"],
            f"{100 * r['accuracy_mean']:.2f}",
            f"{100 * r['accuracy_std']:.2f}",
            f"{r['loss_mean']:.3f}",
            f"{100 * (r['accuracy_mean'] - sync['accuracy_mean']):+.2f}",
            str(r["all_reduces"]),
            f"{sync['all_reduces'] / r['all_reduces']:.0f}x",
            f"{r['bytes'] / 1e6:.2f}",
        )
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, body)])


def _verdict(name: str, row: dict, sync: dict) -> str:
    gap = 100 * (row["accuracy_mean"] - sync["accuracy_mean"])
    fewer = sync["all_reduces"] / row["all_reduces"]
    met = gap >= -1.0 and fewer >= 4.0
    verdict = "MET" if met else "NOT met"
    return f"{name}: {gap:+.2f} pp, {fewer:.0f}x fewer all-reduces -> target {verdict}"


def _plot(results: list[Result], extra: Result, batch: int, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_rounds, by_examples) = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    colours = plt.get_cmap("tab10").colors
    for i, r in enumerate([*results, extra]):
        style = {"linestyle": "--" if r is extra else (":" if "delta" in r.method else "-")}
        style |= {"color": colours[i % len(colours)], "label": r.method, "linewidth": 1.3}
        by_rounds.plot(r.rounds, r.curve, **style)
        by_examples.plot(np.asarray(r.steps) * batch, r.curve, **style)
    by_rounds.set_xscale("log")
    by_rounds.set_xlabel("communication rounds (all-reduces)")
    by_examples.set_xscale("log")
    by_examples.set_xlabel("examples seen per worker")
    by_rounds.set_ylabel("test accuracy of the centre")
    for ax in (by_rounds, by_examples):
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = by_rounds.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("8 workers on digits, each on its own shard: AGN vs synchronous SGD")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def _sent(found: list) -> float:
    """Bytes a device sends for `found` collectives over a ring of the `WORKERS`: an
    all-reduce its result twice (a reduce-scatter, then an all-gather), an all-to-all
    and an all-gather theirs once, each (n - 1) / n of it."""
    weight = {"all-reduce": 2.0}
    return sum(weight.get(c.opcode, 1.0) * c.nbytes for c in found) * (WORKERS - 1) / WORKERS


def _branches(text: str) -> tuple[float, list[float]]:
    """A compiled step's bytes sent on every step, and those of each region that runs
    only when taken (a conditional, its largest branch; a loop's body), in order."""
    entry, comps = hlo.computations(text)

    def collectives_from(name: str) -> list:
        lines = []
        for comp, body in comps.items():
            lines += [f"{'ENTRY ' if comp == name else ''}%{comp} () -> () {{", *body, "}"]
        return hlo.collectives("\n".join(lines))

    every, regions, todo, seen = 0.0, [], [entry], set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        every += _sent([c for c in collectives_from(name) if c.every_step and name == entry])
        for line in comps[name]:
            todo += hlo.called(line)
            gated = re.search(r"\b(?:body|branch_computations|true_computation)=", line)
            if gated is None:
                continue
            names = re.findall(r"(?:body|true_computation|false_computation)=%?([\w.\-]+)", line)
            listed = re.search(r"branch_computations=\{([^}]*)\}", line)
            names += [n.strip().lstrip("%") for n in listed.group(1).split(",")] if listed else []
            sizes = [_sent(collectives_from(n)) for n in names]
            if max(sizes, default=0.0):
                regions.append(max(sizes))
    return every, regions


def _wide_problem() -> tuple:
    """Bytes only: two 1024 x 1024 tanh layers (2M parameters, named as the demo's Flax
    layers are), where int8's blocks and shares cost no padding."""
    params = {f"Dense_{i}": {"kernel": jnp.zeros((1024, 1024))} for i in range(2)}

    def loss_fn(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        h = xb
        for i in range(2):
            h = jnp.tanh(h @ params[f"Dense_{i}"]["kernel"])
        return jnp.mean((h[:, :10] - jax.nn.one_hot(yb, 10)) ** 2)

    xb = jnp.zeros((WORKERS, 16, 1024))
    return params, loss_fn, xb, jnp.zeros((WORKERS, 16), jnp.int32)


def _digits_problem() -> tuple:
    x, y, _, _ = notebook.digits()
    _, params, loss_fn, _ = notebook.mlp(x[:1], y[:1])
    xb = jnp.asarray(x[: 16 * WORKERS].reshape(WORKERS, 16, -1))
    return params, loss_fn, xb, jnp.asarray(y[: 16 * WORKERS].reshape(WORKERS, 16))


def traffic(
    lr: float = LEARNING_RATE,
    steps: int = 100,
    rounds: int = 5,
    wide: bool = False,
    only: tuple[str, ...] | None = None,
) -> list[dict]:
    """Each `TRAFFIC` method's train step (the demo's MLP, or with `wide` two layers of
    1024 x 1024; 16 examples a worker; the workers on `WORKERS` devices under
    `jax.shard_map`), compiled once: the bytes a device sends on every step and in each
    sync's branch, read from the program, and from them the heaviest step's and `steps`
    steps' bytes (a sync branch runs once a period); and the step's median time over
    `rounds` rounds of 10 steps, the methods' rounds interleaved (none with `wide`).
    `only`: these methods (and synchronous SGD and DiLoCo, the references)."""
    params, loss_fn, xb, yb = _wide_problem() if wide else _digits_problem()
    mesh = jax.make_mesh((WORKERS,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))
    stacked = jax.tree.map(lambda p: jnp.tile(p[None], (WORKERS,) + (1,) * p.ndim), params)
    one = functools.partial(jax.tree.map, lambda a: a[0])
    rows, runs = [], []
    for method in methods(lr):
        if method.name not in TRAFFIC or (only and method.name not in {*only, SYNC, DILOCO}):
            continue
        tx = method.make("w")
        specs = optax_accum.state_partition_specs(tx, params, mesh, param_axes=("w",))

        def step(params, state, xb, yb, tx=tx):
            params, xb, yb = one(params), one(xb), one(yb)
            updates, state = tx.update(jax.grad(loss_fn)(params, xb, yb), state, params)
            return jax.tree.map(lambda a: a[None], optax.apply_updates(params, updates)), state

        rows_ = P("w")
        mapped = jax.shard_map(
            step, mesh=mesh, in_specs=(rows_, specs, rows_, rows_), out_specs=(rows_, specs)
        )
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(params) if not wide else jax.eval_shape(init, params)
        lowered = jax.jit(mapped, donate_argnums=(0, 1)).lower(stacked, state, xb, yb)
        compiled = lowered.compile()
        every, regions = _branches(compiled.as_text())
        if not wide:  # one call first: the first run of a program pays for its setup
            carry = jax.block_until_ready(compiled(jax.tree.map(jnp.copy, stacked), state, xb, yb))
            runs.append([compiled, carry, []])
        row = {
            "method": method.name,
            "every_step_bytes": every,
            "sync_branch_bytes": regions,
            "peak_step_bytes": every + max(regions, default=0.0),
            "bytes_per_100_steps": steps * every + steps / TRAFFIC[method.name] * sum(regions),
        }
        rows.append(row)
    for _ in range(rounds if runs else 0):  # the methods' rounds interleaved
        for run in runs:
            compiled, carry, times = run
            start = time.perf_counter()
            for _ in range(10):
                carry = compiled(*carry, xb, yb)
            jax.block_until_ready(carry)
            times.append((time.perf_counter() - start) / 10)
            run[1] = carry
    for row, (_, _, times) in zip(rows, runs, strict=False):
        row["step_ms"] = 1e3 * float(np.median(times))
        row["step_time_vs_sync"] = float(np.median(times)) / float(np.median(runs[0][2]))
    return rows


def _step_cost(size: int = 2_000_000, rounds: int = 11, reps: int = 5) -> list[dict]:
    """Wall time of one jitted, donated step: plain Adam vs agn's local and sync steps.

    One device, no axis (so no collective): what agn adds to the compute of a step.
    Medians of interleaved rounds, as ratios to plain Adam measured in the same run.
    """
    params = {f"w{i}": jnp.zeros(size // 4) for i in range(4)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    contenders = {
        "optax.adam step (baseline)": optax.adam(1e-3),
        "agn(adam) local step": optax_accum.agn(optax.adam(1e-3), 10**6),
        "agn(adam) sync step (period 1)": optax_accum.agn(optax.adam(1e-3), 1),
    }
    runs = {}
    for name, tx in contenders.items():

        def step(p, s, g, tx=tx):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        fn = jax.jit(step, donate_argnums=(0, 1))
        p = jax.tree.map(jnp.copy, params)
        carry = jax.block_until_ready(fn(p, jax.jit(tx.init)(p), grads))
        runs[name] = [fn, carry, []]
    for _ in range(rounds):
        for run in runs.values():
            fn, carry, times = run
            start = time.perf_counter()
            for _ in range(reps):
                carry = fn(*carry, grads)
            jax.block_until_ready(carry)
            times.append((time.perf_counter() - start) / reps)
            run[1] = carry
    base = float(np.median(next(iter(runs.values()))[2]))
    return [
        {"step": name, "ms": 1e3 * float(np.median(t)), "ratio": float(np.median(t)) / base}
        for name, (_, _, t) in runs.items()
    ]


def run(
    steps: int = 1024,
    batch: int = 16,
    lr: float = LEARNING_RATE,
    seeds: tuple[int, ...] = (0, 1, 2),
    cost_size: int = 2_000_000,
    cost_rounds: int = 11,
    progress: bool = True,
    only: tuple[str, ...] | None = None,
) -> tuple[dict, list[list[Result]], list[list[Result]]]:
    """Every figure: the report `main` writes, and the runs behind it (per seed).
    `only`: the methods of these names (default: every method; `TF_P4` always runs,
    the longer run repeats it)."""
    if steps % 16:
        raise ValueError(f"steps must be a multiple of 16 (whole rounds), got {steps}")
    selected = [m for m in methods(lr) if only is None or m.name in {*only, TF_P4}]
    per_seed = [study(Sizes(steps=steps, batch=batch, seed=s), selected, progress) for s in seeds]
    rows = _summarise(per_seed)

    # Why TF's default falls short: the same method with 4x the examples.
    tf_p4 = next(m for m in selected if m.name == TF_P4)
    longer = dataclasses.replace(tf_p4, name=f"{TF_P4}, 4x examples")
    per_seed_long = [
        study(Sizes(steps=4 * steps, batch=batch, seed=s), [longer], progress) for s in seeds
    ]
    (long_row,) = _summarise(per_seed_long)
    config = {"steps": steps, "batch": batch, "lr": lr, "seeds": list(seeds)}
    report = {
        "config": config | {"workers": WORKERS, "devices": len(jax.devices())},
        "machine": platform.platform(),
        "methods": [*rows, long_row],
        "step_cost": _step_cost(cost_size, cost_rounds),
        "traffic": traffic(lr, rounds=cost_rounds, only=only),
        "traffic_2M": traffic(lr, wide=True, only=only),
        "curves_seed0": [dataclasses.asdict(r) for r in [*per_seed[0], per_seed_long[0][0]]],
    }
    return report, per_seed, per_seed_long


def _traffic_rows(report: dict) -> list:
    """The traffic tables' rows: peak and per-100-step bytes against DiLoCo's (the
    target: int8 streaming at 2M parameters sends at most 1/3.9 of them), step time."""
    from benchmarks._report import Row

    rows = []
    for key, size in (("traffic", "digits MLP"), ("traffic_2M", "2M params")):
        diloco = next(r for r in report[key] if r["method"] == DILOCO)
        for r in report[key]:
            case = f"{r['method']} ({size})"
            rows.append(Row("agn", case, "peak bytes a step", r["peak_step_bytes"], "B"))
            ratio = r["bytes_per_100_steps"] / diloco["bytes_per_100_steps"]
            target = (1 / 3.9, "max") if key == "traffic_2M" and r["method"] == SD_INT8 else None
            rows.append(Row.checked("agn", case, "bytes per 100 steps / DiLoCo's", ratio, target))
            if "step_time_vs_sync" in r:
                rows.append(Row("agn", case, "step time / sync SGD's", r["step_time_vs_sync"]))
    return rows


def _traffic_table(rows: list) -> str:
    head = ("method", "peak kB a step", "kB per 100 steps", "step ms", "/ sync SGD")
    body = [
        (
            r["method"],
            f"{r['peak_step_bytes'] / 1e3:.1f}",
            f"{r['bytes_per_100_steps'] / 1e3:.1f}",
            f"{r['step_ms']:.2f}" if "step_ms" in r else "-",
            f"{r['step_time_vs_sync']:.2f}" if "step_time_vs_sync" in r else "-",
        )
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, body)])


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks` (its `agn.png` goes next to the report)."""
    from benchmarks._report import Row

    if scale.quick:
        # A smoke test: one method of each kind (synchronous SGD, agn as TF runs it,
        # with a scaled outer step, and by delta with a momentum outer step), each
        # training program compiling once, at one period and one seed.
        report, per_seed, long = run(
            16, 8, seeds=(0,), cost_size=20_000, cost_rounds=1, only=QUICK_METHODS
        )
    else:
        report, per_seed, long = run()
    methods_ = report["methods"]
    sync = next(r for r in methods_ if r["method"] == SYNC)
    rows = []
    for r in methods_:
        gap = 100 * (r["accuracy_mean"] - sync["accuracy_mean"])
        rows.append(Row("agn", r["method"], "test accuracy", 100 * r["accuracy_mean"], "%"))
        if r is sync:
            continue
        rows.append(
            Row.checked(
                "agn",
                r["method"],
                "accuracy - sync SGD's",
                gap,
                (-1.0, "min") if r["method"] == SCALED_P4 else None,
                unit="pp",
            )
        )
        rows.append(
            Row.checked(
                "agn",
                r["method"],
                "all-reduces, sync SGD / this",
                sync["all_reduces"] / r["all_reduces"],
                (4.0, "min") if r["method"] == SCALED_P4 else None,
            )
        )
    for c in report["step_cost"]:
        rows.append(Row("agn", c["step"], "step time / plain Adam's", c["ratio"]))
    rows += _traffic_rows(report)
    out = scale.options.get("out")
    if out is not None:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        _plot(per_seed[0], long[0][0], report["config"]["batch"], pathlib.Path(out) / "agn.png")
    return rows, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024, help="local steps per worker")
    parser.add_argument("--batch", type=int, default=16, help="examples per worker step")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.steps % 16:
        parser.error("--steps must be a multiple of 16 (whole rounds for every period)")

    report, per_seed, per_seed_long = run(args.steps, args.batch, args.lr, tuple(args.seeds))
    rows, long_row = report["methods"][:-1], report["methods"][-1]
    by_name = {r["method"]: r for r in rows}
    sync = by_name[SYNC]

    print(f"\n{len(jax.devices())} devices, {args.steps} steps x {args.batch} examples per worker")
    print(f"lr {args.lr}, seeds {args.seeds}\n")
    print(_table([*rows, long_row], sync))
    print()
    print(_verdict(TF_P4, by_name[TF_P4], sync))
    print(_verdict(SCALED_P4, by_name[SCALED_P4], sync))
    print(
        f"{long_row['method']}: {100 * (long_row['accuracy_mean'] - sync['accuracy_mean']):+.2f}"
        f" pp with {long_row['all_reduces']} all-reduces (sync SGD: {sync['all_reduces']})"
    )

    print("\nTraffic, read from each method's compiled step on the 8 devices (bytes a device")
    print("sends over a ring), and the step's time; the demo's MLP:")
    print(_traffic_table(report["traffic"]))
    print("\nThe same at 2M parameters (two layers of 1024 x 1024), bytes only:")
    print(_traffic_table(report["traffic_2M"]))

    print("\nStep cost, 2M float32 params, one device (what agn adds to a step):")
    for c in report["step_cost"]:
        print(f"  {c['step']:32s} {c['ms']:7.2f} ms  {c['ratio']:.2f}x")

    RESULTS.mkdir(exist_ok=True)
    _plot(per_seed[0], per_seed_long[0][0], args.batch, RESULTS / "agn.png")
    (RESULTS / "agn.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {RESULTS / 'agn.json'} and {RESULTS / 'agn.png'}")


if __name__ == "__main__":
    main()
