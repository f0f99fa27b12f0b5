"""Demo section: data-parallel training on 8 devices, backup workers, async-style training.

1. Synchronous data parallelism: 8 replicas (8 simulated CPU devices, `jax.shard_map`)
   each differentiate on their own batch; `cross_shard_optimizer` averages the
   gradients (one packed all-reduce per step) before Adam.
2. Backup workers: each step, two random replicas are stragglers whose gradients were
   computed at the previous step's parameters and are tagged with that step. The
   shared `conditional_accumulator(axis_name=...)` drops them and releases once 6
   fresh gradients have arrived, TF's SyncReplicasOptimizer-style backup workers.
3. Asynchronous-style training on one device: 4 simulated workers each compute a
   gradient at the parameters they last read and apply it when they finish, in random
   order, so gradients arrive 0 to several steps stale. `drop_stale_gradients` drops
   those more than 2 steps stale; the same run without dropping is the baseline.

Collectives are counted in the compiled step's HLO (`count_collectives`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import Row, Sizes, _data

REPLICAS = 8
FRESH_REQUIRED = 6  # of 8: two backup workers
ASYNC_WORKERS = 4

# --------------------------------------------------------------------------- HLO collectives

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_INSTRUCTION = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[su]8|[su]16|[su]32|[su]64|bf16|f16|f32|f64)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_GATED = re.compile(r"(?:branch_computations=\{(?P<branches>[^}]*)\}|body=%?(?P<body>[\w.\-]+))")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?(?P<callee>[\w.\-]+)")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collective ops in a compiled module's HLO text, and the bytes they produce.

    Returns `{"every_step": {...}, "when_taken": {...}}`, each mapping an op name
    (e.g. "all-reduce") to its count and `"<op> bytes"` to the summed size of its
    outputs (the payload per device: an all-reduce's reduced array, a permute's
    received array). "every_step" counts ops outside any `conditional` branch or
    `while` body; "when_taken" counts those inside (for a `conditional`, its largest
    branch): the extra collectives of a step that takes the branch (e.g. a release or
    sync step).
    """
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group("name")
            comps[current] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[current]
        elif current is not None:
            comps[current].append(line)

    def walk(name: str) -> tuple[dict, dict]:
        always: dict[str, int] = {}
        gated: dict[str, int] = {}

        def add(into: dict, other: dict) -> None:
            for k, v in other.items():
                into[k] = into.get(k, 0) + v

        for line in comps.get(name, []):
            match = _INSTRUCTION.search(line)
            if match:
                add(always, {match["op"]: 1, f"{match['op']} bytes": _bytes(match["shape"])})
            for callee in _CALLS.findall(line):
                a, g = walk(callee)
                add(always, a)
                add(gated, g)
            gate = _GATED.search(line)
            if gate:
                names = gate["branches"] or gate["body"]
                regions = [walk(n.strip().lstrip("%")) for n in names.split(",")]
                totals = []
                for a, g in regions:
                    both = dict(a)
                    add(both, g)
                    totals.append(both)
                add(gated, max(totals, key=lambda t: sum(t.values())))
        return always, gated

    always, gated = walk("__entry__")
    return {"every_step": always, "when_taken": gated}


def format_bytes(n: int) -> str:
    """Bytes as "12 B" or "19.2 kB"."""
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB"


def describe(counts: dict[str, dict[str, int]]) -> str:
    """A short text: "1 all-reduce (12 B); +1 all-reduce (19.2 kB) when taken"."""

    def part(c: dict[str, int]) -> str:
        ops = [op for op in _OPS if c.get(op)]
        return ", ".join(f"{c[op]} {op} ({format_bytes(c[op + ' bytes'])})" for op in ops) or "none"

    every, taken = part(counts["every_step"]), part(counts["when_taken"])
    return every if taken == "none" else f"{every}; +{taken} when taken"


# --------------------------------------------------------------------------- training


def _mesh() -> Mesh:
    n = min(REPLICAS, len(jax.devices()))
    return Mesh(np.array(jax.devices()[:n]), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _replicated_step(
    tx: Any, model: Any, mesh: Mesh, params: Any, batch: int
) -> tuple[Callable, Any, str]:
    """A jitted shard_map train step with replicated params; returns (step, state, collectives).

    `step(params, old_params, state, x, y, stale)`: each replica differentiates at its
    own copy of `params` (or `old_params` where `stale`, tagged a step behind).
    """
    specs = optax_accum.state_partition_specs(tx, params, mesh, local_step=0)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    loss = lambda p, x, y: _data.loss_fn(model, p, x, y)  # noqa: E731

    def body(params, old_params, state, x, y, stale):
        late = stale[0]
        # Each replica differentiates its own (varying) copy, so `update` sees the
        # replica's gradient, not the sum over replicas that jax.grad of replicated
        # params gives under shard_map.
        mine = jax.lax.pcast((params, old_params), "data", to="varying")
        seen = jax.tree.map(lambda new, old: jnp.where(late, old, new), *mine)
        grads = jax.grad(loss)(seen, x, y)
        step = optax_accum.global_step(state) - late.astype(jnp.int32) if _has_step(state) else None
        extra = {} if step is None else {"local_step": step}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    spmd = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), specs, P("data"), P("data"), P("data")),
        out_specs=(P(), specs),
    )
    step = jax.jit(spmd, donate_argnums=(2,))
    n = mesh.shape["data"]
    x, y = jnp.zeros((n * batch, 64)), jnp.zeros(n * batch, jnp.int32)
    compiled = step.lower(params, params, state, x, y, jnp.zeros(n, bool)).compile()
    return compiled, state, describe(count_collectives(compiled.as_text()))


