"""Demo section: AGN (local SGD) against synchronous data-parallel SGD.

Eight workers each train on their own shard of digits and see the same examples in
every method. Synchronous SGD (`cross_shard_optimizer`) all-reduces gradients every
step; `agn` all-reduces once per `communication_period` steps: as TF does it, with the
outer learning rate scaled by the period, with DiLoCo's delta commit, and as Streaming
DiLoCo (a layer at a time, reduced a step late, in int8 on the wire). The table
reports the centre's final test accuracy and the number of syncs; the plot also shows
the bytes the syncs moved. The workers run on 8 devices with `jax.shard_map` when
there are 8, else under `jax.vmap`. `benchmarks/agn.py` runs `study` with more
methods, steps and seeds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import Row, Sizes, _data

WORKERS = 8
LEARNING_RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to train the eight workers.

    `make(axis_name)` builds the transform; `model(params, state)` is the model the
    method evaluates (the centre for AGN); `synced(state)` tells whether the last step
    synced; `wire(params)` gives the bytes each sync sends, in the order the syncs
    come (they cycle): default, the whole model in float32.
    """

    name: str
    make: Callable[[str], optax.GradientTransformationExtraArgs]
    model: Callable[[Any, Any], Any] = lambda params, state: state.centre
    synced: Callable[[Any], jax.Array] = optax_accum.has_updated
    wire: Callable[[Any], tuple[int, ...]] = lambda params: (_nbytes(jax.tree.leaves(params)),)


def _nbytes(leaves: list, dtype: Any = None) -> int:
    """Bytes a worker's sync of `leaves` sends in `dtype` (None or float32: their own),
    laid out as `agn`'s `communication_dtype` lays them out: each leaf in blocks of 256
    values, the blocks shared evenly between the workers (padded), int8 and float8 with
    a float32 scale per block, bfloat16 without."""
    if dtype is None or np.dtype(dtype).itemsize == 4:
        return sum(int(np.asarray(x).nbytes) for x in leaves)
    blocks = sum(math.ceil(np.size(x) / 256) for x in leaves)
    blocks = math.ceil(blocks / WORKERS) * WORKERS
    return blocks * (2 * 256 if np.dtype(dtype).itemsize == 2 else 256 + 4)


def by_layer(path: Any) -> int:
    """The fragment of a param of the demo's MLP: its layer's number."""
    return int(str(path[0].key).rsplit("_", 1)[-1])


def streaming(lr: float = LEARNING_RATE, dtype: Any = jnp.int8, period: int = 4) -> Method:
    """Streaming DiLoCo: DiLoCo's outer step, one fragment a layer (two), each synced
    every `period` steps, one of them every `period / 2` steps, reduced in the step
    after its sync step (`delay=1`, so the reduction does not wait for that step's
    gradient) and sent in `dtype`."""

    def wire(params: Any) -> tuple[int, ...]:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        return tuple(_nbytes([x for p, x in flat if by_layer(p) == f], dtype) for f in (0, 1))

    return Method(
        f"streaming DiLoCo, 2 layers, delay 1, {np.dtype(dtype).name}",
        lambda axis: optax_accum.agn(
            optax.sgd(lr),
            period,
            axis_name=axis,
            commit="delta",
            outer=optax.sgd(0.7 * period, momentum=0.9, nesterov=True),
            fragments=by_layer,
            delay=1,
            communication_dtype=dtype,
        ),
        wire=wire,
    )


def methods(lr: float = LEARNING_RATE) -> list[Method]:
    """Synchronous SGD, then AGN with period 4: TF's rule, a scaled outer step, DiLoCo,
    and Streaming DiLoCo in int8."""
    sync = Method(
        "sync SGD, cross_shard_optimizer(sgd)",
        lambda axis: optax_accum.cross_shard_optimizer(optax.sgd(lr), axis),
        model=lambda params, state: params,
        synced=lambda state: jnp.asarray(True),
    )
    return [
        sync,
        Method(
            "agn(sgd, 4), TF: outer = inner",
            lambda axis: optax_accum.agn(optax.sgd(lr), 4, axis_name=axis),
        ),
        Method(
            "agn(sgd, 4), outer sgd(4 * lr)",
            lambda axis: optax_accum.agn(optax.sgd(lr), 4, axis_name=axis, outer=optax.sgd(4 * lr)),
        ),
        Method(
            "agn(sgd, 4), delta commit, DiLoCo outer",
            lambda axis: optax_accum.agn(
                optax.sgd(lr),
                4,
                axis_name=axis,
                commit="delta",
                outer=optax.sgd(0.7 * 4, momentum=0.9, nesterov=True),
            ),
        ),
        streaming(lr),
    ]


@dataclasses.dataclass
class Result:
    """One method's outcome: final accuracy, communication, and the accuracy curve.

    `curve[i]` is the centre's test accuracy after communication round `rounds[i]`,
    which ended at local step `steps[i]`, when the syncs had sent `moved[i]` bytes
    (each worker's payload, summed over the syncs).
    """

    method: str
    accuracy: float
    loss: float
    all_reduces: int
    bytes: int
    rounds: list[int]
    steps: list[int]
    curve: list[float]
    seconds: float
    moved: list[int] = dataclasses.field(default_factory=list)


