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

All-reduces are counted in the compiled step's HLO: those every step runs, and those
only a releasing step runs (inside the compiled conditional). The section needs 8
devices (`python -m optax_accum.demo` simulates them on a CPU).
"""

from __future__ import annotations

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
from optax_accum.demo.hlo import count_collectives

REPLICAS = 8
FRESH_REQUIRED = 6  # of 8: two backup workers
ASYNC_WORKERS = 4

# --------------------------------------------------------------------------- training


def _mesh() -> Mesh:
    if jax.device_count() < REPLICAS:
        raise RuntimeError(
            f"the data_parallel section needs {REPLICAS} devices, JAX sees {jax.device_count()}"
        )
    devices = np.array(jax.devices()[:REPLICAS])
    return Mesh(devices, ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _replicated_step(
    tx: Any, model: Any, mesh: Mesh, params: Any, batch: int
) -> tuple[Callable, Any, tuple[int, int]]:
    """A jitted shard_map train step with replicated params.

    Returns `(step, state, (every, on_release))`: the compiled step, the initial state,
    and the all-reduces every step runs and those a releasing step adds.

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
    counts = count_collectives(compiled.as_text())
    every = counts["every_step"].get("all-reduce", 0)
    return compiled, state, (every, counts["when_taken"].get("all-reduce", 0))


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
    step, state, (every, on_release) = _replicated_step(tx, model, mesh, params, sizes.batch)
    rng = np.random.default_rng(sizes.seed)
    data = _data.batches(x, y, sizes.batch * n, sizes.seed)
    old = params
    curve = []
    start = time.perf_counter()
    for i in _data.progress(range(sizes.steps), f"data_parallel: {label}"):
        xb, yb = next(data)
        stale = np.zeros(n, bool)
        stale[rng.choice(n, size=stragglers, replace=False)] = True
        new, state = step(params, old, state, jnp.asarray(xb), jnp.asarray(yb), jnp.asarray(stale))
        old, params = params, new
        if _data.evaluate_now(i, sizes.steps):
            curve.append((i + 1, _data.accuracy(model, params, xt, yt)))
    updates = int(optax_accum.global_step(state)) if _has_step(state) else sizes.steps
    dropped = int(state.num_dropped) if hasattr(state, "num_dropped") else 0
    return Row(
        section="data_parallel",
        method=method,
        accuracy=curve[-1][1],
        updates=updates,
        dropped=dropped,
        all_reduces=sizes.steps * every + updates * on_release,
        seconds=time.perf_counter() - start,
        curve=curve,
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
    curve = []
    start = time.perf_counter()
    label = "async, no dropping" if staleness is None else f"async, staleness {staleness}"
    for i in _data.progress(range(sizes.steps), f"data_parallel: {label}"):
        w = int(rng.integers(ASYNC_WORKERS))  # the worker that finishes next
        snapshot, read_at = workers[w]
        xb, yb = next(data)
        params, state = apply(
            params, state, snapshot, jnp.asarray(xb), jnp.asarray(yb), read_at, limit
        )
        workers[w] = (params, int(optax_accum.global_step(state)))
        if _data.evaluate_now(i, sizes.steps):
            curve.append((i + 1, _data.accuracy(model, params, xt, yt)))
    method = (
        f"async, {ASYNC_WORKERS} workers, adam, no dropping"
        if staleness is None
        else f"async, {ASYNC_WORKERS} workers, drop_stale_gradients(adam, {staleness})"
    )
    return Row(
        section="data_parallel",
        method=method,
        accuracy=curve[-1][1],
        updates=int(optax_accum.global_step(state)),
        dropped=int(state.num_dropped),
        seconds=time.perf_counter() - start,
        curve=curve,
    )


def run(sizes: Sizes) -> list[Row]:
    with jax.numpy_dtype_promotion("standard"):  # optax.adam computes float ** int32
        apply = _async_step(_data.init_mlp(sizes.seed)[0])
        sync = optax_accum.cross_shard_optimizer(optax.adam(3e-3), "data", pack=True)
        backup = optax_accum.conditional_accumulator(
            optax.adam(3e-3), num_required=FRESH_REQUIRED, axis_name="data"
        )
        stale = REPLICAS - FRESH_REQUIRED
        return [
            _train_replicated(
                sizes, sync, 0, "sync", f"sync, {REPLICAS} replicas, cross_shard_optimizer(adam)"
            ),
            _train_replicated(
                sizes,
                backup,
                stale,
                "backup workers",
                f"{stale} of {REPLICAS} stale, conditional_accumulator(adam, {FRESH_REQUIRED})",
            ),
            _train_async(sizes, 2, apply),
            _train_async(sizes, None, apply),
        ]
