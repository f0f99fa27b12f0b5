"""The programs that tests/test_multihost.py runs on 2 processes x 4 devices.

`program()` trains on whatever devices `jax.devices()` lists (all processes' devices
under `jax.distributed`): data-parallel runs on a 1-D mesh axis "i", and an FSDP run
under `jax.jit` with explicit sharding on a (data=2, fsdp=4) mesh (`train_fsdp`). It
returns every result as NumPy arrays on every process, and the shapes of the FSDP
state's shards that this process holds. Run as a script, it joins a 2-process
`jax.distributed` job on 127.0.0.1 with gloo CPU collectives and writes both to an
.npz file (the shard shapes under keys starting with "shards "):

    python tests/multihost_worker.py PROCESS_ID PORT OUT.npz

The test runs the same `program()` in its own process on 8 devices and compares.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _cases import adam, lenient
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

GROUPS = [[0, 3, 5, 6], [1, 2, 4, 7]]
STEPS = 4
PER_REPLICA = 4  # examples per replica per step
FSDP_LAGS = (0, 0, 1, 0, 3, 0)  # how stale each FSDP step's gradient is
FSDP_SPECS = {"w": P("fsdp", None), "v": P("fsdp", "data"), "b": P()}


def _global(mesh: Mesh, data: np.ndarray, spec: P) -> jax.Array:
    """A global array from the same host data on every process (each keeps its shards)."""
    return jax.make_array_from_callback(data.shape, NamedSharding(mesh, spec), lambda i: data[i])


def _to_numpy(tree: Any) -> Any:
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def _linear_loss(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _data(seed: int, n: int, d_in: int, d_out: int, classes: bool = False):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(STEPS, n, d_in)).astype(np.float32)
    if classes:
        return xs, rng.integers(0, d_out, size=(STEPS, n)).astype(np.int32)
    return xs, rng.normal(size=(STEPS, n, d_out)).astype(np.float32)


def train_replicated(
    mesh: Mesh, tx: Any, loss: Callable, params: Any, xs: np.ndarray, ys: np.ndarray, lags=None
) -> Any:
    """Replicated params; the state's specs come from `state_partition_specs`.

    Each replica differentiates with respect to its own (varying) copy of the params,
    so `update` sees the replica's own gradient. `lags[t, r]` tags replica r's
    gradient at step t with `global_step - lag`.
    """
    tagged = lags is not None
    lags = np.zeros((len(xs), mesh.shape["i"]), np.int32) if lags is None else lags
    specs = optax_accum.state_partition_specs(tx, params, mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def body(params, state, x, y, lag):
        mine = jax.lax.pcast(params, "i", to="varying")
        grads = jax.grad(loss)(mine, x, y)
        extra = {"local_step": optax_accum.global_step(state) - lag[0]} if tagged else {}
        updates, state = tx.update(grads, state, mine, **extra)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), specs, P("i"), P("i"), P("i")),
            out_specs=(P(), specs),
        )
    )
    params = jax.tree.map(lambda a: _global(mesh, np.asarray(a), P()), params)
    for x, y, lag in zip(xs, ys, lags, strict=True):
        params, state = step(
            params,
            state,
            _global(mesh, x, P("i")),
            _global(mesh, y, P("i")),
            _global(mesh, lag, P("i")),
        )
    return params, state


def train_per_replica(mesh: Mesh, tx: Any, loss: Callable, params: Any, xs, ys) -> Any:
    """Params and state stacked per replica (P("i")): for groups, whose params differ."""
    n = mesh.shape["i"]

    def first(t):
        return jax.tree.map(lambda a: a[0], t)

    def add(t):
        return jax.tree.map(lambda a: a[None], t)

    def body(params, state, x, y):
        p = first(params)
        updates, state = tx.update(jax.grad(loss)(p, x, y), first(state), p)
        return add(optax.apply_updates(p, updates)), add(state)

    spec = P("i")
    init = jax.jit(
        jax.shard_map(lambda p: add(tx.init(first(p))), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    params = jax.tree.map(lambda a: _global(mesh, np.stack([np.asarray(a)] * n), spec), params)
    state = init(params)
    for x, y in zip(xs, ys, strict=True):
        params, state = step(params, state, _global(mesh, x, spec), _global(mesh, y, spec))
    return params, state


def _fsdp_tx() -> Any:
    """Stale steps dropped whole (lag > 1), late ones (lag 1) by the accumulator."""
    return optax_accum.drop_stale_gradients(
        optax_accum.conditional_accumulator(lenient(optax.adam(0.05)), 2), 1
    )


def _fsdp_data() -> tuple[dict, list]:
    rng = np.random.default_rng(2)
    params = {
        "w": rng.normal(size=(16, 8)) / 4,
        "v": rng.normal(size=(8, 4)) / 3,
        "b": rng.normal(size=(4,)),
    }
    batches = [(rng.normal(size=(8, 16)), rng.normal(size=(8, 4))) for _ in FSDP_LAGS]
    return params, batches


def train_fsdp(mesh: Mesh | None) -> tuple[Any, Any]:
    """`len(FSDP_LAGS)` float64 steps of `_fsdp_tx()` under `jax.jit`; returns the
    params and the state (global arrays on `mesh`, or on one device without one).

    On `mesh` (explicit axes "data" and "fsdp"), each weight is split over `fsdp` (`v`
    in 2-D, also over `data`), the bias replicated, the batch split over `data`;
    every array is built from the same host data on every process, each process
    keeping its own shards. The weights are all-gathered before use by name
    (`jax.sharding.reshard`), as explicit sharding asks.
    """
    tx = _fsdp_tx()
    params, batches = _fsdp_data()
    if mesh is None:
        place = lambda data, spec: jnp.asarray(data)  # noqa: E731
        gather = lambda w: w  # noqa: E731
    else:
        place = functools.partial(_global, mesh)
        gather = lambda w: jax.sharding.reshard(w, P())  # noqa: E731

    def loss(params, x, y):
        h = jnp.tanh(x @ gather(params["w"]))
        return jnp.mean((h @ gather(params["v"]) + params["b"] - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x, y, lag):
        grads = jax.grad(loss)(params, x, y)
        local_step = optax_accum.global_step(state) - lag
        updates, state = tx.update(grads, state, params, local_step=local_step)
        return optax.apply_updates(params, updates), state

    context = contextlib.nullcontext() if mesh is None else _compat.mesh_context(mesh)
    with context:
        params = {k: place(v, FSDP_SPECS[k]) for k, v in params.items()}
        state = jax.jit(tx.init)(params)  # explicit sharding: laid out like the params
        for (x, y), lag in zip(batches, FSDP_LAGS, strict=True):
            data = P("data")
            lag = place(np.asarray(lag, np.int32), P())
            params, state = step(params, state, place(x, data), place(y, data), lag)
    return params, state


def shard_shapes(tree: Any) -> dict[str, np.ndarray]:
    """For each leaf, the shapes of the shards this process holds (one row each)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        jax.tree_util.keystr(path): np.array([s.data.shape for s in leaf.addressable_shards])
        for path, leaf in flat
    }


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


