"""The state accessors (optax_accum/state.py) on batched states: a state made under
`jax.vmap` has counters with a leading batch axis, and every accessor works on it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum


def _batched(n=3, num_required=2):
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=num_required)
    return tx, jax.vmap(tx.init)(jnp.zeros((n, 2)))


def test_set_global_step_on_a_batched_state_sets_every_element():
    tx, state = _batched()
    state = optax_accum.set_global_step(state, 5)
    steps = optax_accum.global_step(state)
    assert steps.shape == (3,) and steps.dtype == jnp.int32
    np.testing.assert_array_equal(steps, [5, 5, 5])
    # Still a state the batched update takes: a stale gradient is dropped everywhere.
    update = jax.vmap(lambda g, s, ls: tx.update(g, s, local_step=ls))
    _, state = update(jnp.ones((3, 2)), state, jnp.array([4, 5, 6]))
    np.testing.assert_array_equal(optax_accum.num_accumulated(state), [0, 1, 1])


@pytest.mark.parametrize("steps", [[1, 2, 3], np.array([1, 2, 3]), jnp.array([1, 2, 3])])
def test_set_global_step_per_element(steps):
    _, state = _batched()
    state = optax_accum.set_global_step(state, steps)
    np.testing.assert_array_equal(optax_accum.global_step(state), [1, 2, 3])


def test_set_global_step_per_element_saturates_wide_integers():
    _, state = _batched()
    big = np.array([2**40, -(2**40), 7], np.int64)
    with pytest.warns(UserWarning, match="1 of 3"):  # -2**31 < 0
        state = optax_accum.set_global_step(state, big)
    np.testing.assert_array_equal(optax_accum.global_step(state), [2**31 - 1, -(2**31), 7])


def test_lowering_any_element_warns_and_raising_does_not():
    _, state = _batched()
    state = optax_accum.set_global_step(state, jnp.array([4, 4, 4]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = optax_accum.set_global_step(state, jnp.array([4, 5, 6]))
    with pytest.warns(
        UserWarning, match=r"in 1 of 3 batch elements \(first at index \(1,\): 2 < 5\)"
    ):
        state = optax_accum.set_global_step(state, jnp.array([9, 2, 6]))
    np.testing.assert_array_equal(optax_accum.global_step(state), [9, 2, 6])
    with pytest.warns(UserWarning, match="in 3 of 3 batch elements"):
        optax_accum.set_global_step(state, 0)


def test_under_vmap_and_jit_nothing_warns():
    _, state = _batched()
    state = optax_accum.set_global_step(state, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered = jax.vmap(optax_accum.set_global_step)(state, jnp.array([1, 2, 3]))
        jax.jit(optax_accum.set_global_step)(state, 0)
    np.testing.assert_array_equal(optax_accum.global_step(lowered), [1, 2, 3])


def test_a_two_level_batch():
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
    state = jax.vmap(jax.vmap(tx.init))(jnp.zeros((2, 3, 2)))
    state = optax_accum.set_global_step(state, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(optax_accum.global_step(state), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize(
    ("steps", "error", "match"),
    [
        (jnp.array([1, 2]), ValueError, r"the global step's shape \(3,\).*got shape \(2,\)"),
        (jnp.array([1.0, 2.0, 3.0]), TypeError, "integer scalar or array, got dtype float32"),
        (np.array([[1, 2, 3]]), ValueError, r"got shape \(1, 3\)"),
        (1.5, TypeError, "new_global_step must be an integer scalar"),
    ],
)
def test_bad_batched_steps_are_clear_errors(steps, error, match):
    _, state = _batched()
    with pytest.raises(error, match=match):
        optax_accum.set_global_step(state, steps)
