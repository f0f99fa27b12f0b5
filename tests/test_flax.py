"""Every exported transform (tests/_cases.py) inside Flax training loops.

- linen: `optax_accum.TrainState.apply_gradients` forwards extra args (`local_step`) to
  the transform; params and optimizer state match the plain-optax harness run.
- NNX: `nnx.Optimizer.update(model, grads, **extra_args)` forwards them already; the
  model's params and the optimizer state match the harness run. Row-sparse cases use
  the functional NNX loop instead (see that test for why).
- Flax msgpack checkpoints (`flax.serialization.to_bytes` / `from_bytes`, as HF-style
  scripts save a `TrainState`) taken at any step, mid-window included, restore into a
  fresh template and resume bit-identically to the run that was never interrupted
  (checked in the linen loop's test, on its compiled step).

The two cases that are their namesake with an axis name and nothing else run in the
namesake's place (`AXIS_TWINS` says why).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import CASES, REPLICAS, Case, spent_as_zeros, trajectory
from flax import nnx

import optax_accum

STEPS = 7
AXIS = "replicas"


def _assert_trees_close(actual: Any, expected: Any, *, same_structure: bool = True) -> None:
    actual, expected = spent_as_zeros(actual), spent_as_zeros(expected)
    if same_structure:
        assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert jnp.result_type(a) == jnp.result_type(e)
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=1e-6, atol=1e-7
        )


def _stack(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.stack([x] * REPLICAS), tree)


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _grads(case: Case, i: int) -> Any:
    if not case.needs_axis:
        return case.grads(i)
    reps = [case.replica_grads(i, r) for r in range(REPLICAS)]
    return jax.tree.map(lambda *x: jnp.stack(x), *reps)


def _run(case: Case, step: Any, state: Any) -> Any:
    """`STEPS` jitted `step(state, grads, extra)` calls on the case's gradient stream.

    Under `needs_axis`, `REPLICAS` copies of `state` run under vmap(axis_name), and
    replica 0's final state comes back.
    """
    if case.needs_axis:
        state = _stack(state)
        step = jax.vmap(step, in_axes=(0, 0, None), axis_name=AXIS)
    fn = jax.jit(step)
    for i in range(STEPS):
        state = fn(state, _grads(case, i), case.extra_args(i))
    return _first(state) if case.needs_axis else state


def _make(case: Case) -> optax.GradientTransformationExtraArgs:
    return case.make(AXIS if case.needs_axis else None)


def _expected_changes(case: Case, params: Any) -> None:
    """Guards against a loop that never updated anything."""
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, case.params())
    assert any(jax.tree.leaves(changed)), "no parameter moved in the loop"


class _CaseModel(nn.Module):
    """A linen module whose parameters are the case's (dict) parameter tree."""

    case: Case

    @nn.compact
    def __call__(self) -> Any:
        return {k: self.param(k, lambda key, v=v: v) for k, v in self.case.params().items()}


# Two cases are their namesake with an axis name and nothing else (tests/test_contract.py's
# AXIS_TWINS): the same state types and the same TrainState step, the axis only adding
# the psums of the reduction (the other axis-bound cases run TrainState, nnx.Optimizer
# and msgpack under vmap with an axis here; tests/test_train_step.py runs the twins'
# fused steps). The Flax loops run their namesakes.
AXIS_TWINS = {"conditional_accumulator_shared", "sparse_conditional_accumulator_shared"}
LINEN_CASES = [c for c in CASES if c.name not in AXIS_TWINS]


