"""How many collectives does a step issue, and how many bytes do they carry?

On 8 host devices (`jax.shard_map`), for a 200-leaf gradient tree (float32), this
compiles one update step per variant and reads the compiled HLO: the number of
all-reduce and collective-permute ops, and the bytes of their outputs (the payload
per device). Variants:

- `cross_shard` per leaf, with `pack=True` (one buffer), with
  `communication_dtype=bfloat16`, and both;
- replica groups on a 1-D axis (shard_map has no `axis_index_groups`, so the exact
  replacement: collective permutes or a one-hot all-reduce) and on the 2-D mesh from
  `replica_group_mesh` (plain all-reduces over the inner axis);
- `conditional_accumulator(axis_name=...)` and `agn(axis_name=...)`: collectives on
  every step, and the extra ones on a releasing / synchronising step only (the ops
  inside the compiled conditional or loop).

It also times each `cross_shard` variant (median of interleaved rounds after a
warm-up) against the per-leaf float32 step. On simulated CPU devices the collectives
are memory copies, so the times say little about a real interconnect; the op counts
and bytes are what carries over.

Both the program as JAX emits it (pre-optimisation HLO: what a TPU or GPU backend
starts from) and as XLA compiled it for this CPU are counted. XLA's CPU compiler
combines the per-leaf all-reduces into one and runs bfloat16 all-reduces in float32,
so the "emitted" columns are the ones that show what `pack` and
`communication_dtype` change on the wire.

Run: `python benchmarks/collectives.py` (2-5 minutes on 2 busy cores; compiling the
600-permute variant dominates). Prints a table and writes
`benchmarks/results/collectives.json`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo.hlo import count_collectives, format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
LEAVES = 200
GROUPS_2x4 = [[0, 3, 5, 6], [1, 2, 4, 7]]
GROUPS_4x2 = [[0, 4], [1, 5], [2, 6], [3, 7]]


def tree(n: int = LEAVES) -> dict[str, jax.Array]:
    """200 float32 leaves of assorted small shapes (a deep model's many biases and kernels)."""
    return {
        f"leaf{i:03d}": jnp.zeros((8 + 8 * (i % 5), 16 + 16 * (i % 3)), jnp.float32)
        for i in range(n)
    }


def _mesh_1d(devices: list) -> Mesh:
    return Mesh(np.array(devices[:8]), ("i",), axis_types=(jax.sharding.AxisType.Auto,))


def _cross_shard_step(tx: Any, mesh: Mesh, axes: Any, grads: Any):
    """(lowered, compiled, argument) for a shard_map step of `tx.update` per replica."""
    spec = P(axes)
    n = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))

    def body(g):
        out = tx.update(jax.tree.map(lambda x: x[0], g), tx.init(g))[0]
        return jax.tree.map(lambda x: x[None], out)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    stacked = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), grads)
    stacked = jax.device_put(stacked, NamedSharding(mesh, spec))
    lowered = fn.lower(stacked)
    return lowered, lowered.compile(), stacked


def _stateful_step(tx: Any, mesh: Mesh, params: Any, param_axes: tuple = ()):
    """The compiled HLO of a shard_map train step of a stateful transform."""
    specs = optax_accum.state_partition_specs(tx, params, mesh, param_axes=param_axes)
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs), params)
    p_spec = P("i") if param_axes else P()

    def body(p, s, g):
        p = jax.tree.map(lambda x: x[0], p) if param_axes else p
        g = jax.tree.map(lambda x: x[0], g)
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        return (jax.tree.map(lambda x: x[None], new) if param_axes else new), s

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(p_spec, specs, P("i")), out_specs=(p_spec, specs))
    )
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8, *x.shape), x.dtype), params)
    p_in = stacked if param_axes else jax.eval_shape(lambda t: t, params)
    lowered = fn.lower(p_in, state, stacked)
    return lowered, lowered.compile()


