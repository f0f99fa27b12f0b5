"""Does a holding transform, or a nest of them, cost more to compile than optax.MultiSteps?

Setup (issue 22): a model of 240 float32 leaves of assorted small shapes, Adam inside,
the canonical optax train step (`u, s = tx.update(g, s, p); p = apply_updates(p, u)`,
params and state donated), jitted afresh for every measurement so that nothing is
cached. For every transform, one level deep and nested up to three levels, the step is
traced, lowered and compiled, each stage timed on its own
(`jax.jit(step).trace(...)`, `.lower()`, `.compile()`), against the same step with
`optax.MultiSteps(adam)` in the same round. Rounds are interleaved after a warm-up
round; figures are medians over rounds, ratios are medians of per-round ratios.

Also reported, to see where the time goes: how many times Adam's `update` was traced,
the number of equations in the step's jaxpr (sub-jaxprs included), and the number of
lines of the lowered StableHLO.

`cross_shard_optimizer` runs under `jax.shard_map` on a mesh of one device (its
collective needs a mesh axis), as do its own figures for MultiSteps' baseline: the
baseline of every row is the plain MultiSteps step.

Target: every transform, nested up to three levels, within 1.2x of MultiSteps.

Reference rows, not held to the target, measure what the same structures cost when
built from MultiSteps itself: MultiSteps nested two and three deep (the nests of
`conditional_accumulator`), and MultiSteps around two Adams (`agn` runs two optimizers,
`inner` and `outer`). XLA's compile passes grow faster than the state they carry, so a
nest holding three sums, or two optimizers' states, cannot come within 1.2x of one
MultiSteps; these rows say how far its like-for-like baseline is.

Run from the repository root: `python -m benchmarks.compile_time` (`--rounds 1` for a
quick look, `--leaves 24` for a tiny model). Prints a table and writes
`benchmarks/results/compile_time.json`. With `--passes`, it then also says where XLA's
compile time goes: each transform's step is compiled once more under `jax.profiler`,
and the passes that took longer than MultiSteps' are listed (seconds, from the trace).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_accum

LEAVES = 240
EVERY = 4
TARGET = 1.2
BASELINE = "MultiSteps(adam)"
RESULTS = Path(__file__).resolve().parent / "results"
STAGES = ("trace", "lower", "compile")

CA = optax_accum.conditional_accumulator
DS = optax_accum.drop_stale_gradients


def _sparse(inner: Any) -> Any:
    # Every leaf has fewer rows than `capacity`, so every leaf is kept dense.
    return optax_accum.sparse_conditional_accumulator(inner, EVERY, capacity=64)


def _agn(inner: Any) -> Any:
    return optax_accum.agn(inner, EVERY)


# name -> (how to wrap Adam, whether the step runs under shard_map over axis "i").
TRANSFORMS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    BASELINE: (lambda a: optax.MultiSteps(a, EVERY), False),
    "conditional_accumulator(adam)": (lambda a: CA(a, EVERY), False),
    "sparse_conditional_accumulator(adam), dense leaves": (_sparse, False),
    "drop_stale_gradients(adam)": (lambda a: DS(a, 2), False),
    "agn(adam)": (_agn, False),
    "cross_shard_optimizer(adam), shard_map": (
        lambda a: optax_accum.cross_shard_optimizer(a, "i"),
        True,
    ),
    "conditional_accumulator(conditional_accumulator(adam))": (
        lambda a: CA(CA(a, 2), 2),
        False,
    ),
    "drop_stale_gradients(conditional_accumulator(adam))": (lambda a: DS(CA(a, EVERY), 2), False),
    "agn(conditional_accumulator(adam))": (lambda a: _agn(CA(a, 2)), False),
    "drop_stale_gradients(sparse_conditional_accumulator(adam))": (
        lambda a: DS(_sparse(a), 2),
        False,
    ),
    "conditional_accumulator x3 (adam)": (lambda a: CA(CA(CA(a, 2), 2), 2), False),
    "drop_stale_gradients(conditional_accumulator(conditional_accumulator(adam)))": (
        lambda a: DS(CA(CA(a, 2), 2), 2),
        False,
    ),
    "agn(drop_stale_gradients(conditional_accumulator(adam)))": (
        lambda a: _agn(DS(CA(a, 2), 2)),
        False,
    ),
    "cross_shard_optimizer(drop_stale_gradients(conditional_accumulator(adam))), shard_map": (
        lambda a: optax_accum.cross_shard_optimizer(DS(CA(a, 2), 2), "i"),
        True,
    ),
}


# Structures built from MultiSteps itself: compared with, never held to the target.
REFERENCES = {
    "reference: MultiSteps x2 (adam)": lambda a: optax.MultiSteps(optax.MultiSteps(a, 2), 2),
    "reference: MultiSteps x3 (adam)": lambda a: optax.MultiSteps(
        optax.MultiSteps(optax.MultiSteps(a, 2), 2), 2
    ),
    "reference: MultiSteps(chain(adam, adam))": lambda a: optax.MultiSteps(
        optax.chain(a, optax.adam(1e-3)), EVERY
    ),
}
TRANSFORMS.update({name: (wrap, False) for name, wrap in REFERENCES.items()})
# transform -> the reference of the same structure.
LIKE_FOR_LIKE = {
    "conditional_accumulator(conditional_accumulator(adam))": "reference: MultiSteps x2 (adam)",
    "conditional_accumulator x3 (adam)": "reference: MultiSteps x3 (adam)",
    "agn(adam)": "reference: MultiSteps(chain(adam, adam))",
}


def model(leaves: int) -> dict[str, jax.Array]:
    """`leaves` float32 arrays of assorted small shapes (a deep model's kernels and biases)."""
    return {
        f"leaf{i:03d}": jnp.full((8 + 8 * (i % 5), 16 + 16 * (i % 3)), 0.01 * (i % 7), jnp.float32)
        for i in range(leaves)
    }


def counting_adam(counter: list[int]) -> optax.GradientTransformation:
    """`optax.adam(1e-3)` that counts how many times its `update` is traced."""
    adam = optax.adam(1e-3)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        counter[0] += 1
        return adam.update(updates, state, params)

    return optax.GradientTransformation(adam.init, update)


def _equations(jaxpr: Any, seen: set[int] | None = None) -> int:
    """Equations of a jaxpr and of every distinct sub-jaxpr (branches, loop bodies,
    calls), each counted once however many equations refer to it."""
    seen = set() if seen is None else seen
    if id(jaxpr) in seen:
        return 0
    seen.add(id(jaxpr))
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _equations(sub, seen)
    return total


def _step(name: str, counter: list[int], params: Any) -> tuple[Callable, Any]:
    """The canonical train step of transform `name`, and its initial state."""
    wrap, sharded = TRANSFORMS[name]
    tx = wrap(counting_adam(counter))

    def step(params: Any, state: Any, grads: Any) -> tuple:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    if not sharded:
        return step, state
    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    specs = optax_accum.state_partition_specs(tx, params, mesh)

    def per_replica(params: Any, state: Any, grads: Any) -> tuple:
        # Each replica's own gradient, as jax.grad of per-replica params gives it.
        return step(params, state, jax.lax.pcast(grads, "i", to="varying"))

    mapped = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)
    )
    return mapped, state