def program() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every training run of the multi-host test, over all devices: the results (the
    same on every process) and the FSDP params' and state's local shard shapes."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    n = len(devices)
    linear = {"w": np.zeros((5, 2), np.float32), "b": np.zeros(2, np.float32)}
    xs, ys = _data(0, n * PER_REPLICA, 5, 2)
    results = {}

    tx = optax_accum.cross_shard_optimizer(optax.sgd(0.1, momentum=0.9), "i")
    params, _ = train_replicated(mesh, tx, _linear_loss, linear, xs, ys)
    results["cross_shard"] = params

    tx = optax_accum.cross_shard_optimizer(optax.sgd(0.1), "i", group_assignment=GROUPS)
    params, _ = train_per_replica(mesh, tx, _linear_loss, linear, xs, ys)
    results["cross_shard_groups"] = params

    tx = optax_accum.conditional_accumulator(adam(0.05), num_required=n + 2, axis_name="i")
    lags = np.zeros((STEPS, n), np.int32)
    lags[1, -2:] = 1  # two stragglers a step behind: their gradients are dropped
    lags[3, 0] = 1
    params, state = train_replicated(mesh, tx, _linear_loss, linear, xs, ys, lags)
    results["accumulator"] = params
    results["accumulator_counters"] = {
        "global_step": state.global_step,
        "count": state.count,
        "num_dropped": state.num_dropped,
    }

    model = MLP()
    # One compiled init, not one small compile per initializer op (a dozen and more, in
    # every process): the same init in both processes and in the test's.
    mlp = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 6), np.float32))["params"]
    cx, cy = _data(1, n * PER_REPLICA, 6, 3, classes=True)

    def mlp_loss(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = optax_accum.cross_shard_optimizer(adam(0.05), "i", pack=True)
    params, _ = train_replicated(mesh, tx, mlp_loss, mlp, cx, cy)
    results["flax_mlp"] = params

    explicit = (jax.sharding.AxisType.Explicit,) * 2  # by name: jax 0.8's default is Auto
    fsdp_mesh = jax.make_mesh((2, n // 2), ("data", "fsdp"), axis_types=explicit)
    with _compat.enable_x64():
        params, state = train_fsdp(fsdp_mesh)
        layout = shard_shapes({"params": params, "state": state})
        results["fsdp"] = {"params": params, "state": state}
        flat, _ = jax.tree_util.tree_flatten_with_path(_to_numpy(results))
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}, layout


def main(argv: list[str]) -> None:
    process_id, port, out = int(argv[1]), int(argv[2]), argv[3]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == 2 and len(jax.local_devices()) == 4, jax.devices()
    results, layout = program()
    np.savez(out, **results, **{f"shards {k}": v for k, v in layout.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
