"""The contract every exported optax_accum transform keeps (run over tests/_cases.py).

- an unknown extra argument passes through;
- the second call does not recompile;
- `update` leaves the state's tree structure, shapes and dtypes unchanged;
- it works inside `jax.lax.scan`, `optax.chain` and `optax.inject_hyperparams`;
- a NaN in a held or dropped gradient never reaches the updates, and a dropped one
  never reaches the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import CASE_IDS, CASES, REPLICAS, Case, run, scan_run, trajectory

import optax_accum

STEPS = 7


def _assert_trees_close(a, b, **kw):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), **kw)


def _avals(tree):
    return jax.tree.structure(tree), [
        (jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(tree)
    ]


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request) -> Case:
    return request.param


def test_cases_cover_every_exported_transform():
    """Each exported transform factory appears in at least one Case."""
    factories = {
        "conditional_accumulator",
        "sparse_conditional_accumulator",
        "cross_shard",
        "cross_shard_optimizer",
        "drop_stale_gradients",
        "agn",
    }
    exported = factories & set(optax_accum.__all__)
    covered = {f for f in exported for c in CASES if c.name.startswith(f)}
    assert covered == exported


def test_unknown_extra_argument_passes_through(case):
    def with_unknown(i):
        return {**case.extra_args(i), "unknown_extra_arg": jnp.float32(i)}

    tagged = Case(**{**case.__dict__, "extra_args": with_unknown})
    params, _ = run(tagged, 4)
    expected, _ = run(case, 4)
    _assert_trees_close(params, expected, rtol=0, atol=0)


def test_second_call_does_not_recompile(case):
    traces = []
    tx = case.make("replicas" if case.needs_axis else None)

    def counted(tx_update):
        def update(*args, **kwargs):
            traces.append(1)
            return tx_update(*args, **kwargs)

        return update

    wrapped = optax.GradientTransformationExtraArgs(tx.init, counted(tx.update))
    run(case, 3, tx=wrapped)
    assert len(traces) == 1


def test_update_keeps_state_structure_shapes_and_dtypes(case):
    tx = case.make("replicas" if case.needs_axis else None)
    before = _avals(tx.init(case.params()))
    for steps in (1, 2, 4):
        _, state = run(case, steps, tx=tx)
        assert _avals(state) == before


def test_works_inside_scan(case):
    expected_params, expected_state = run(case, STEPS)
    params, state = scan_run(case, STEPS)
    _assert_trees_close(params, expected_params, rtol=1e-6, atol=1e-6)
    _assert_trees_close(state, expected_state, rtol=1e-6, atol=1e-6)


def _has_step_state(state) -> bool:
    try:
        optax_accum.global_step(state)
    except ValueError:  # a stateless transform such as cross_shard
        return False
    return True


def test_works_inside_chain(case):
    axis = "replicas" if case.needs_axis else None
    tx = optax.chain(optax.identity(), case.make(axis), optax.scale(1.0))
    params, state = run(case, STEPS, tx=tx)
    expected, expected_state = run(case, STEPS)
    _assert_trees_close(params, expected, rtol=0, atol=0)
    if _has_step_state(expected_state):  # the accessors see through the chain
        assert int(optax_accum.global_step(state)) == int(optax_accum.global_step(expected_state))


def test_works_inside_inject_hyperparams(case):
    axis = "replicas" if case.needs_axis else None

    def factory(scale):
        return optax.chain(case.make(axis), optax.scale(scale))

    tx = optax.inject_hyperparams(factory)(scale=1.0)
    params, state = run(case, STEPS, tx=tx)
    expected, _ = run(case, STEPS)
    _assert_trees_close(params, expected, rtol=1e-6, atol=1e-6)
    assert float(state.hyperparams["scale"]) == 1.0


def _first_step(predicate, limit=12):
    return next((i for i in range(limit) if predicate(i)), None)


HOLDING = [c for c in CASES if _first_step(c.hold_step) is not None]
DROPPING = [c for c in CASES if _first_step(c.drop_step) is not None]
AXIS_BOUND = [c for c in CASES if c.needs_axis]


@pytest.mark.parametrize("case", HOLDING, ids=[c.name for c in HOLDING])
def test_nan_in_held_gradient_does_not_reach_updates(case):
    i = _first_step(case.hold_step)
    _, _, updates = trajectory(case, i + 1, poison=frozenset({i}))
    for u in jax.tree.leaves(updates[i]):
        assert np.all(np.asarray(u) == 0), f"held step {i} returned {u}"


@pytest.mark.parametrize("case", DROPPING, ids=[c.name for c in DROPPING])
def test_nan_in_dropped_gradient_reaches_neither_state_nor_updates(case):
    i = _first_step(case.drop_step)
    params, state, updates = trajectory(case, i + 3, poison=frozenset({i}))
    clean_params, _, _ = trajectory(case, i + 3)
    for leaf in jax.tree.leaves((params, state, updates)):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    # Dropping is dropping: the poisoned run continues exactly like the clean one.
    _assert_trees_close(params, clean_params, rtol=0, atol=0)


@pytest.mark.parametrize("case", AXIS_BOUND, ids=[c.name for c in AXIS_BOUND])
def test_replicas_agree_under_axis(case):
    """Under a bound axis, replica-invariant counters agree on every replica."""
    tx = case.make("replicas")
    params = jax.tree.map(lambda *x: jnp.stack(x), *[case.params()] * REPLICAS)
    state = jax.vmap(tx.init)(params)
    step = jax.jit(
        jax.vmap(
            lambda p, s, g, e: tx.update(g, s, p, **e),
            in_axes=(0, 0, 0, None),
            axis_name="replicas",
        )
    )
    for i in range(STEPS):
        grads = jax.tree.map(
            lambda *x: jnp.stack(x), *[case.replica_grads(i, r) for r in range(REPLICAS)]
        )
        _, state = step(params, state, grads, case.extra_args(i))
        if _has_step_state(state):
            steps = np.asarray(optax_accum.global_step(state))
            assert np.all(steps == steps[0])