@pytest.mark.flax
@pytest.mark.parametrize("case", LINEN_CASES, ids=[c.name for c in LINEN_CASES])
def test_linen_train_state_loop_matches_optax_loop_and_resumes_from_msgpack(case):
    """The linen loop, and msgpack checkpoints of it taken mid-window: one compiled
    step for both (they were two tests, one compile each, of the same step). The
    checkpoints are of the loop's own states after each step (the program is
    deterministic: running it again from scratch to each step gives the same ones)."""
    model = _CaseModel(case)
    params = model.init(jax.random.key(0))["params"]
    tx = _make(case)

    def fresh() -> optax_accum.TrainState:  # what a restarted script builds: tx.init
        state = optax_accum.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        return _stack(state) if case.needs_axis else state

    def step(state, grads, extra):
        return state.apply_gradients(grads=grads, **extra)

    if case.needs_axis:
        step = jax.vmap(step, in_axes=(0, 0, None), axis_name=AXIS)
    step = jax.jit(step)

    grads = [_grads(case, i) for i in range(STEPS)]

    def run(state, steps, kept=None):
        for i in steps:
            state = step(state, grads[i], case.extra_args(i))
            if kept is not None:
                kept.append(state)
        return state

    after = []  # the state after each step
    whole = run(fresh(), range(STEPS), after)

    # The loop matches the plain-optax harness run.
    state = _first(whole) if case.needs_axis else whole
    want_params, want_state, _ = trajectory(case, STEPS, axis=AXIS)
    assert int(state.step) == STEPS
    _assert_trees_close(state.params, want_params)
    _assert_trees_close(state.opt_state, want_state)
    _expected_changes(case, state.params)
    # The loop's own apply_fn still sees the trained parameters.
    _assert_trees_close(state.apply_fn({"params": state.params}), want_params)

    # A checkpoint taken after any step resumes bit-identically.
    held = []
    for cut in range(1, STEPS):  # every step: mid-window and right after a release
        before = after[cut - 1]
        if case.name.startswith(("conditional", "sparse", "agn")):
            held.append(int(np.ravel(optax_accum.num_accumulated(before.opt_state))[0]))
        restored = flax.serialization.from_bytes(fresh(), flax.serialization.to_bytes(before))
        resumed = run(restored, range(cut, STEPS))
        assert jax.tree.structure(resumed) == jax.tree.structure(whole)
        for a, e in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
            assert jnp.result_type(a) == jnp.result_type(e)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert not held or max(held) > 0  # some checkpoint held gradients of an open window


class _NNXModel(nnx.Module):
    """An NNX module holding the case's parameter tree as `nnx.Param`s."""

    def __init__(self, tree: Any):
        self.tree = nnx.data(jax.tree.map(nnx.Param, tree))


def _name(case: Case) -> str:
    return case.name


def _sparse(case: Case) -> bool:
    return case.apply_updates is not optax.apply_updates


def _nnx_params(model: _NNXModel) -> Any:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))["tree"]


@pytest.mark.parametrize("case", [c for c in CASES if not _sparse(c)], ids=_name)
def test_nnx_optimizer_loop_matches_optax_loop(case):
    model = _NNXModel(case.params())
    optimizer = nnx.Optimizer(model, _make(case), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, grads, extra):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, nnx.state(_NNXModel(grads), nnx.Param), **extra)
        return nnx.state((model, optimizer))

    state = _run(case, step, state)
    model, optimizer = nnx.merge(graphdef, state)

    want_params, want_state, _ = trajectory(case, STEPS, axis=AXIS)
    _assert_trees_close(_nnx_params(model), want_params)
    _expected_changes(case, _nnx_params(model))
    # The same leaves as the harness's state; the params sit one level deeper ("tree").
    _assert_trees_close(nnx.as_pure(optimizer.opt_state), want_state, same_structure=False)
    assert int(optimizer.step[...]) == STEPS


@pytest.mark.parametrize(
    "case", [c for c in CASES if _sparse(c) and c.name not in AXIS_TWINS], ids=_name
)
def test_nnx_functional_loop_with_sparse_gradients_matches_optax_loop(case):
    """Row-sparse gradients in NNX: the model's params as a pure dict, updated in place.

    `nnx.Optimizer` cannot carry them: it turns gradients and optimizer state into
    `nnx.State` trees, which neither keeps `IndexedSlices` leaves nor the sparse
    accumulator's nested NamedTuples, and it adds updates with `optax.apply_updates`.
    """
    tx = _make(case)
    model = _NNXModel(case.params())
    graphdef, model_state = nnx.split(model)
    opt_state = tx.init(_nnx_params(model))
    state = (model_state, opt_state)

    def step(state, grads, extra):
        model = nnx.merge(graphdef, state[0])
        params = _nnx_params(model)
        updates, opt_state = tx.update(grads, state[1], params, **extra)
        new = nnx.state(model)
        nnx.replace_by_pure_dict(new, {"tree": case.apply_updates(params, updates)})
        nnx.update(model, new)
        return nnx.state(model), opt_state

    state = _run(case, step, state)

    want_params, want_state, _ = trajectory(case, STEPS, axis=AXIS)
    got = _nnx_params(nnx.merge(graphdef, state[0]))
    _assert_trees_close(got, want_params)
    _expected_changes(case, got)
    _assert_trees_close(state[1], want_state)


