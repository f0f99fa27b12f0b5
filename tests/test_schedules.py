"""Which counter an inner optimizer's schedule sees: optimizer steps, not micro-steps.

An inner learning-rate schedule advances with the inner's own `count`, which moves
only when the inner runs: once per release of an accumulator (as in
`optax.MultiSteps`), once per accepted update of `drop_stale_gradients`; in `agn`, the
inner runs on every local step and the outer once per round. Checked against a
float64 NumPy reference of the expected learning rates and against MultiSteps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

K = 3  # gradients per release


def _schedule(count: jax.Array) -> jax.Array:
    """1 / (count + 1): every step sees a different rate."""
    return 1.0 / (count.astype(jnp.float32) + 1.0)


def _reference(num_inner_steps: int) -> np.ndarray:
    """Params after `num_inner_steps` sgd(_schedule) steps of gradient ones."""
    return -np.sum(1.0 / (np.arange(num_inner_steps, dtype=np.float64) + 1.0)) * np.ones(2)


def _run(tx, tags) -> tuple[np.ndarray, object]:
    step = jax.jit(
        lambda p, s, tag: optax_accum.apply_gradients(tx, jnp.ones(2), s, p, local_step=tag)
    )
    params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    for tag in tags:
        params, state = step(params, state, tag(state))
    return np.asarray(params, np.float64), state


def _fresh(state):
    return optax_accum.global_step(state)


def _stale(state):
    return optax_accum.global_step(state) - 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax_accum.conditional_accumulator(optax.sgd(_schedule), K),
        lambda: optax_accum.sparse_conditional_accumulator(optax.sgd(_schedule), K, capacity=2),
    ],
    ids=["conditional_accumulator", "sparse_conditional_accumulator"],
)
def test_an_accumulators_inner_schedule_counts_releases(make):
    """3 releases of 3 micro-steps each (and dropped stale gradients between them):
    the inner schedule sees counts 0, 1, 2, not micro-step numbers."""
    tags = [_fresh, _fresh, _stale, _fresh] * 3  # every fourth gradient is stale
    params, state = _run(make(), tags)
    assert int(optax_accum.global_step(state)) == 3
    np.testing.assert_allclose(params, _reference(3), rtol=1e-6)


def test_the_inner_schedule_sees_what_multisteps_inner_sees():
    ours, _ = _run(optax_accum.conditional_accumulator(optax.sgd(_schedule), K), [_fresh] * 9)
    theirs = optax.MultiSteps(optax.sgd(_schedule), K)
    params, state = jnp.zeros(2), theirs.init(jnp.zeros(2))
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps is not strict-clean
        step = jax.jit(theirs.update)
        for _ in range(9):
            updates, state = step(jnp.ones(2), state, params)
            params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(ours, np.asarray(params, np.float64), rtol=1e-6)
    np.testing.assert_allclose(ours, _reference(3), rtol=1e-6)


def test_drop_stale_gradients_inner_schedule_counts_accepted_updates():
    tx = optax_accum.drop_stale_gradients(optax.sgd(_schedule), staleness=0)
    params, state = _run(tx, [_fresh, _stale] * 4)
    assert int(optax_accum.global_step(state)) == 4
    np.testing.assert_allclose(params, _reference(4), rtol=1e-6)


def test_agn_inner_schedule_counts_local_steps_and_outer_counts_rounds():
    """agn(inner, 2, outer=...): the inner runs on each of the 6 local steps, the outer
    on each of the 3 rounds, each with its own count."""
    tx = optax_accum.agn(optax.sgd(_schedule), 2, outer=optax.sgd(_schedule))
    params, state = _run(tx, [_fresh] * 6)
    inner_count = optax.tree_utils.tree_get(state.inner_state, "count")
    outer_count = optax.tree_utils.tree_get(state.outer_state, "count")
    assert (int(inner_count), int(outer_count)) == (6, 3)
    # The centre moves by the outer's rate times the mean raw gradient (1) each round.
    np.testing.assert_allclose(params, _reference(3), rtol=1e-6)