def _time(fns: dict[str, tuple[Any, Any]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each compiled fn, from interleaved rounds."""
    for fn, arg in fns.values():  # warm-up
        jax.block_until_ready(fn(arg))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, (fn, arg) in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(arg)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def _summary(lowered: Any, compiled: Any) -> dict[str, dict[str, int]]:
    """Collective counts of the program as JAX emits it, and as XLA compiled it here."""
    return {
        "emitted": count_collectives(lowered.as_text(dialect="hlo")),
        "compiled_cpu": count_collectives(compiled.as_text()),
    }


def _cells(counts: dict[str, dict[str, int]]) -> list[str]:
    every, taken = counts["every_step"], counts["when_taken"]
    ar, cp = "all-reduce", "collective-permute"
    cells = [
        f"{every.get(ar, 0)} AR {format_bytes(every.get(ar + ' bytes', 0))}",
        f"{every.get(cp, 0)} CP {format_bytes(every.get(cp + ' bytes', 0))}"
        if every.get(cp)
        else "-",
    ]
    extra = taken.get(ar, 0) + taken.get(cp, 0)
    extra_bytes = taken.get(ar + " bytes", 0) + taken.get(cp + " bytes", 0)
    cells.append(f"+{extra} ({format_bytes(extra_bytes)})" if extra else "-")
    return cells


def eight_devices() -> list:
    """8 devices: the default backend's, else (one GPU, say) the simulated CPU ones."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= 8:
            return devices[:8]
    raise SystemExit(f"needs 8 devices, found {len(jax.devices())} (set XLA_FLAGS)")


def run(leaves: int = LEAVES, rounds: int = 15, calls: int = 5, devices: Any = None) -> dict:
    """Every figure: per variant, the collectives emitted and compiled, and the times."""
    devices = devices or eight_devices()
    grads = tree(leaves)
    payload = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(grads))
    mesh = _mesh_1d(devices)
    group_mesh = optax_accum.replica_group_mesh(GROUPS_2x4, devices=devices)
    bf16 = jnp.bfloat16
    # name -> (axis_name, cross_shard options); "replica" is the inner axis of the
    # replica_group_mesh, reduced under a shard_map over both of its axes.
    variants = {
        "per leaf, float32": ("i", {}),
        "pack": ("i", {"pack": True}),
        "bfloat16 wire": ("i", {"communication_dtype": bf16}),
        "bfloat16 wire + pack": ("i", {"communication_dtype": bf16, "pack": True}),
        "groups 2x4, 1-D axis": ("i", {"group_assignment": GROUPS_2x4}),
        "groups 2x4, 1-D axis + pack": ("i", {"group_assignment": GROUPS_2x4, "pack": True}),
        "groups 4x2, 1-D axis + pack": ("i", {"group_assignment": GROUPS_4x2, "pack": True}),
        "groups 2x4, replica_group_mesh": ("replica", {}),
        "groups 2x4, replica_group_mesh + pack": ("replica", {"pack": True}),
    }
    rows: dict[str, dict[str, Any]] = {}
    compiled: dict[str, tuple[Any, Any]] = {}
    for name, (axis, options) in variants.items():
        tx = optax_accum.cross_shard(axis, **options)
        m, axes = (group_mesh, ("group", "replica")) if axis == "replica" else (mesh, "i")
        lowered, fn, arg = _cross_shard_step(tx, m, axes, grads)
        rows[name] = _summary(lowered, fn)
        compiled[name] = (fn, arg)
    times = _time(compiled, rounds, calls)
    base = times["per leaf, float32"]
    for name, row in rows.items():
        row["seconds"] = times[name]
        row["time_vs_per_leaf"] = times[name] / base

    stateful = {
        "conditional_accumulator(sgd, 8, axis_name)": _stateful_step(
            optax_accum.conditional_accumulator(optax.sgd(0.1), 8, axis_name="i"), mesh, grads
        ),
        "agn(sgd, 4, axis_name)": _stateful_step(
            optax_accum.agn(optax.sgd(0.1), 4, axis_name="i"), mesh, grads, param_axes=("i",)
        ),
    }
    for name, (lowered, fn) in stateful.items():
        rows[name] = _summary(lowered, fn)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, 8 {devices[0].platform} devices",
        "jax": jax.__version__,
        "leaves": leaves,
        "payload_bytes_per_replica": payload,
        "rows": rows,
    }


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks`: per variant, the all-reduces and bytes
    JAX emits on every step and on a release, and the time against per-leaf float32."""
    from benchmarks._report import Row

    out = run(4, 1, 1) if scale.quick else run()
    rows = []
    for name, r in out["rows"].items():
        every, taken = r["emitted"]["every_step"], r["emitted"]["when_taken"]
        ops = sum(every.get(k, 0) for k in ("all-reduce", "collective-permute"))
        nbytes = sum(every.get(f"{k} bytes", 0) for k in ("all-reduce", "collective-permute"))
        rows.append(Row("collectives", name, "collectives emitted per step", ops, "ops"))
        rows.append(Row("collectives", name, "bytes emitted per step", nbytes / 1e3, "kB"))
        extra = sum(taken.get(k, 0) for k in ("all-reduce", "collective-permute"))
        if extra:
            rows.append(Row("collectives", name, "more on a release / sync", extra, "ops"))
        if "time_vs_per_leaf" in r:
            rows.append(Row("collectives", name, "time / per leaf float32", r["time_vs_per_leaf"]))
    return rows, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--calls", type=int, default=5, help="calls per round")
    args = parser.parse_args()
    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices, found {len(jax.devices())} (set XLA_FLAGS)")
    out = run(LEAVES, args.rounds, args.calls, jax.devices())
    rows, payload = out["rows"], out["payload_bytes_per_replica"]

    head = (
        "variant",
        "emitted: all-reduce",
        "permutes",
        "release/sync",
        "compiled (CPU): all-reduce",
        "permutes",
        "release/sync",
        "time",
    )
    body = [
        (
            name,
            *_cells(r["emitted"]),
            *_cells(r["compiled_cpu"]),
            f"{r['time_vs_per_leaf']:.2f}x" if "time_vs_per_leaf" in r else "-",
        )
        for name, r in rows.items()
    ]
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    print(f"{LEAVES} float32 leaves, {format_bytes(payload)} per replica, 8 devices")
    print(fmt(head))
    print("  ".join("-" * w for w in widths))
    for line in body:
        print(fmt(line))

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "collectives.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'collectives.json'}")


if __name__ == "__main__":
    main()