def _has_step(state: Any) -> bool:
    try:
        optax_accum.global_step(state)
    except ValueError:
        return False
    return True


def _train_replicated(sizes: Sizes, tx: Any, stragglers: int, label: str, method: str) -> Row:
    x, y, xt, yt = _data.digits(sizes.seed)
    model, params = _data.init_mlp(sizes.seed)
    mesh = _mesh()
    n = mesh.shape["data"]
    params = jax.device_put(params, NamedSharding(mesh, P()))  # as the step returns them
    step, state, collectives = _replicated_step(tx, model, mesh, params, sizes.batch)
    rng = np.random.default_rng(sizes.seed)
    data = _data.batches(x, y, sizes.batch * n, sizes.seed)
    old = params
    start = time.perf_counter()
    for _ in _data.progress(range(sizes.steps), f"data_parallel: {label}"):
        xb, yb = next(data)
        stale = np.zeros(n, bool)
        stale[rng.choice(n, size=min(stragglers, n), replace=False)] = stragglers > 0
        new, state = step(params, old, state, jnp.asarray(xb), jnp.asarray(yb), jnp.asarray(stale))
        old, params = params, new
    steps = int(optax_accum.global_step(state)) if _has_step(state) else sizes.steps
    dropped = int(state.num_dropped) if hasattr(state, "num_dropped") else 0
    return Row(
        section="data_parallel",
        method=method,
        accuracy=_data.accuracy(model, params, xt, yt),
        updates=steps,
        dropped=dropped,
        collectives=collectives,
        seconds=time.perf_counter() - start,
    )


def _async_step(model: Any) -> Callable:
    """One jitted apply for every async run: `staleness` is a traced argument."""
    grad_fn = jax.grad(lambda p, xb, yb: _data.loss_fn(model, p, xb, yb))

    @jax.jit
    def apply(params, state, snapshot, xb, yb, local_step, staleness):
        tx = optax_accum.drop_stale_gradients(optax.adam(3e-3), staleness)
        updates, state = tx.update(grad_fn(snapshot, xb, yb), state, params, local_step=local_step)
        return optax.apply_updates(params, updates), state

    return apply


def _train_async(sizes: Sizes, staleness: int | None, apply: Callable) -> Row:
    """4 workers read the params, compute, and apply in random order (one device)."""
    x, y, xt, yt = _data.digits(sizes.seed)
    model, params = _data.init_mlp(sizes.seed)
    limit = jnp.int32(np.iinfo(np.int32).max if staleness is None else staleness)
    state = optax_accum.drop_stale_gradients(optax.adam(3e-3), limit).init(params)
    rng = np.random.default_rng(sizes.seed)
    data = _data.batches(x, y, sizes.batch, sizes.seed)
    workers = [(params, 0)] * ASYNC_WORKERS  # (params read, global step at the read)
    start = time.perf_counter()
    label = "async, no dropping" if staleness is None else f"async, staleness {staleness}"
    for _ in _data.progress(range(sizes.steps), f"data_parallel: {label}"):
        w = int(rng.integers(ASYNC_WORKERS))  # the worker that finishes next
        snapshot, read_at = workers[w]
        xb, yb = next(data)
        params, state = apply(
            params, state, snapshot, jnp.asarray(xb), jnp.asarray(yb), read_at, limit
        )
        workers[w] = (params, int(optax_accum.global_step(state)))
    method = (
        f"async, {ASYNC_WORKERS} workers, no dropping"
        if staleness is None
        else f"async, {ASYNC_WORKERS} workers, drop_stale_gradients(adam, {staleness})"
    )
    return Row(
        section="data_parallel",
        method=method,
        accuracy=_data.accuracy(model, params, xt, yt),
        updates=int(optax_accum.global_step(state)),
        dropped=int(state.num_dropped),
        collectives="none (1 device)",
        seconds=time.perf_counter() - start,
    )


def run(sizes: Sizes) -> list[Row]:
    with jax.numpy_dtype_promotion("standard"):  # optax.adam computes float ** int32
        n = _mesh().shape["data"]
        apply = _async_step(_data.init_mlp(sizes.seed)[0])
        sync = optax_accum.cross_shard_optimizer(optax.adam(3e-3), "data", pack=True)
        backup = optax_accum.conditional_accumulator(
            optax.adam(3e-3), num_required=max(1, n - 2), axis_name="data"
        )
        return [
            _train_replicated(
                sizes, sync, 0, "sync", f"sync, {n} replicas, cross_shard_optimizer(adam, pack)"
            ),
            _train_replicated(
                sizes,
                backup,
                2,
                "backup workers",
                f"backup workers: {n} replicas, 2 stale, conditional_accumulator({n - 2} fresh)",
            ),
            _train_async(sizes, 2, apply),
            _train_async(sizes, None, apply),
        ]
