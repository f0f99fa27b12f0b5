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
synchronous SGD). A last table times one step with 2M parameters against a plain
`optax.adam` step: what agn's local and sync steps add to the compute.

Run: `python benchmarks/agn.py` (about two minutes on two CPU cores). Writes
`benchmarks/results/agn.json` and the plot `benchmarks/results/agn.png` (accuracy
against communication rounds, seed 0).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import json
import pathlib
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import Sizes
from optax_accum.demo.agn import LEARNING_RATE, WORKERS, Method, Result, study

RESULTS = pathlib.Path(__file__).parent / "results"
SYNC = "sync SGD (cross_shard_optimizer)"
TF_P4 = "agn P=4 (TF: outer = inner)"
SCALED_P4 = "agn P=4, outer sgd(4*lr)"
QUICK_METHODS = (SYNC, TF_P4, SCALED_P4, "agn delta P=4, DiLoCo outer")  # `--quick`'s


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
    return [sync, *tf_default, *scaled, *delta]


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
        "curves_seed0": [dataclasses.asdict(r) for r in [*per_seed[0], per_seed_long[0][0]]],
    }
    return report, per_seed, per_seed_long


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

    print("\nStep cost, 2M float32 params, one device (what agn adds to a step):")
    for c in report["step_cost"]:
        print(f"  {c['step']:32s} {c['ms']:7.2f} ms  {c['ratio']:.2f}x")

    RESULTS.mkdir(exist_ok=True)
    _plot(per_seed[0], per_seed_long[0][0], args.batch, RESULTS / "agn.png")
    (RESULTS / "agn.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {RESULTS / 'agn.json'} and {RESULTS / 'agn.png'}")


if __name__ == "__main__":
    main()