def _worker_fn(method: Method, model: Any, x_test: Any, y_test: Any) -> Callable:
    """One worker's whole training run, as a function of its shard and batch indices."""
    tx = method.make("w")
    grad_fn = jax.grad(lambda p, xb, yb: _data.loss_fn(model, p, xb, yb))

    def test_accuracy(params):
        logits = model.apply({"params": params}, x_test)
        return (jnp.argmax(logits, -1) == y_test).mean(dtype=jnp.float32)

    def test_loss(params):
        return _data.loss_fn(model, params, x_test, y_test)

    def worker(params, xs, ys, idx):
        def body(carry, batch):
            params, state = carry
            updates, state = tx.update(grad_fn(params, xs[batch], ys[batch]), state, params)
            params = optax.apply_updates(params, updates)
            synced = method.synced(state)
            # Test accuracy on sync steps only (-1 elsewhere); cheap at digits' size.
            acc = jnp.where(synced, test_accuracy(method.model(params, state)), -1.0)
            return (params, state), (synced, acc)

        (params, state), (synced, curve) = jax.lax.scan(body, (params, tx.init(params)), idx)
        final = method.model(params, state)
        return synced, curve, test_accuracy(final), test_loss(final)

    return worker


def _spmd(worker: Callable) -> Callable:
    """Runs `worker` once per worker and returns worker 0's outputs.

    On 8 devices with `jax.shard_map` if there are 8, else under `jax.vmap`. The
    inputs after the first (the shared initial params) carry a leading worker axis.
    Every worker returns the same numbers (the centre, or synchronous SGD's params),
    so under shard_map `pmax` types the outputs replica-invariant without changing them.
    """
    if jax.device_count() < WORKERS:
        mapped = jax.vmap(worker, in_axes=(None, 0, 0, 0), axis_name="w")
        return jax.jit(lambda *args: jax.tree.map(lambda o: o[0], mapped(*args)))
    mesh = jax.make_mesh((WORKERS,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))

    def same_everywhere(o: jax.Array) -> jax.Array:
        if o.dtype == jnp.bool_:
            return jax.lax.pmax(o.astype(jnp.int32), "w").astype(jnp.bool_)
        return jax.lax.pmax(o, "w")

    def per_device(params, *data):
        mine = jax.lax.pcast(params, "w", to="varying")  # each worker's own copy
        return jax.tree.map(same_everywhere, worker(mine, *(d[0] for d in data)))

    return jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("w"), P("w"), P("w")), out_specs=P())
    )


def study(
    sizes: Sizes, selected: list[Method] | None = None, progress: bool = True
) -> list[Result]:
    """Trains every method for `sizes.steps` local steps of `sizes.batch` per worker.

    Each of the `WORKERS` workers holds its own shard of digits' training set; every
    method sees the same batches (drawn with `sizes.seed`, which also sets the split
    and the initial params), so only the method differs between runs.

    Args:
      sizes: local steps per worker, examples per worker step, and the seed.
      selected: the methods to train, in order; default: `methods()`.
      progress: show a progress bar over the methods.

    Returns:
      One `Result` per method, in the order given.
    """
    x, y, xt, yt = _data.digits(sizes.seed)
    n = len(x) // WORKERS
    xs = jnp.asarray(x[: n * WORKERS].reshape(WORKERS, n, -1))
    ys = jnp.asarray(y[: n * WORKERS].reshape(WORKERS, n))
    idx = np.random.default_rng(sizes.seed).integers(0, n, size=(WORKERS, sizes.steps, sizes.batch))
    idx = jnp.asarray(idx, jnp.int32)
    model, params = _data.init_mlp(sizes.seed)
    selected = methods() if selected is None else selected
    results = []
    iterator = _data.progress(selected, "agn study") if progress else selected
    for method in iterator:
        start = time.perf_counter()
        run = _spmd(_worker_fn(method, model, jnp.asarray(xt), jnp.asarray(yt)))
        synced, curve, accuracy, loss = jax.device_get(run(params, xs, ys, idx))
        synced, curve = np.asarray(synced), np.asarray(curve)
        rounds = np.cumsum(synced)
        per_sync = method.wire(params)
        moved = np.cumsum([per_sync[i % len(per_sync)] for i in range(int(rounds[-1]))])
        results.append(
            Result(
                method=method.name,
                accuracy=float(accuracy),
                loss=float(loss),
                all_reduces=int(rounds[-1]),
                bytes=int(moved[-1]) if len(moved) else 0,
                rounds=rounds[synced].tolist(),
                steps=(np.flatnonzero(synced) + 1).tolist(),
                curve=curve[synced].tolist(),
                seconds=time.perf_counter() - start,
                moved=moved.tolist(),
            )
        )
    return results


def run(sizes: Sizes) -> list[Row]:
    """The demo section: every method at the demo's size (whole rounds of 4 steps)."""
    steps = max(4, sizes.steps // 4 * 4)
    results = study(dataclasses.replace(sizes, steps=steps, batch=min(sizes.batch, 16)))
    return [
        Row(
            section="agn",
            method=r.method,
            accuracy=r.accuracy,
            updates=r.all_reduces,
            dropped=0,
            all_reduces=r.all_reduces,
            seconds=r.seconds,
            curve=list(zip(r.steps, r.curve, strict=True)),
            moved=list(zip(r.steps, r.moved, strict=True)),
        )
        for r in results
    ]
