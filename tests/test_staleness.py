"""drop_stale_gradients: docs/semantics.md §4's worker table, a NumPy model, traced
staleness, the all-replicas rule under an axis, and bad input."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import (
    DropStaleGradientsState,
    drop_stale_gradients,
    global_step,
    has_updated,
    staleness_percentage,
)

# -------------------------------------------------------------------- docs/semantics.md §4


@pytest.mark.parametrize(
    ("workers", "staleness", "steps", "drops", "v"),
    [
        (1, 0, 1, 0, (1.0, 2.0)),
        (1, -1, 0, 1, (0.0, 1.0)),
        (2, 0, 1, 1, (1.0, 2.0)),
        (2, 1, 2, 0, (2.0, 3.0)),
        (3, 0, 1, 2, (1.0, 2.0)),
        (3, 1, 2, 1, (2.0, 3.0)),
    ],
)
def test_tf_worker_table(workers, staleness, steps, drops, v):
    """N workers all compute at global step 0 and apply in turn (lags 0, 1, 2, ...)."""
    tx = drop_stale_gradients(optax.sgd(1.0), staleness)
    params = jnp.array([0.0, 1.0])
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(-jnp.ones(2), s, p, local_step=0))
    for _ in range(workers):
        updates, state = step(params, state)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params, v)
    assert int(global_step(state)) == steps and int(state.num_dropped) == drops
    assert float(staleness_percentage(state)) == pytest.approx(drops / (steps + 1))


# --------------------------------------------------------------------------- NumPy model


def numpy_model(lags, staleness, grads, lr=0.1, momentum=0.9):
    """float64 reference: SGD with momentum fed the accepted gradients only.

    `lags[i]` is how many steps behind the current global step gradient i was computed.
    """
    params, trace, step, dropped, outs = np.zeros(grads.shape[1]), 0.0, 0, 0, []
    for lag, g in zip(lags, grads, strict=True):
        if lag <= staleness:
            trace = momentum * trace + g
            update = -lr * trace
            params = params + update
            step += 1
        else:
            update = np.zeros_like(params)
            dropped += 1
        outs.append(update)
    return params, step, dropped, np.array(outs)


@functools.partial(jax.jit, static_argnames="static_staleness")
def _scan_run(grads, lags, staleness, static_staleness=None):
    """All steps in one scan; staleness traced, or a Python int when static_staleness."""
    limit = staleness if static_staleness is None else static_staleness
    tx = drop_stale_gradients(optax.sgd(0.1, momentum=0.9), limit)

    def body(carry, xs):
        params, state = carry
        g, lag = xs
        updates, state = tx.update(g, state, params, local_step=state.global_step - lag)
        return (optax.apply_updates(params, updates), state), updates

    params = jnp.zeros(3)
    return jax.lax.scan(body, (params, tx.init(params)), (grads, lags))


@settings(max_examples=examples(40), deadline=None)
@given(
    lags=st.lists(st.integers(-2, 4), min_size=10, max_size=10),
    staleness=st.integers(-1, 3),
    traced=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy_model(lags, staleness, traced, seed):
    grads = np.random.default_rng(seed).normal(size=(len(lags), 3))
    (params, state), updates = _scan_run(
        jnp.asarray(grads, jnp.float32),
        jnp.asarray(lags, jnp.int32),
        jnp.int32(staleness),
        static_staleness=None if traced else staleness,
    )
    ref_params, ref_step, ref_dropped, ref_updates = numpy_model(lags, staleness, grads)
    np.testing.assert_allclose(params, ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(updates, ref_updates, rtol=1e-5, atol=1e-6)
    assert int(state.global_step) == ref_step and int(state.num_dropped) == ref_dropped
    assert bool(state.emitted) == (lags[-1] <= staleness)


# --------------------------------------------------------------------------- behaviour


def test_dropped_step_leaves_inner_untouched_and_nan_never_leaks():
    tx = drop_stale_gradients(adam(0.1), staleness=0)
    params = jnp.ones(3)
    state = tx.init(params)
    step = jax.jit(lambda g, s, ls: tx.update(g, s, params, local_step=ls))
    _, state = step(jnp.ones(3), state, 0)
    before = state
    updates, state = step(jnp.full(3, jnp.nan), state, -5)  # stale, and NaN
    np.testing.assert_array_equal(updates, 0.0)
    assert not bool(has_updated(state))
    jax.tree.map(np.testing.assert_array_equal, before.inner_state, state.inner_state)
    assert int(state.global_step) == 1 and int(state.num_dropped) == 1
    # adam's own step count shows inner ran only on the accepted step
    assert int(state.inner_state[0].count) == 1


def test_extreme_local_steps_do_not_wrap():
    tx = drop_stale_gradients(optax.sgd(1.0), staleness=10)
    state = tx.init(jnp.zeros(1))
    state = optax_accum.set_global_step(state, 5)
    step = jax.jit(lambda s, ls: tx.update(jnp.ones(1), s, local_step=ls))
    _, state = step(state, jnp.int32(np.iinfo(np.int32).min))  # lag overflows int32
    assert int(state.num_dropped) == 1 and int(state.global_step) == 5
    _, state = step(state, jnp.int32(np.iinfo(np.int32).max))  # from the future: accepted
    assert int(state.num_dropped) == 1 and int(state.global_step) == 6


def test_staleness_under_inject_hyperparams_can_change_between_steps():
    tx = optax.inject_hyperparams(drop_stale_gradients, static_args=("inner",))(
        inner=optax.sgd(1.0), staleness=0
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    step = jax.jit(lambda s: tx.update(jnp.ones(2), s, params, local_step=0))
    _, state = step(state)  # lag 0: accepted
    _, state = step(state)  # lag 1 > 0: dropped
    state.hyperparams["staleness"] = jnp.asarray(1)
    updates, state = step(state)  # lag 1 <= 1: accepted, same compiled step
    np.testing.assert_array_equal(updates, [-1.0, -1.0])
    assert int(global_step(state)) == 2 and int(state.inner_state.num_dropped) == 1
    assert float(staleness_percentage(state)) == pytest.approx(1 / 3)


def test_float_staleness_array():
    tx = drop_stale_gradients(optax.sgd(1.0), jnp.float32(1.5))
    state = tx.init(jnp.zeros(1))
    step = jax.jit(lambda s: tx.update(jnp.ones(1), s, local_step=0))
    for _ in range(3):
        _, state = step(state)
    assert int(state.global_step) == 2 and int(state.num_dropped) == 1


def test_accessors_inside_chain():
    tx = optax.chain(optax.clip(1.0), drop_stale_gradients(optax.sgd(1.0), 0))
    state = tx.init(jnp.zeros(1))
    _, state = tx.update(jnp.ones(1), state, local_step=jnp.int32(3))
    assert isinstance(state[1], DropStaleGradientsState)
    assert int(global_step(state)) == 1 and bool(has_updated(state))
    assert float(staleness_percentage(state)) == 0.0


# --------------------------------------------------------------------------- replicas


def _replica_run(mapper, lags_per_step):
    """8 replicas: drop_stale_gradients(cross_shard_optimizer(sgd), axis_name="i")."""
    tx = drop_stale_gradients(
        optax_accum.cross_shard_optimizer(optax.sgd(1.0), "i"), 0, axis_name="i"
    )

    def step(params, state, g, lag):
        updates, state = tx.update(g, state, params, local_step=state.global_step - lag)
        return optax.apply_updates(params, updates), state

    if mapper == "vmap":
        fn = jax.jit(jax.vmap(step, axis_name="i"))
        params = jnp.zeros((8, 2))
        state = jax.vmap(tx.init)(params)
    else:
        mesh = Mesh(np.array(jax.devices()), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
        body = lambda p, s, g, lag: step(p, s, g[0], lag[0])  # noqa: E731
        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("i"), P("i")), out_specs=P())
        )
        params = jnp.zeros(2)
        state = tx.init(params)
    grads = jnp.arange(16.0).reshape(8, 2)
    for lags in lags_per_step:
        params, state = fn(params, state, grads, jnp.asarray(lags, jnp.int32))
    return np.asarray(params), state


@pytest.mark.parametrize("mapper", ["vmap", "shard_map"])
def test_replicas_drop_together_when_any_is_too_stale(mapper):
    fresh, one_late = [0] * 8, [0] * 7 + [1]
    params, state = _replica_run(mapper, [fresh, one_late, fresh])
    mean = np.arange(16.0).reshape(8, 2).mean(0)
    np.testing.assert_allclose(
        params.reshape(-1, 2), np.broadcast_to(-2 * mean, (params.size // 2, 2))
    )
    steps, dropped = np.asarray(state.global_step), np.asarray(state.num_dropped)
    assert np.all(steps == 2) and np.all(dropped == 1)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("staleness", [1j, True, "1", None, jnp.zeros(2)])
def test_bad_staleness_raises_at_construction(staleness):
    with pytest.raises(TypeError, match="staleness must be"):
        drop_stale_gradients(optax.sgd(1.0), staleness)


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="axis_name must be"):
        drop_stale_gradients(optax.sgd(1.0), 1, axis_name=1.5)
    tx = drop_stale_gradients(optax.sgd(1.0), 1)
    state = tx.init(jnp.zeros(1))
    with pytest.raises(TypeError, match="local_step must be an integer scalar"):
        jax.jit(lambda s: tx.update(jnp.ones(1), s, local_step=1.0))(state)
    with pytest.raises(ValueError, match="local_step must be an integer scalar"):
        jax.jit(lambda s: tx.update(jnp.ones(1), s, local_step=jnp.zeros(2, jnp.int32)))(state)
    with pytest.raises(TypeError, match="staleness must be an int or float scalar"):
        tx = drop_stale_gradients(optax.sgd(1.0), jnp.asarray(True))
        tx.update(jnp.ones(1), tx.init(jnp.zeros(1)))
    shared = drop_stale_gradients(optax.sgd(1.0), 1, axis_name="i")
    with pytest.raises(ValueError, match="axis_name='i' is not bound"):
        jax.jit(lambda s: shared.update(jnp.ones(1), s))(shared.init(jnp.zeros(1)))
    with pytest.raises(ValueError, match="no DropStaleGradientsState"):
        staleness_percentage(optax.sgd(1.0).init(jnp.zeros(1)))