def test_train_state_field_keywords_replace_fields_and_others_reach_tx():
    class WithStats(optax_accum.TrainState):
        stats: Any = None

    seen = {}

    def update(updates, state, params=None, **extra_args):
        seen.update(extra_args)
        return jax.tree.map(jnp.negative, updates), state

    tx = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    state = WithStats.create(apply_fn=None, params=jnp.zeros(2), tx=tx, stats=jnp.zeros(()))
    state = state.apply_gradients(grads=jnp.ones(2), stats=jnp.ones(()), local_step=3)
    assert seen == {"local_step": 3}
    np.testing.assert_array_equal(state.stats, 1.0)
    np.testing.assert_array_equal(state.params, [-1.0, -1.0])


def test_train_state_overwrite_with_gradient_split_is_honoured():
    params = {"params": {"w": jnp.zeros(2)}, "_overwrite_with_gradient": {"s": jnp.zeros(1)}}
    grads = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"s": jnp.full(1, 7.0)}}
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
    state = optax_accum.TrainState.create(apply_fn=None, params=params, tx=tx)
    assert jax.tree.structure(state.opt_state.storage) == jax.tree.structure(params["params"])
    state = jax.jit(lambda s, g: s.apply_gradients(grads=g, local_step=0))(state, grads)
    np.testing.assert_array_equal(state.params["params"]["w"], [-1.0, -1.0])
    np.testing.assert_array_equal(state.params["_overwrite_with_gradient"]["s"], [7.0])


def test_train_state_drops_stale_gradient_in_a_real_linen_model():
    model = nn.Dense(2)
    x = jnp.ones((4, 3))
    params = model.init(jax.random.key(1), x)["params"]
    tx = optax_accum.conditional_accumulator(optax.sgd(0.05), num_required=2)
    state = optax_accum.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - 1.0) ** 2)  # noqa: E731
    step = jax.jit(lambda s, ls: s.apply_gradients(grads=jax.grad(loss)(s.params), local_step=ls))
    state = step(state, jnp.int32(0))
    state = step(state, jnp.int32(-1))  # stale: dropped, nothing released
    _assert_trees_close(state.params, params)
    state = step(state, jnp.int32(0))  # second fresh gradient: releases
    assert int(optax_accum.global_step(state.opt_state)) == 1
    assert int(state.opt_state.num_dropped) == 1
    assert float(loss(state.params)) < float(loss(params))


def test_train_state_donated_step_takes_global_step_as_the_tag():
    """TF1's `local_step=global_step` in a step that donates the TrainState: the tag
    read from the state must not be one of the donated buffers."""
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
    state = optax_accum.TrainState.create(apply_fn=None, params=jnp.zeros(2), tx=tx)
    step = jax.jit(lambda s, g, ls: s.apply_gradients(grads=g, local_step=ls), donate_argnums=0)
    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0])]
    for i, g in enumerate(grads):
        tag = optax_accum.global_step(state.opt_state)
        state = step(state, g, tag - 1 if i == 1 else tag)  # the second one is stale
    # Released once, the mean of the first and third gradients.
    np.testing.assert_allclose(np.asarray(state.params, np.float64), [-3.0, -4.0])
    assert int(optax_accum.global_step(state.opt_state)) == 1
    assert int(state.opt_state.num_dropped) == 1


def test_nnx_optimizer_step_takes_global_step_as_the_tag():
    """`optimizer.update(model, grads, local_step=global_step(optimizer.opt_state))`."""
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel[...], np.float64)
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
    optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tag):
        grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
        optimizer.update(model, grads, local_step=tag)

    for i in range(3):
        tag = optax_accum.global_step(optimizer.opt_state)
        step(model, optimizer, tag - 1 if i == 1 else tag)
    # d sum(x @ k + b) / dk = 1 for x = ones: one release of the mean gradient 1.
    np.testing.assert_allclose(np.asarray(model.kernel[...], np.float64), before - 1.0)
    assert int(optax_accum.global_step(optimizer.opt_state)) == 1
