"""`should_skip_update_fn`: optax.MultiSteps' skip rule on the accumulators and agn.

A gradient the rule skips is left out of the sum and the count, counted in
`num_skipped`, and changes nothing else (agn still counts the local step, as for
`skip_nonfinite`); `skip_nonfinite=True` is the shorthand of `optax.skip_not_finite`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam

import optax_accum
from optax_accum import agn, conditional_accumulator, sparse_conditional_accumulator

skip_large = functools.partial(optax.skip_large_updates, max_squared_norm=40.0)


def _gradients(kind: str, n: int = 12):
    """Gradients for a (4, 3) param; every third one is NaN or large, by `kind`."""
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(n, 4, 3)).astype(np.float32)
    for i in range(1, n, 3):
        if kind == "nan":
            grads[i, 1, 2] = np.nan
        else:
            grads[i] *= 10.0  # squared norm about 1200, over the bound of 40
    return [{"w": jnp.asarray(g)} for g in grads]


def _make(name: str, inner, **kwargs):
    if name == "dense":
        return conditional_accumulator(inner, 3, **kwargs)
    # All leaves dense: the same numbers as conditional_accumulator.
    return sparse_conditional_accumulator(inner, 3, capacity=2, sparse={"w": False}, **kwargs)


def _same(a, b) -> bool:
    """Leafwise equality of two trees, NaN equal to NaN."""

    def eq(x, y):
        x, y = np.asarray(x), np.asarray(y)
        return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))

    return all(jax.tree.leaves(jax.tree.map(eq, a, b)))


# --------------------------------------------------------------------------- MultiSteps


@pytest.mark.parametrize("name", ["dense", "sparse"])
@pytest.mark.parametrize(
    ("rule", "kind"), [(optax.skip_not_finite, "nan"), (skip_large, "large")], ids=["nan", "large"]
)
def test_equals_multisteps_with_the_same_rule(name, rule, kind):
    ours = _make(name, optax.sgd(0.1, momentum=0.9), should_skip_update_fn=rule)
    theirs = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 3, should_skip_update_fn=rule)
    p_ours = p_theirs = {"w": jnp.ones((4, 3))}
    s_ours, s_theirs = ours.init(p_ours), theirs.init(p_theirs)
    step_ours = jax.jit(ours.update)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps itself is not strict-clean
        step_theirs = jax.jit(theirs.update)
        for g in _gradients(kind):
            u_ours, s_ours = step_ours(g, s_ours, p_ours)
            before = int(s_theirs.gradient_step)
            u_theirs, s_theirs = step_theirs(g, s_theirs, p_theirs)
            np.testing.assert_allclose(u_ours["w"], u_theirs["w"], rtol=1e-5, atol=1e-6)
            # (MultiSteps' has_updated stays True on a skipped step after an update.)
            assert bool(s_ours.emitted) == (int(s_theirs.gradient_step) > before)
            p_ours = optax.apply_updates(p_ours, u_ours)
            p_theirs = optax.apply_updates(p_theirs, u_theirs)
    assert int(s_ours.global_step) == int(s_theirs.gradient_step) == 2
    assert int(s_ours.num_skipped) == 4
    assert np.all(np.isfinite(np.asarray(p_ours["w"])))


# --------------------------------------------------------------------------- one skipped gradient


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_skipped_gradient_leaves_the_state_unchanged_but_counted(name):
    tx = _make(name, adam(0.1), should_skip_update_fn=skip_large)
    params = {"w": jnp.zeros((4, 3))}
    update = jax.jit(tx.update)
    state = tx.init(params)
    good, large = _gradients("large")[:2]
    _, state = update(good, state, params)
    u, skipped = update(large, state, params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    assert int(skipped.num_skipped) == 1 and int(skipped.count) == 1
    assert _same(skipped._replace(num_skipped=state.num_skipped), state)


def test_agn_skipped_gradient_counts_the_local_step_only():
    tx = agn(adam(0.1), 3, should_skip_update_fn=skip_large)
    params = {"w": jnp.ones((4, 3))}
    update = jax.jit(tx.update)
    state = tx.init(params)
    good, large = _gradients("large")[:2]
    u, state = update(good, state, params)
    params = optax.apply_updates(params, u)
    u, skipped = update(large, state, params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    assert int(skipped.count) == 2 and int(skipped.round_skipped[0]) == 1
    expected = state._replace(count=skipped.count, round_skipped=skipped.round_skipped)
    assert _same(skipped, expected)
    # The sync adds the round's skips to num_skipped.
    _, synced = update(good, skipped, params)
    assert bool(synced.emitted) and int(synced.num_skipped) == 1
    assert int(synced.round_skipped[0]) == 0 and int(synced.num_nonfinite) == 0


def test_agn_rule_skips_as_skip_nonfinite_does():
    """A large gradient skipped by the rule moves params and centre exactly as a NaN
    gradient skipped by `skip_nonfinite` does."""
    large, nan = _gradients("large"), _gradients("nan")
    runs = {}
    for label, tx, grads in [
        ("rule", agn(optax.sgd(0.1), 3, should_skip_update_fn=skip_large), large),
        ("nonfinite", agn(optax.sgd(0.1), 3, skip_nonfinite=True), nan),
    ]:
        params = {"w": jnp.ones((4, 3))}
        state, update = tx.init(params), jax.jit(tx.update)
        for g in grads:
            u, state = update(g, state, params)
            params = optax.apply_updates(params, u)
        runs[label] = (params, state)
    (p_rule, s_rule), (p_nan, s_nan) = runs["rule"], runs["nonfinite"]
    np.testing.assert_array_equal(p_rule["w"], p_nan["w"])
    np.testing.assert_array_equal(s_rule.centre["w"], s_nan.centre["w"])
    assert (int(s_rule.num_skipped), int(s_rule.num_nonfinite)) == (4, 0)
    assert (int(s_nan.num_skipped), int(s_nan.num_nonfinite)) == (0, 4)


# --------------------------------------------------------------------------- skip_nonfinite


def _run(tx, grads, params):
    state, update, outs = tx.init(params), jax.jit(tx.update), []
    for g in grads:
        u, state = update(g, state, params)
        outs.append(u)
        params = optax.apply_updates(params, u)
    return outs, state


@pytest.mark.parametrize("name", ["dense", "sparse", "agn"])
def test_skip_nonfinite_is_the_shorthand_of_skip_not_finite(name):
    make = (
        functools.partial(agn, optax.sgd(0.1), 3)
        if name == "agn"
        else functools.partial(_make, name, optax.sgd(0.1))
    )
    params, grads = {"w": jnp.ones((4, 3))}, _gradients("nan")
    outs_a, a = _run(make(skip_nonfinite=True), grads, params)
    outs_b, b = _run(make(should_skip_update_fn=optax.skip_not_finite), grads, params)
    assert _same(outs_a, outs_b)
    assert (int(a.num_nonfinite), int(a.num_skipped)) == (4, 0)
    assert (int(b.num_nonfinite), int(b.num_skipped)) == (0, 4)
    assert _same(
        a._replace(num_nonfinite=0, num_skipped=0), b._replace(num_nonfinite=0, num_skipped=0)
    )
    # Both: a non-finite gradient counts as non-finite only.
    _, both = _run(
        make(skip_nonfinite=True, should_skip_update_fn=optax.skip_not_finite), grads, params
    )
    assert (int(both.num_nonfinite), int(both.num_skipped)) == (4, 0)


# --------------------------------------------------------------------------- what the rule sees


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_rule_sees_the_global_step_and_the_params(name):
    def rule(updates, gradient_step, params):
        return (gradient_step == 1) & (params["w"][0, 0] > 0)

    tx = _make(name, optax.identity(), should_skip_update_fn=rule)
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros((4, 3))})
    g = {"w": jnp.ones((4, 3))}
    for _ in range(3):
        _, state = update(g, state, {"w": jnp.ones((4, 3))})  # step 0: kept
    assert int(state.global_step) == 1 and int(state.num_skipped) == 0
    _, state = update(g, state, {"w": jnp.ones((4, 3))})  # step 1, params > 0: skipped
    assert int(state.num_skipped) == 1 and int(state.count) == 0
    _, state = update(g, state, {"w": -jnp.ones((4, 3))})  # params < 0: kept
    assert int(state.num_skipped) == 1 and int(state.count) == 1


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_stale_gradient_is_dropped_not_skipped(name):
    tx = _make(name, optax.identity(), should_skip_update_fn=lambda u, s, p: jnp.asarray(True))
    update = jax.jit(lambda g, s, ls: tx.update(g, s, local_step=ls))
    state = tx.init({"w": jnp.zeros((4, 3))})
    g = {"w": jnp.ones((4, 3))}
    _, state = update(g, state, jnp.int32(-1))
    _, state = update(g, state, jnp.int32(0))
    assert (int(state.num_dropped), int(state.num_skipped), int(state.count)) == (1, 1, 0)


def test_rule_returning_a_python_bool():
    tx = conditional_accumulator(optax.identity(), 1, should_skip_update_fn=lambda u, s, p: False)
    _, state = jax.jit(tx.update)(jnp.ones(2), tx.init(jnp.zeros(2)))
    assert bool(state.emitted) and int(state.num_skipped) == 0


# --------------------------------------------------------------------------- replicas


def test_replicas_skip_their_own_gradients_and_counts_sum_under_pmap():
    tx = conditional_accumulator(
        optax.identity(), 5, axis_name="d", should_skip_update_fn=skip_large
    )
    states = jax.pmap(tx.init)(jnp.zeros((8, 2)))
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(8, 2)).astype(np.float32)
    grads[[1, 4, 6]] *= 100.0
    out, states = jax.pmap(tx.update, axis_name="d")(jnp.asarray(grads), states)
    kept = (grads**2).sum(-1) < 40.0
    np.testing.assert_allclose(out, np.broadcast_to(grads[kept].mean(0), (8, 2)), rtol=1e-6)
    assert np.all(np.asarray(states.num_skipped) == 3) and np.all(np.asarray(states.emitted))


def test_agn_skips_summed_over_replicas_at_the_sync_under_pmap():
    tx = agn(optax.sgd(0.1), 2, axis_name="d", should_skip_update_fn=skip_large)
    params = jnp.zeros((8, 2))
    states = jax.pmap(tx.init)(params)
    step = jax.pmap(tx.update, axis_name="d")
    rng = np.random.default_rng(2)
    grads = rng.normal(size=(2, 8, 2)).astype(np.float32)
    grads[0, [0, 3]] *= 100.0
    grads[1, 5] *= 100.0
    for g in grads:
        u, states = step(jnp.asarray(g), states, params)
        params = params + u
    assert np.all(np.asarray(states.num_skipped) == 3)
    assert np.all(np.asarray(states.round_skipped) == 0)
    # The centre moved by the mean over replicas of the kept gradients, over 2 steps.
    kept = np.where((grads**2).sum(-1, keepdims=True) < 40.0, grads, 0.0)
    expected = -0.1 * kept.sum(0).mean(0) / 2
    np.testing.assert_allclose(np.asarray(states.centre)[0], expected, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- bad rules


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: conditional_accumulator(optax.identity(), 2, **kw),
        lambda **kw: sparse_conditional_accumulator(optax.identity(), 2, capacity=2, **kw),
        lambda **kw: agn(optax.sgd(0.1), 2, **kw),
    ],
    ids=["dense", "sparse", "agn"],
)
def test_bad_rules(make):
    with pytest.raises(
        TypeError, match=r"should_skip_update_fn must be a callable .* got 3 \(int\)"
    ):
        make(should_skip_update_fn=3)
    params = jnp.zeros(2)
    for rule, match in [
        (lambda u, s, p: jnp.float32(1), r"got dtype float32 and shape \(\)"),
        (lambda u, s, p: jnp.zeros(2, bool), r"got dtype bool and shape \(2,\)"),
        (lambda u, s, p: "no", r"got 'no' \(str\)"),
    ]:
        tx = make(should_skip_update_fn=rule)
        with pytest.raises(
            TypeError, match=r"should_skip_update_fn must return a bool scalar.*" + match
        ):
            jax.jit(tx.update)(jnp.ones(2), tx.init(params), params)


def test_state_helpers_still_find_the_counts():
    tx = conditional_accumulator(optax.identity(), 2, should_skip_update_fn=skip_large)
    state = tx.init(jnp.zeros(2))
    _, state = tx.update(jnp.ones(2), state)
    assert int(optax_accum.num_accumulated(state)) == 1


def test_num_skipped_saturates_instead_of_wrapping():
    top = np.iinfo(np.int32).max
    tx = conditional_accumulator(optax.identity(), 2, should_skip_update_fn=skip_large)
    state = tx.init(jnp.zeros(2))._replace(num_skipped=jnp.int32(top - 1))
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(jnp.full(2, 100.0), state)
    assert int(state.num_skipped) == top and int(state.count) == 0
