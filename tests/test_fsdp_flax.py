"""`optax_accum.TrainState` and `NNXOptimizer` on the (data=2, fsdp=4) mesh of
tests/test_fsdp.py, in both sharding modes, equal to one device (Flax is an extra, so
these stay out of the oldest-versions run)."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fsdp import (
    CASES,
    DENSE_SPECS,
    LAGS,
    MODES,
    _assert_close,
    _assert_laid_out_like_params,
    _batch_on,
    _batches,
    _dense_grads,
    _dense_loss,
    _gather,
    _init,
    _mesh,
    _one_device,
    _params,
    _placed,
    _x64,  # noqa: F401 (the fixture)
)

import optax_accum
from optax_accum import _compat


def _flax_run(wrapper: str, mode: str | None):
    """8 steps of `drop_stale_gradients(conditional_accumulator(adam))` through a Flax
    wrapper; returns the params and the optax_accum state."""
    from flax import nnx

    tx = CASES["drop_stale_accumulator"][0]()
    mesh = None if mode is None else _mesh(mode)
    gather = _gather(mode)
    context = contextlib.nullcontext() if mesh is None else _compat.mesh_context(mesh)
    with context:
        params = _placed(_params("dense"), DENSE_SPECS, mesh)
        batches = [
            (_batch_on(b, mesh), jnp.asarray(lag, jnp.int32))
            for b, lag in zip(_batches(), LAGS, strict=True)
        ]
        if wrapper == "TrainState":
            if mode == "auto":  # created in place from the shardings the guide names
                state = optax_accum.TrainState(
                    step=jnp.asarray(0), apply_fn=None, params=params, tx=tx,
                    opt_state=_init(tx, params, mode),
                )  # fmt: skip
            else:  # explicit sharding: `init` lays the state out by itself
                state = optax_accum.TrainState.create(apply_fn=None, params=params, tx=tx)

            @functools.partial(jax.jit, donate_argnums=0)
            def step(state, batch, lag):
                grads = _dense_grads(state.params, batch, gather)
                tag = optax_accum.global_step(state.opt_state) - lag
                return state.apply_gradients(grads=grads, local_step=tag)

            for batch, lag in batches:
                state = step(state, batch, lag)
            return state.params, state.opt_state

        class Model(nnx.Module):
            def __init__(self, tree):
                self.tree = nnx.data(jax.tree.map(nnx.Param, tree))

        model = Model(params)
        optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def nnx_step(model, optimizer, batch, lag):
            def loss(model):
                tree = nnx.to_pure_dict(nnx.state(model, nnx.Param))["tree"]
                return _dense_loss(tree, batch, gather)

            tag = optax_accum.global_step(nnx.as_pure(optimizer.opt_state)) - lag
            optimizer.update(model, nnx.grad(loss)(model), local_step=tag)

        for batch, lag in batches:
            nnx_step(model, optimizer, batch, lag)
        pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))["tree"]
        return pure, nnx.as_pure(optimizer.opt_state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrapper", ["TrainState", "NNXOptimizer"])
def test_flax_wrappers_train_sharded_as_on_one_device(wrapper, mode):
    params, state = _flax_run(wrapper, mode)
    want_params, want_state = _one_device("drop_stale_accumulator")
    _assert_close(params, want_params)
    got = [np.asarray(x) for x in jax.tree.leaves(state)]
    assert sorted(x.size for x in got) == sorted(x.size for x in jax.tree.leaves(want_state))
    for name in ("global_step", "num_accumulated"):
        assert int(getattr(optax_accum, name)(state)) == int(
            getattr(optax_accum, name)(want_state)
        ), name
    _assert_laid_out_like_params(jax.tree.map(jnp.asarray, state), params)
