"""The contract every exported optax_accum transform keeps (run over tests/_cases.py).

- an unknown extra argument passes through;
- the second call does not recompile;
- `update` leaves the state's tree structure, shapes and dtypes unchanged;
- it works inside `jax.lax.scan`, `optax.chain` and `optax.inject_hyperparams`;
- a NaN in a held or dropped gradient never reaches the updates, and a dropped one
  never reaches the state.

Every property for every case, except that a case which is another one with an axis
name and nothing else (`AXIS_TWINS`) leaves the extra-argument, scan, chain and
inject_hyperparams tests to that one (see `AXIS_TWINS` for why). Each case's plain
run is one compiled step (`_tx`), shared by the tests that compare with it or read
its replicas, and counted by the recompile test; chain, inject_hyperparams and the
unknown extra argument are one run (a chain inside inject_hyperparams).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import (
    CASE_IDS,
    CASES,
    REPLICAS,
    Case,
    _jitted_step,
    scan_run,
    stack,
    step_inputs,
    trajectory,
)
from _cases import run as _run_tx

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


# Two cases are their namesake with an axis_name and nothing else: the same update,
# where the axis only adds the psums of the reduction. How the extra arguments are
# forwarded, how the transform nests in `optax.chain` or `optax.inject_hyperparams`,
# and whether its state can be a `lax.scan` carry is not that reduction, so those tests
# run the namesake alone (test_train_step.py runs conditional_accumulator_shared last
# in a chain, and sparse_conditional_accumulator_shared inside inject_hyperparams; the
# other axis-bound cases run psums inside scan here). agn_delta_shared and
# drop_stale_gradients_shared differ from their namesakes in more than the axis.
AXIS_TWINS = {
    "conditional_accumulator_shared": "conditional_accumulator",
    "sparse_conditional_accumulator_shared": "sparse_conditional_accumulator",
}
WITHOUT_AXIS_TWINS = [c for c in CASES if c.name not in AXIS_TWINS]
without_axis_twins = pytest.mark.parametrize(
    "case", WITHOUT_AXIS_TWINS, ids=[c.name for c in WITHOUT_AXIS_TWINS]
)


@functools.cache
def _tx(case: Case) -> tuple[optax.GradientTransformationExtraArgs, list]:
    """The case's transform with its `update` counted: one per case in a test process,
    so every plain run of the case (any length, poisoned or clean) is one compiled step
    (`_cases.trajectory` caches it by transform), and the list counts its traces."""
    traces = []
    tx = case.make("replicas" if case.needs_axis else None)

    def update(*args, **kwargs):
        traces.append(1)
        return tx.update(*args, **kwargs)

    return optax.GradientTransformationExtraArgs(tx.init, update), traces


def run(case: Case, steps: int, *, tx=None) -> tuple:
    """`_cases.run`, the case's own transform being the counted one of `_tx`."""
    return _run_tx(case, steps, tx=tx if tx is not None else _tx(case)[0])


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
    # Each axis twin left out of some tests has its namesake in them.
    names = {c.name for c in WITHOUT_AXIS_TWINS}
    assert all(twin in names and twin not in AXIS_TWINS for twin in AXIS_TWINS.values())


def test_axis_twins_differ_only_by_the_axis():
    """The same parameters, gradients, tags and apply (their `make` differs only in
    the axis name and the sizes that scale with the replicas)."""
    by_name = {c.name: c for c in CASES}
    for shared, twin in AXIS_TWINS.items():
        a, b = by_name[shared], by_name[twin]
        assert a.needs_axis and not b.needs_axis
        assert (a.params, a.grads, a.extra_args, a.apply_updates) == (
            b.params,
            b.grads,
            b.extra_args,
            b.apply_updates,
        )


def test_second_call_does_not_recompile_and_update_keeps_state_structure_shapes_and_dtypes(
    case,
):
    """One compiled step for both properties: the runs of 1, 2, 3 and 4 steps (and any
    other run of the case in this process: `_tx`) trace `update` once, and keep the
    state's avals."""
    tx, traces = _tx(case)
    before = _avals(tx.init(case.params()))
    for steps in (1, 2, 3, 4):
        _, state = run(case, steps)
        assert _avals(state) == before, f"{steps} steps"
    assert len(traces) == 1


@without_axis_twins
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


@without_axis_twins
def test_works_inside_chain_and_inject_hyperparams_and_passes_an_unknown_extra_argument(case):
    """One run for three properties: the transform in an `optax.chain` inside
    `optax.inject_hyperparams`, every step also given an extra argument no transform
    knows (inject_hyperparams and the chain hand it to the transform, which must pass
    it through to its inner optimizer, which ignores it), gives the plain run's
    params bit for bit, and the accessors see through both wrappers."""

    def with_unknown(i):
        return {**case.extra_args(i), "unknown_extra_arg": jnp.float32(i)}

    tagged = Case(**{**case.__dict__, "extra_args": with_unknown})
    axis = "replicas" if case.needs_axis else None

    def factory(scale):
        return optax.chain(optax.identity(), case.make(axis), optax.scale(scale))

    tx = optax.inject_hyperparams(factory)(scale=1.0)
    params, state = run(tagged, STEPS, tx=tx)
    expected, expected_state = run(case, STEPS)
    _assert_trees_close(params, expected, rtol=0, atol=0)
    assert float(state.hyperparams["scale"]) == 1.0
    if _has_step_state(expected_state):
        assert int(optax_accum.global_step(state)) == int(optax_accum.global_step(expected_state))


def _first_step(predicate, limit=12):
    return next((i for i in range(limit) if predicate(i)), None)


HOLDING = [c for c in CASES if _first_step(c.hold_step) is not None]
DROPPING = [c for c in CASES if _first_step(c.drop_step) is not None]
AXIS_BOUND = [c for c in CASES if c.needs_axis]


@pytest.mark.parametrize("case", HOLDING, ids=[c.name for c in HOLDING])
def test_nan_in_held_gradient_does_not_reach_updates(case):
    i = _first_step(case.hold_step)
    _, _, updates = trajectory(case, i + 1, tx=_tx(case)[0], poison=frozenset({i}))
    for u in jax.tree.leaves(updates[i]):
        assert np.all(np.asarray(u) == 0), f"held step {i} returned {u}"


@pytest.mark.parametrize("case", DROPPING, ids=[c.name for c in DROPPING])
def test_nan_in_dropped_gradient_reaches_neither_state_nor_updates(case):
    i = _first_step(case.drop_step)
    tx = _tx(case)[0]
    params, state, updates = trajectory(case, i + 3, tx=tx, poison=frozenset({i}))
    clean_params, _, _ = trajectory(case, i + 3, tx=tx)
    for leaf in jax.tree.leaves((params, state, updates)):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    # Dropping is dropping: the poisoned run continues exactly like the clean one.
    _assert_trees_close(params, clean_params, rtol=0, atol=0)


@pytest.mark.parametrize("case", AXIS_BOUND, ids=[c.name for c in AXIS_BOUND])
def test_replicas_agree_under_axis(case):
    """Under a bound axis, replica-invariant counters agree on every replica (read
    from every replica of the case's plain run: `_tx`'s compiled step)."""
    tx, step = _jitted_step(case, _tx(case)[0], "replicas")
    params = stack([case.params()] * REPLICAS)
    state = jax.vmap(tx.init)(params)
    for i in range(STEPS):
        params, state, _ = step(
            params, state, step_inputs(case, i, frozenset()), case.extra_args(i)
        )
        if _has_step_state(state):
            steps = np.asarray(optax_accum.global_step(state))
            assert np.all(steps == steps[0])
