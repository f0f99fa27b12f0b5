"""The state accessors (optax_accum/state.py) on nested and batched states.

Nested: each accessor finds its state by type inside wrappers (`optax.chain`,
`optax.inject_hyperparams`, `drop_stale_gradients`). Batched: a state made under
`jax.vmap` has counters with a leading batch axis, and every accessor works on it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

# --------------------------------------------------------------------------- nested states


def _accumulator(inner=None):
    inner = optax.sgd(1.0) if inner is None else inner
    return optax_accum.conditional_accumulator(inner, num_required=3)


def _drop_stale(inner):
    return optax_accum.drop_stale_gradients(inner, staleness=1)


def _injected(factory, **hyperparams):
    return optax.inject_hyperparams(factory, static_args=("inner",))(**hyperparams)


def _injected_accumulator():
    """An accumulator whose inner learning rate is a hyperparameter in the state."""
    factory = lambda learning_rate: _accumulator(inner=optax.sgd(learning_rate))  # noqa: E731
    return optax.inject_hyperparams(factory)(learning_rate=1.0)


# An accumulator (num_required=3) inside wrappers; `drop_stale_gradients` keeps no count.
NESTED = {
    "drop_stale_gradients(accumulator)": lambda: _drop_stale(_accumulator()),
    "chain(drop_stale_gradients(sgd), accumulator)": lambda: optax.chain(
        _drop_stale(optax.sgd(1.0)), _accumulator()
    ),
    "inject_hyperparams(drop_stale_gradients(accumulator))": lambda: _injected(
        optax_accum.drop_stale_gradients, inner=_accumulator(), staleness=1
    ),
    "drop_stale_gradients(inject_hyperparams(accumulator))": lambda: _drop_stale(
        _injected_accumulator()
    ),
    "chain(clip, accumulator)": lambda: optax.chain(optax.clip(1.0), _accumulator()),
    "inject_hyperparams(accumulator)": _injected_accumulator,
}


@pytest.mark.parametrize("name", list(NESTED))
def test_num_accumulated_finds_the_accumulator_inside_wrappers(name):
    tx = NESTED[name]()
    state = tx.init(jnp.zeros(2))
    update = jax.jit(tx.update)
    counts = [int(optax_accum.num_accumulated(state))]
    for _ in range(4):
        _, state = update(jnp.ones(2), state)
        counts.append(int(optax_accum.num_accumulated(state)))
    assert counts == [0, 1, 2, 0, 1]  # released on the third gradient


@pytest.mark.parametrize("name", list(NESTED))
def test_the_step_accessors_read_the_outermost_step_state_inside_wrappers(name):
    """global_step, has_updated and set_global_step read (and write) the outermost
    optax_accum state: `drop_stale_gradients`' where it wraps the accumulator."""
    tx = NESTED[name]()
    state = tx.init(jnp.zeros(2))
    _, state = jax.jit(tx.update)(jnp.ones(2), state)
    outer_is_drop = name.startswith(("drop", "chain(drop", "inject_hyperparams(drop"))
    assert int(optax_accum.global_step(state)) == (1 if outer_is_drop else 0)
    assert bool(optax_accum.has_updated(state)) == outer_is_drop
    state = optax_accum.set_global_step(state, 7)
    assert int(optax_accum.global_step(state)) == 7
    _, state = jax.jit(tx.update)(jnp.ones(2), state, local_step=7)
    assert int(optax_accum.num_accumulated(state)) == 2  # 7 is not stale: accepted


# --------------------------------------------------------------------------- batched states


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
    update = jax.jit(jax.vmap(lambda g, s, ls: tx.update(g, s, local_step=ls)))
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


# --------------------------------------------------------------------------- donation

ACCESSORS = {
    "global_step": optax_accum.global_step,
    "num_accumulated": optax_accum.num_accumulated,
    "has_updated": optax_accum.has_updated,
}

# One of each stateful transform, and an accumulator inside cross_shard_optimizer.
STATEFUL = {
    "conditional_accumulator": lambda: _accumulator(),
    "sparse_conditional_accumulator": lambda: optax_accum.sparse_conditional_accumulator(
        optax.sgd(1.0), 3, capacity=2
    ),
    "drop_stale_gradients(accumulator)": lambda: _drop_stale(_accumulator()),
    "agn": lambda: optax_accum.agn(optax.sgd(1.0), 3),
    "cross_shard_optimizer(accumulator)": lambda: optax_accum.cross_shard_optimizer(
        _accumulator(), "i"
    ),
}


@pytest.mark.parametrize("accessor", list(ACCESSORS))
@pytest.mark.parametrize("name", list(STATEFUL))
def test_an_accessor_result_can_go_into_a_step_that_donates_the_state(name, accessor):
    """TF1's `apply_gradients(..., local_step=global_step)`: the value read from the
    state goes into the same jitted call that donates the state. Handing back the
    state's own buffer fails there ("a buffer that was previously donated")."""
    state = STATEFUL[name]().init(jnp.zeros(2))
    value = ACCESSORS[accessor](state)
    expected = np.asarray(value)
    step = jax.jit(lambda s, v: (s, v + jnp.zeros((), v.dtype)), donate_argnums=0)
    state, got = step(state, value)
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(np.asarray(value), expected)  # still readable


@pytest.mark.parametrize("accessor", list(ACCESSORS))
def test_accessors_work_under_jit_and_vmap(accessor):
    tx = _accumulator()
    batched = jax.vmap(tx.init)(jnp.zeros((3, 2)))
    batched = jax.jit(jax.vmap(lambda s: tx.update(jnp.ones(2), s)[1]))(batched)
    want = np.asarray(ACCESSORS[accessor](batched))
    np.testing.assert_array_equal(np.asarray(jax.vmap(ACCESSORS[accessor])(batched)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(ACCESSORS[accessor])(batched)), want)
    assert want.shape == (3,)


def test_the_accessors_say_which_states_answer():
    """cross_shard_optimizer keeps no counter: its state alone has no global step."""
    tx = optax_accum.cross_shard_optimizer(optax.sgd(1.0), "i")
    with pytest.raises(ValueError, match="state holds no optax_accum step state"):
        optax_accum.global_step(tx.init(jnp.zeros(2)))
