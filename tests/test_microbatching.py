"""Micro-batches inside a step (optax.microbatching), windows across steps (ours).

A step's batch too large for one device's activations is split into micro-batches that
`optax.microbatching.microbatch` runs one after another inside the jitted step (a
`fori_loop`), averaging their gradients; `conditional_accumulator` then averages the
steps of a window, dropping stale ones by their step tag. With SGD, each released
update is then exactly the learning rate times the gradient of the window's full batch
(every accepted step's examples together): this is checked on a (data=2, fsdp=4) mesh
with FSDP-sharded params, under explicit and auto sharding, against a float64 NumPy
reference; and the micro-batched step keeps fewer temporaries per device than the
same step taking its whole batch at once.

Under explicit sharding, optax 0.2.8's `microbatch` compares version strings
(`jax.__version__ < "0.7.0"`, true for "0.10.2") and so reshapes the batch as on an old
jax, which explicit sharding rejects; run it under `jax.sharding.auto_axes`, as the
guide shows. `test_microbatch_called_directly_under_explicit_sharding` says when that
is no longer needed.

optax.microbatching is in recent optax (0.2.8 here), not in optax 0.2.5: this file is
left out of the oldest-versions run (tests/test_oldest_versions.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax import microbatching
from test_fsdp import DENSE_SPECS, _mesh, _x64  # noqa: F401 (_x64: the fixture)
from test_fsdp import _params as fsdp_params

import optax_accum
from optax_accum import _compat

LR = 0.5
NUM_REQUIRED = 2  # steps per window
BATCH = 16  # examples per step, split over `data`
MICRO = 4  # examples per micro-batch: 4 micro-batches per step
LAGS = (0, 0, 0, 1, 0, 0, 2, 0, 0)  # a step tagged behind the accumulator is dropped
SPECS = DENSE_SPECS


def _params() -> dict:
    return fsdp_params("dense")


def _batches() -> list:
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(BATCH, 16)), rng.normal(size=(BATCH, 4))) for _ in LAGS]


def _numpy_grads(p: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """The gradient of `_loss` by hand, in float64."""
    h = np.tanh(x @ p["w"])
    d = 2 * (h @ p["v"] + p["b"] - y) / y.size
    dz = (d @ p["v"].T) * (1 - h**2)
    return {"w": x.T @ dz, "v": h.T @ d, "b": d.sum(0)}


def _reference() -> tuple[dict, int]:
    """SGD on each window's full batch: the accepted steps' examples together."""
    params, window, releases = _params(), [], 0
    for (x, y), lag in zip(_batches(), LAGS, strict=True):
        if lag > 0:  # tagged before the accumulator's step: dropped
            continue
        window.append((x, y))
        if len(window) == NUM_REQUIRED:
            xs, ys = (np.concatenate(a) for a in zip(*window, strict=True))
            grads = _numpy_grads(params, xs, ys)
            params = {k: params[k] - LR * grads[k] for k in params}
            window, releases = [], releases + 1
    return params, releases


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w"])
    return jnp.mean((h @ params["v"] + params["b"] - y) ** 2)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


# optax < 0.2.9 reads jax >= 0.10 as older than 0.7 (it compares the strings).
MISREADS_JAX = _version(optax.__version__) < (0, 2, 9) and jax.__version__ < "0.7.0"


def _step(mode: str, microbatch_size: int | None = MICRO, auto_axes: bool = True):
    """The jitted train step and its transform. Under explicit sharding, the
    micro-batched gradient runs under `jax.sharding.auto_axes` unless `auto_axes` is
    False; `microbatch_size=None` takes the step's whole batch at once."""
    grad_fn = microbatching.microbatch(
        jax.grad(_loss),
        argnums=(1, 2),
        microbatch_size=microbatch_size,
        accumulator=microbatching.AccumulationType.MEAN,
    )
    tx = optax_accum.conditional_accumulator(optax.sgd(LR), NUM_REQUIRED)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, x, y, lag):
        if mode == "explicit" and auto_axes:
            specs = jax.tree.map(lambda p: jax.typeof(p).sharding.spec, params)
            grads = jax.sharding.auto_axes(grad_fn, out_sharding=specs)(params, x, y)
        else:
            grads = grad_fn(params, x, y)  # the mean over the step's micro-batches
        local_step = optax_accum.global_step(state) - lag
        updates, state = tx.update(grads, state, params, local_step=local_step)
        return optax_accum.apply_updates(params, updates), state

    return step, tx


def _place(mesh, params, tx):
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    state = jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))(params)
    return params, state


def _batch(mesh, x, y, lag):
    data = NamedSharding(mesh, P("data"))
    lag = jax.device_put(np.asarray(lag, np.int32), NamedSharding(mesh, P()))
    return jax.device_put(x, data), jax.device_put(y, data), lag


def _train(mode: str, auto_axes: bool = True):
    """`len(LAGS)` steps on the mesh; returns the params and the state."""
    mesh = _mesh(mode)
    step, tx = _step(mode, auto_axes=auto_axes)
    with _compat.mesh_context(mesh):
        params, state = _place(mesh, _params(), tx)
        for (x, y), lag in zip(_batches(), LAGS, strict=True):
            params, state = step(params, state, *_batch(mesh, x, y, lag))
    return params, state


def _assert_equals_the_full_batch(params, state):
    want, releases = _reference()
    for k in want:
        assert params[k].dtype == jnp.float64, k
        np.testing.assert_allclose(np.asarray(params[k]), want[k], rtol=1e-9, atol=1e-12)
        assert not np.allclose(want[k], _params()[k]), k  # the steps moved every param
    assert int(state.global_step) == releases == 3
    assert int(state.num_dropped) == 2  # the lag-1 and lag-2 steps
    assert int(state.count) == 1  # the last step is held, waiting for its window
    for k, param in params.items():  # the accumulator is laid out like its param
        acc = state.storage[k]
        assert acc.sharding.devices_indices_map(acc.shape) == (
            param.sharding.devices_indices_map(param.shape)
        ), k


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_micro_batches_in_a_step_and_a_window_across_steps_equal_the_full_batch(mode):
    _assert_equals_the_full_batch(*_train(mode))


def test_microbatch_called_directly_under_explicit_sharding():
    """Without `auto_axes`: fails where optax misreads jax's version, equal elsewhere."""
    if MISREADS_JAX:
        # jax's ShardingTypeError, not public: told apart by its message.
        with pytest.raises(Exception, match="This reshape is not supported"):
            _train("explicit", auto_axes=False)
        return
    _assert_equals_the_full_batch(*_train("explicit", auto_axes=False))


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_micro_batches_bound_the_step_temporaries(mode):
    """A step of 256 examples, 4 at a time, keeps fewer temporary bytes per device
    than the same step taking them all at once (the activations of one micro-batch)."""
    mesh = _mesh(mode)
    rng = np.random.default_rng(2)
    params = {"w": rng.normal(size=(16, 64)), "v": rng.normal(size=(64, 4)), "b": np.zeros(4)}
    x, y = rng.normal(size=(256, 16)), rng.normal(size=(256, 4))
    temporaries = {}
    for size in (MICRO, None):
        step, tx = _step(mode, microbatch_size=size)
        with _compat.mesh_context(mesh):
            args = (*_place(mesh, params, tx), *_batch(mesh, x, y, 0))
            compiled = step.lower(*args).compile()
        temporaries[size] = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries[MICRO] * 2 < temporaries[None], temporaries