def measure(name: str, params: Any) -> dict[str, Any]:
    """Seconds to trace, lower and compile the step of `name`, and what it traced."""
    counter = [0]
    step, state = _step(name, counter, params)
    clocks = [(time.perf_counter(), time.process_time())]
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, params)
    clocks.append((time.perf_counter(), time.process_time()))
    lowered = traced.lower()
    clocks.append((time.perf_counter(), time.process_time()))
    compiled = lowered.compile()
    clocks.append((time.perf_counter(), time.process_time()))
    wall = {stage: clocks[i + 1][0] - clocks[i][0] for i, stage in enumerate(STAGES)}
    cpu = {f"{stage}_cpu": clocks[i + 1][1] - clocks[i][1] for i, stage in enumerate(STAGES)}
    return {
        **wall,
        "total": clocks[-1][0] - clocks[0][0],
        **cpu,
        "total_cpu": clocks[-1][1] - clocks[0][1],
        "fusions": compiled.as_text().count(" fusion("),
        "adam_traces": counter[0],
        "equations": _equations(traced.jaxpr.jaxpr),
        "stablehlo_lines": lowered.as_text().count("\n"),
    }


def pass_seconds(name: str, params: Any) -> dict[str, float]:
    """Seconds of every span in a `jax.profiler` trace of compiling the step of `name`
    (XLA's passes, its code generation, and their enclosing spans), summed by name."""
    step, state = _step(name, [0], params)
    lowered = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, params).lower()
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            lowered.compile()
        finally:
            jax.profiler.stop_trace()
        traces = list(Path(folder).rglob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError(f"jax.profiler wrote no trace under {folder}")
        events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    spans: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and not event["name"].startswith("$"):  # not Python's
            spans[event["name"]] += event["dur"] / 1e6
    return dict(spans)


def passes_table(leaves: int, names: Iterable[str], shown: int = 12) -> str:
    """Per transform, the compile spans that took longest beyond MultiSteps' (one
    compile each). Call it after `run`, whose warm-up round has taken JAX's and XLA's
    first uses out of the figures (each step is jitted afresh, so it compiles again)."""
    params = model(leaves)
    names = [BASELINE, *(n for n in names if n != BASELINE)]
    base = pass_seconds(BASELINE, params)
    lines = [f"seconds in XLA's compile spans, MultiSteps(adam) -> transform ({leaves} leaves)"]
    for name in names[1:]:
        spans = pass_seconds(name, params)
        extra = sorted(spans, key=lambda k: base.get(k, 0.0) - spans[k])[:shown]
        lines.append(name)
        lines += [f"  {base.get(k, 0.0):6.3f} -> {spans[k]:6.3f}  {k}" for k in extra]
    return "\n".join(lines)


def run(
    leaves: int = LEAVES,
    rounds: int = 2,
    names: Iterable[str] | None = None,
    progress: Callable[[Iterable], Iterable] = lambda it: it,
    warmup: bool = True,
) -> dict[str, Any]:
    """Every figure, per transform: medians over `rounds` interleaved rounds after a
    warm-up round (none without `warmup`: a smoke test, whose first round pays JAX's
    first uses), and the ratios to MultiSteps' figures of the same round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(names or TRANSFORMS)
    if BASELINE not in names:
        names.insert(0, BASELINE)
    params = model(leaves)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    order = [(r, n) for r in range(0 if warmup else 1, rounds + 1) for n in names]
    for r, name in progress(order):
        figures = measure(name, params)
        if r:  # round 0 warms up JAX's own caches (first uses of each primitive)
            samples[name].append(figures)
    base = samples[BASELINE]
    results = {}
    for name, runs in samples.items():
        row = {k: runs[0][k] for k in ("adam_traces", "equations", "stablehlo_lines", "fusions")}
        for stage in (*STAGES, "total", *(f"{s}_cpu" for s in (*STAGES, "total"))):
            row[f"{stage}_s"] = statistics.median(x[stage] for x in runs)
            row[f"{stage}_vs_multisteps"] = statistics.median(
                x[stage] / b[stage] for x, b in zip(runs, base, strict=True)
            )
        row["met"] = name in REFERENCES or row["total_vs_multisteps"] <= TARGET
        results[name] = row
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": os.getloadavg(),
        "leaves": leaves,
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "rounds": rounds,
        "warmup": warmup,
        "target": TARGET,
        "results": results,
    }


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: per transform, its trace, lower and
    compile time over MultiSteps' (`scale.quick`: 3 leaves, one round and no warm-up
    round, and no reference rows: each transform's step compiles once)."""
    from benchmarks._report import Row

    # One round on an accelerator, whose time is short and whose host is not shared.
    leaves, rounds = (3, 1) if scale.quick else (LEAVES, 1 if scale.accelerator else 2)
    # A quick run checks our transforms; the references hold no code of ours.
    names = [n for n in TRANSFORMS if not (scale.quick and n in REFERENCES)]
    report = run(
        leaves,
        rounds,
        names,
        progress=lambda it: scale.progress(it, desc="compile_time"),
        warmup=not scale.quick,
    )
    rows = []
    for name, r in report["results"].items():
        if name == BASELINE:
            rows.append(Row("compile_time", name, "trace + lower + compile", r["total_s"], "s"))
            continue
        reference = name in REFERENCES
        rows.append(
            Row.checked(
                "compile_time",
                name,
                f"trace + lower + compile, {'it' if reference else 'ours'} / MultiSteps",
                r["total_vs_multisteps"],
                None if reference else (TARGET, "max"),
            )
        )
    return rows, report


def table(report: dict[str, Any]) -> str:
    head = (
        f"{'transform':84} {'total x':>7} {'cpu x':>6} {'trace x':>7} {'lower x':>7} "
        f"{'compile x':>9} {'s':>6} {'adam':>4} {'eqns':>6} {'fusions':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, r in report["results"].items():
        lines.append(
            f"{name:84} {r['total_vs_multisteps']:7.2f} {r['total_cpu_vs_multisteps']:6.2f} "
            f"{r['trace_vs_multisteps']:7.2f} {r['lower_vs_multisteps']:7.2f} "
            f"{r['compile_vs_multisteps']:9.2f} {r['total_s']:6.2f} {r['adam_traces']:4d} "
            f"{r['equations']:6d} {r['fusions']:7d}"
        )
    missed = [n for n, r in report["results"].items() if not r["met"]]
    lines.append(
        f"x: wall-clock time against {BASELINE} in the same round (cpu x: process CPU time, "
        f"steadier on a shared machine); target <= {TARGET:g}: "
        + (f"MISSED by {len(missed)}" if missed else "met by every transform")
    )
    results = report["results"]
    for name, ref in LIKE_FOR_LIKE.items():
        if name in results and ref in results:
            ratio = results[name]["total_vs_multisteps"] / results[ref]["total_vs_multisteps"]
            lines.append(f"like for like: {name} / {ref.removeprefix('reference: ')}: {ratio:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    parser.add_argument("--leaves", type=int, default=LEAVES, help=f"default {LEAVES}")
    parser.add_argument(
        "--only", action="append", help="only the transforms whose name has this (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_time.json")
    parser.add_argument(
        "--passes", action="store_true", help="then list where XLA's compile time goes"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = [n for n in TRANSFORMS if any(part in n for part in args.only or [""])]
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {args.leaves} leaves, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    report = run(args.leaves, args.rounds, names)
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.passes:
        print(passes_table(args.leaves, names))


if __name__ == "__main__":
    main()
