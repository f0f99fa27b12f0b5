"""Tests of `agn`: TF's traces, a float64 NumPy model, 8 workers, HLO, checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import re

import _hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

WORKERS = 8
DIM = 3

# --------------------------------------------------------------------------- NumPy model


@dataclasses.dataclass(frozen=True)
class NpSGD:
    """optax.sgd(lr, momentum, nesterov) in float64: trace = g + m * trace; step =
    -lr * trace (nesterov: -lr * (g + m * trace))."""

    lr: float
    momentum: float | None = None
    nesterov: bool = False

    def init(self, p):
        return np.zeros_like(p)

    def step(self, g, trace):
        trace = g + (self.momentum or 0.0) * trace
        direction = g + (self.momentum or 0.0) * trace if self.nesterov else trace
        return -self.lr * direction, trace

    def optax(self):
        return optax.sgd(self.lr, momentum=self.momentum, nesterov=self.nesterov)


@dataclasses.dataclass(frozen=True)
class NpAdam:
    """optax.adam(lr) in float64, its state (count, mu, nu) per leaf."""

    lr: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def init(self, p):
        return (0, np.zeros_like(p), np.zeros_like(p))

    def step(self, g, state):
        count, mu, nu = state
        count, mu, nu = (
            count + 1,
            self.b1 * mu + (1 - self.b1) * g,
            self.b2 * nu + (1 - self.b2) * g**2,
        )
        mu_hat, nu_hat = mu / (1 - self.b1**count), nu / (1 - self.b2**count)
        return -self.lr * mu_hat / (np.sqrt(nu_hat) + self.eps), (count, mu, nu)

    def optax(self):
        return adam(self.lr)


def np_agn(grad_fn, p0, period, steps, inner, outer, commit="gradients", workers=1):
    """AGN as docs/semantics.md §5 states it, in float64, for `workers` averaging workers.

    `grad_fn(w, t, local)` is worker w's gradient at step t (None = skipped).
    Returns the local params of every worker and the centre, after every step.
    """
    p0 = np.asarray(p0, np.float64)
    local = [p0.copy() for _ in range(workers)]
    slots = [inner.init(p0) for _ in range(workers)]
    acc = [np.zeros_like(p0) for _ in range(workers)]
    centre, outer_slot = p0.copy(), outer.init(p0)
    history = []
    for t in range(steps):
        for w in range(workers):
            g = grad_fn(w, t, local[w])
            if g is None:
                continue
            u, slots[w] = inner.step(np.asarray(g, np.float64), slots[w])
            local[w] = local[w] + u
            acc[w] = acc[w] + g
        if (t + 1) % period == 0:
            if commit == "gradients":
                pseudo = np.mean([a / period for a in acc], axis=0)
            else:
                pseudo = np.mean([(centre - lp) / period for lp in local], axis=0)
            u, outer_slot = outer.step(pseudo, outer_slot)
            centre = centre + u
            local = [centre.copy() for _ in range(workers)]
            acc = [np.zeros_like(p0) for _ in range(workers)]
        history.append(([lp.copy() for lp in local], centre.copy()))
    return history


def _jit_run(tx, params, grads):
    """Runs `tx` over the stacked `grads` in one jitted scan; (local, centre, gs) per step."""

    def body(carry, g):
        params, state = carry
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        return (params, state), (params, state.centre, optax_accum.global_step(state))

    @jax.jit
    def run(params, grads):
        return jax.lax.scan(body, (params, tx.init(params)), grads)[1]

    return run(params, grads)


# --------------------------------------------------------------------------- TF traces


def test_tf_trace_sgd_period_3():
    grads = jnp.arange(1.0, 7.0).reshape(6, 1)
    local, centre, gs = _jit_run(optax_accum.agn(optax.sgd(0.1), 3), jnp.array([1.0]), grads)
    np.testing.assert_allclose(local[:, 0], [0.9, 0.7, 0.8, 0.4, -0.1, 0.3], atol=1e-6)
    np.testing.assert_allclose(centre[:, 0], [1.0, 1.0, 0.8, 0.8, 0.8, 0.3], atol=1e-6)
    np.testing.assert_array_equal(gs, [0, 0, 1, 1, 1, 2])


def test_tf_trace_momentum_period_2():
    tx = optax_accum.agn(optax.sgd(0.1, momentum=0.9), 2)
    local, centre, gs = _jit_run(tx, jnp.array([0.0]), jnp.ones((4, 1)))
    np.testing.assert_allclose(local[:, 0], [-0.1, -0.1, -0.371, -0.29], atol=1e-6)
    np.testing.assert_allclose(centre[:, 0], [0.0, -0.1, -0.1, -0.29], atol=1e-6)
    np.testing.assert_array_equal(gs, [0, 1, 1, 2])


def test_tf_trace_adam_b1_b2_zero_period_4():
    tx = optax_accum.agn(adam(0.1, b1=0.0, b2=0.0), 4)
    local, centre, gs = _jit_run(tx, jnp.array([0.0, 0.5]), -jnp.ones((8, 2)))
    np.testing.assert_allclose(local[0], [0.1, 0.6], atol=1e-6)
    np.testing.assert_allclose(centre[0], [0.0, 0.5], atol=1e-6)
    np.testing.assert_allclose(local[2], [0.3, 0.8], atol=1e-6)
    np.testing.assert_allclose(local[3], [0.1, 0.6], atol=1e-6)
    np.testing.assert_allclose(centre[3], [0.1, 0.6], atol=1e-6)
    np.testing.assert_allclose(local[7], [0.2, 0.7], atol=1e-6)
    np.testing.assert_allclose(centre[7], [0.2, 0.7], atol=1e-6)
    np.testing.assert_array_equal(gs, [0, 0, 0, 1, 1, 1, 1, 2])


def test_centre_and_local_optimizer_states_are_separate():
    """TF shares Adam's beta powers between local and centre updates; we do not."""
    tx = optax_accum.agn(adam(0.1), 2)
    params = jnp.zeros(2)
    state = tx.init(params)
    for _ in range(4):
        updates, state = jax.jit(tx.update)(jnp.ones(2), state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.inner_state[0].count) == 4
    assert int(state.outer_state[0].count) == 2


# --------------------------------------------------------------------------- property


@functools.cache
def _scan_fn(period, commit, momentum, skip):
    inner, outer = NpSGD(0.1, momentum), NpSGD(0.5, momentum)
    tx = optax_accum.agn(
        inner.optax(), period, outer=outer.optax(), commit=commit, skip_nonfinite=skip
    )

    def body(carry, g):
        params, state = carry
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        skipped = (state.num_nonfinite, state.round_nonfinite[0])
        return (params, state), (params, state.centre, state.count, skipped)

    run = jax.jit(lambda p, gs: jax.lax.scan(body, (p, tx.init(p)), gs)[1])
    return run, inner, outer


@settings(max_examples=examples(30), deadline=None)
@given(
    period=st.integers(1, 5),
    commit=st.sampled_from(["gradients", "delta"]),
    momentum=st.sampled_from([None, 0.9]),
    skip=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy_model(period, commit, momentum, skip, seed):
    steps = 10
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(steps, DIM)).astype(np.float32)
    bad = set(rng.choice(steps, size=2, replace=False).tolist()) if skip else set()
    for t in bad:
        grads[t, rng.integers(DIM)] = rng.choice([np.nan, np.inf])
    run, inner, outer = _scan_fn(period, commit, momentum, skip)
    p0 = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    local, centre, count, (done, pending) = run(jnp.asarray(p0), jnp.asarray(grads))
    expected = np_agn(
        lambda w, t, p: None if t in bad else grads[t], p0, period, steps, inner, outer, commit
    )
    for t, (exp_local, exp_centre) in enumerate(expected):
        np.testing.assert_allclose(local[t], exp_local[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(centre[t], exp_centre, rtol=1e-5, atol=1e-5)
        assert int(count[t]) == (t + 1) % period
        completed = (t + 1) // period * period  # steps in the rounds completed by t
        assert int(done[t]) == sum(s < completed for s in bad)
        assert int(done[t]) + int(pending[t]) == sum(s <= t for s in bad)


def test_delta_commit_equals_gradient_commit_for_constant_lr_sgd():
    grads = jnp.asarray(np.random.default_rng(0).normal(size=(12, DIM)), jnp.float32)
    p0 = jnp.zeros(DIM)
    by_grad = optax_accum.agn(optax.sgd(0.1), 4, outer=optax.sgd(0.3))
    by_delta = optax_accum.agn(optax.sgd(0.1), 4, outer=optax.sgd(3.0), commit="delta")
    a, b = _jit_run(by_grad, p0, grads), _jit_run(by_delta, p0, grads)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 8 workers


def _worker_problem():
    """Worker w's gradient at p is a_w * (p - b_w): each worker has its own data."""
    rng = np.random.default_rng(1)
    a = rng.uniform(0.5, 2.0, size=(WORKERS, DIM)).astype(np.float32)
    b = rng.normal(size=(WORKERS, DIM)).astype(np.float32)
    return a, b


MULTI = [
    ("gradients", NpSGD(0.1, 0.9), NpSGD(0.2, 0.9)),
    ("delta", NpSGD(0.1, 0.9), NpSGD(1.6, 0.5)),
]
ROUNDS, PERIOD = 4, 3


def _multi_reference(commit, inner, outer):
    a, b = _worker_problem()
    p0 = np.linspace(-1.0, 1.0, DIM)
    hist = np_agn(
        lambda w, t, p: a[w] * (p - b[w]),
        p0,
        PERIOD,
        ROUNDS * PERIOD,
        inner,
        outer,
        commit,
        workers=WORKERS,
    )
    return [hist[r * PERIOD + PERIOD - 1][1] for r in range(ROUNDS)]


@pytest.mark.parametrize("commit,inner,outer", MULTI, ids=[m[0] for m in MULTI])
def test_eight_workers_pmap(commit, inner, outer):
    tx = optax_accum.agn(inner.optax(), PERIOD, axis_name="w", outer=outer.optax(), commit=commit)
    a, b = _worker_problem()

    def step(params, state, a, b):
        updates, state = tx.update(a * (params - b), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.pmap(step, axis_name="w")
    params = jnp.tile(jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32), (WORKERS, 1))
    state = jax.pmap(tx.init)(params)
    for r, expected in enumerate(_multi_reference(commit, inner, outer)):
        for _ in range(PERIOD):
            assert not np.any(np.asarray(state.emitted) & (np.asarray(state.count) != 0))
            params, state = step(params, state, a, b)
        centres = np.asarray(state.centre)
        assert np.all(centres == centres[0]), "workers disagree on the centre"
        np.testing.assert_allclose(centres[0], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(params), centres, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(state.global_step), r + 1)
        assert np.all(np.asarray(state.emitted))


def _mesh():
    return jax.make_mesh((WORKERS,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))


def _state_specs(tx):
    """The state's PartitionSpecs: per-worker fields over w, the centre replicated."""
    return optax_accum.state_partition_specs(tx, jnp.zeros((1, DIM)), _mesh(), param_axes=("w",))


NO_POISON = np.zeros((WORKERS, 1), bool)


def _shard_map_step(tx):
    """One AGN step under shard_map; each worker's params are a (1, DIM) block."""
    per_worker, specs = P("w"), _state_specs(tx)
    assert specs.centre == P() and specs.global_step == P()

    def step(params, state, a, b, poison):
        grads = jnp.where(poison, jnp.inf, a * (params - b))  # poison: (1, 1) per worker
        updates, state = tx.update(grads, state, params)
        every_copy = _compat.pcast_varying(state.centre, "w")
        return optax.apply_updates(params, updates), state, every_copy

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=_mesh(),
            in_specs=(per_worker, specs, per_worker, per_worker, per_worker),
            out_specs=(per_worker, specs, per_worker),
        )
    )
    return fn


def _shard_map_init(tx, p0):
    """Init from the shared initial params p0 (shape (1, DIM)), as the specs say."""
    init = jax.shard_map(tx.init, mesh=_mesh(), in_specs=P(), out_specs=_state_specs(tx))
    return jax.jit(init)(p0)


@pytest.mark.parametrize("commit,inner,outer", MULTI, ids=[m[0] for m in MULTI])
def test_eight_workers_shard_map(commit, inner, outer):
    tx = optax_accum.agn(inner.optax(), PERIOD, axis_name="w", outer=outer.optax(), commit=commit)
    a, b = _worker_problem()
    p0 = jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32)[None]
    params, state = jnp.tile(p0, (WORKERS, 1)), _shard_map_init(tx, p0)
    step = _shard_map_step(tx)
    for r, expected in enumerate(_multi_reference(commit, inner, outer)):
        for _ in range(PERIOD):
            params, state, copies = step(params, state, a, b, NO_POISON)
        copies = np.asarray(copies)
        assert np.all(copies == copies[0]), "workers disagree on the centre"
        np.testing.assert_allclose(copies[0], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(params), copies, rtol=0, atol=1e-6)
        assert int(state.global_step) == r + 1


def test_model_averaging_delta_centre_is_mean_of_workers():
    """commit="delta" with outer=sgd(period): the centre is the workers' mean."""
    tx = optax_accum.agn(optax.sgd(0.1), 2, axis_name="w", outer=optax.sgd(2.0), commit="delta")
    a, b = _worker_problem()

    def two_steps(params, state, a, b):
        for _ in range(2):
            local = params - 0.1 * a * (params - b)  # this step's local SGD result
            updates, state = tx.update(a * (params - b), state, params)
            params = optax.apply_updates(params, updates)
        return params, state, local

    params = jnp.tile(jnp.zeros(DIM, jnp.float32), (WORKERS, 1))
    state = jax.vmap(tx.init)(params)
    params, state, last_local = jax.jit(jax.vmap(two_steps, axis_name="w"))(params, state, a, b)
    np.testing.assert_allclose(
        np.asarray(state.centre[0]), np.asarray(last_local).mean(0), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("commit", ["gradients", "delta"])
def test_shard_map_init_inside_scan_keeps_types_and_branch_invariant(commit):
    """Init inside shard_map from per-worker params; a scan carries the state.

    The state's types must not change across `update` (scan rejects a carry whose
    varying axes change), and the sync predicate must be replica-invariant, so every
    worker takes the same branch around the pmean.
    """
    tx = optax_accum.agn(adam(0.1), PERIOD, axis_name="w", commit=commit)
    a, b = _worker_problem()
    predicate_types = []

    def train(params, a, b):
        params, a, b = params[0], a[0], b[0]

        def body(carry, _):
            params, state = carry
            updates, state = tx.update(a * (params - b), state, params)
            predicate_types.append(_compat.varying_axes(state.emitted))
            return (optax.apply_updates(params, updates), state), None

        (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), length=2 * PERIOD)
        return params[None], state.centre[None]  # varying: init copied the params

    fn = jax.shard_map(train, mesh=_mesh(), in_specs=P("w"), out_specs=(P("w"), P("w")))
    params = jnp.tile(jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32), (WORKERS, 1))
    params, centres = jax.jit(fn)(params, a, b)
    centres = np.asarray(centres)
    assert np.all(centres == centres[0])
    np.testing.assert_allclose(np.asarray(params), centres, rtol=0, atol=1e-6)
    assert predicate_types and all(not axes for axes in predicate_types)


def test_nonfinite_gradient_on_one_worker_is_skipped_there_only():
    """Under shard_map: the skip is local, the count is summed over workers at the sync."""
    inner, outer = NpSGD(0.1, 0.9), NpSGD(0.2)
    tx = optax_accum.agn(inner.optax(), 2, axis_name="w", outer=outer.optax(), skip_nonfinite=True)
    assert _state_specs(tx).round_nonfinite == P("w")
    a, b = _worker_problem()
    poisoned = (3, 1)  # worker 3's gradient at step 1 holds an Inf
    p0 = jnp.zeros((1, DIM), jnp.float32)
    params, state = jnp.tile(p0, (WORKERS, 1)), _shard_map_init(tx, p0)
    step = _shard_map_step(tx)
    for t in range(4):
        poison = np.array([[(w, t) == poisoned] for w in range(WORKERS)])
        params, state, copies = step(params, state, a, b, poison)
        if t == 1:  # the round with the skip just ended
            assert int(state.num_nonfinite) == 1
    expected = np_agn(
        lambda w, t, p: None if (w, t) == poisoned else a[w] * (p - b[w]),
        np.zeros(DIM),
        2,
        4,
        inner,
        outer,
        workers=WORKERS,
    )[-1][1]
    np.testing.assert_allclose(np.asarray(copies), np.tile(expected, (WORKERS, 1)), rtol=1e-5)
    assert int(state.num_nonfinite) == 1
    np.testing.assert_array_equal(np.asarray(state.round_nonfinite), 0)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((params, state)))


# --------------------------------------------------------------------------- HLO


def _entry_and_rest(hlo: str) -> tuple[str, str]:
    match = re.search(r"^ENTRY .*?^}", hlo, flags=re.M | re.S)
    assert match, "no ENTRY computation in the compiled HLO"
    return match.group(0), hlo[: match.start()] + hlo[match.end() :]


def _assert_collective_only_in_conditional(hlo: str):
    """No all-reduce in the entry computation, one behind its conditional or 0/1 loop."""
    entry, rest = _entry_and_rest(hlo)
    assert "all-reduce" not in entry, "an all-reduce runs on every step"
    assert re.search(r"\b(conditional|while)\(", entry), "the sync step is not conditional"
    assert "all-reduce" in rest, "the sync branch lost its all-reduce"


@pytest.mark.parametrize("commit", ["gradients", "delta"])
def test_hlo_pmap_all_reduce_only_inside_conditional(commit):
    tx = optax_accum.agn(adam(0.1), 4, axis_name="w", commit=commit)
    a, b = _worker_problem()

    def step(params, state, a, b):
        updates, state = tx.update(a * (params - b), state, params)
        return optax.apply_updates(params, updates), state

    params = jnp.zeros((WORKERS, DIM))
    state = jax.pmap(tx.init)(params)
    hlo = jax.pmap(step, axis_name="w").lower(params, state, a, b).compile().as_text()
    _assert_collective_only_in_conditional(hlo)


def test_hlo_shard_map_all_reduce_only_inside_conditional():
    tx = optax_accum.agn(optax.sgd(0.1, momentum=0.9), 4, axis_name="w")
    a, b = _worker_problem()
    p0 = jnp.zeros((1, DIM))
    state = _shard_map_init(tx, p0)
    params = jnp.tile(p0, (WORKERS, 1))
    hlo = _shard_map_step(tx).lower(params, state, a, b, NO_POISON).compile().as_text()
    _assert_collective_only_in_conditional(hlo)


def test_hlo_without_axis_has_no_collective():
    tx = optax_accum.agn(optax.sgd(0.1), 4)
    params = jnp.zeros(DIM)
    hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    assert "all-reduce" not in hlo


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_resume_mid_round_is_bit_exact(tmp_path):
    import orbax.checkpoint as ocp

    tx = optax_accum.agn(adam(0.05), 4, outer=optax.sgd(0.5, momentum=0.9))
    grads = jnp.asarray(np.random.default_rng(3).normal(size=(11, DIM)), jnp.float32)
    step = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
    )

    def run(params, state, gs):
        for g in gs:
            params, state = step(params, state, g)
        return params, state

    params = jnp.linspace(-1.0, 1.0, DIM, dtype=jnp.float32)
    params, state = run(params, tx.init(params), grads[:6])
    assert int(state.count) == 2  # mid-round
    straight = run(params, state, grads[6:])

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", {"params": params, "state": state})
    ckptr.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "state": state})
    restored = ckptr.restore(tmp_path / "ckpt", target)
    state = jax.tree.unflatten(jax.tree.structure(state), jax.tree.leaves(restored["state"]))
    resumed = run(restored["params"], state, grads[6:])
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- state and errors


def test_accessors_and_dtypes():
    tx = optax_accum.agn(optax.sgd(0.1), 2)
    params = {"w": jnp.zeros(2, jnp.bfloat16)}
    state = tx.init(params)
    assert state.storage["w"].dtype == jnp.float32
    assert state.centre["w"].dtype == jnp.bfloat16
    updates, state = jax.jit(tx.update)({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    assert updates["w"].dtype == jnp.bfloat16
    assert int(optax_accum.num_accumulated(state)) == 1
    assert not bool(optax_accum.has_updated(state))
    updates, state = jax.jit(tx.update)({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    assert bool(optax_accum.has_updated(state))
    assert int(optax_accum.global_step(state)) == 1
    assert int(optax_accum.num_accumulated(state)) == 0
    assert optax_accum.agn(optax.sgd(0.1), 2, commit="delta").init(params).storage == ()


def test_state_does_not_alias_params_so_both_can_be_donated():
    tx = optax_accum.agn(optax.sgd(0.1), 2)
    params = jnp.ones(DIM)
    state = tx.init(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, donate_argnums=(0, 1))
    for _ in range(5):
        params, state = step(params, state, jnp.ones(DIM))
    np.testing.assert_allclose(np.asarray(state.centre), 0.8, rtol=1e-6)


def test_missing_params_is_a_clear_error():
    tx = optax_accum.agn(optax.sgd(0.1), 2)
    state = tx.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="agn needs params"):
        jax.jit(tx.update)(jnp.ones(2), state)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"communication_period": 0}, ValueError, "communication_period must be a positive int"),
        ({"communication_period": 2.0}, TypeError, "communication_period must be a positive int"),
        ({"commit": "params"}, ValueError, 'commit must be "gradients" or "delta"'),
        ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be a bool"),
        ({"axis_name": 1.5}, TypeError, "axis_name must be None"),
        ({"accumulator_dtype": jnp.int32}, TypeError, "accumulator_dtype must be a floating"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"communication_period": 2, **kwargs}
    with pytest.raises(error, match=match):
        optax_accum.agn(optax.sgd(0.1), **kwargs)


def test_mismatched_trees_raise_at_trace_time():
    tx = optax_accum.agn(optax.sgd(0.1), 2)
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"updates\['w'\] must have shape \(2,\)"):
        tx.update({"w": jnp.zeros(3)}, state, {"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="params must have the tree structure"):
        tx.update({"w": jnp.zeros(2)}, state, {"v": jnp.zeros(2)})


def test_unbound_axis_is_a_clear_error():
    tx = optax_accum.agn(optax.sgd(0.1), 2, axis_name="w")
    state = tx.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="axis_name='w' is not bound"):
        tx.update(jnp.ones(2), state, jnp.zeros(2))


# --------------------------------------------------------------------------- baselines


def test_period_1_is_synchronous_sgd():
    """AGN with period 1 and outer = inner steps exactly like cross_shard_optimizer."""
    a, b = _worker_problem()
    trajectories = []
    for tx in (
        optax_accum.agn(optax.sgd(0.1, momentum=0.9), 1, axis_name="w"),
        optax_accum.cross_shard_optimizer(optax.sgd(0.1, momentum=0.9), "w"),
    ):

        def step(params, state, a, b, tx=tx):
            updates, state = tx.update(a * (params - b), state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(jax.vmap(step, axis_name="w"))
        params = jnp.zeros((WORKERS, DIM), jnp.float32)
        state = jax.vmap(tx.init)(params)
        history = []
        for _ in range(5):
            params, state = step(params, state, a, b)
            history.append(np.asarray(params))
        trajectories.append(np.stack(history))
    np.testing.assert_allclose(trajectories[0], trajectories[1], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- streaming

# Three leaves of different sizes; each worker w's gradient at p is a_w * (p - b_w).
STREAM_SHAPES = {"a": (3,), "b": (2, 2), "c": (5,)}


def np_streaming(grad_fn, p0, period, steps, inner, outer, commit, workers, members, delay, blend):
    """Streaming DiLoCo (arXiv 2501.18512, Algorithm 2) in float64, as the paper states it.

    `p0` is a list of leaves, `members[p]` the leaves of fragment p. Fragment p syncs at
    the local steps t = (p + 1) * period / P (mod period): each worker's pseudo-gradient
    (the centre minus its local leaves, or its gradient sum since the fragment's last
    sync, over the period) is averaged; `delay` steps later `outer` moves the fragment's
    centre with it (its own state per fragment) and every worker's leaves become
    `blend * local + (1 - blend) * centre`. A blend due at step t comes before the syncs
    of step t. Returns, after every step, the workers' local leaves, the centre, and
    whether a fragment's outer step is still pending.
    """
    count = len(members)
    offsets = [(p + 1) * period // count for p in range(count)]
    local = [[x.copy() for x in p0] for _ in range(workers)]
    slots = [[inner.init(x) for x in p0] for _ in range(workers)]
    sums = [[np.zeros_like(x) for x in p0] for _ in range(workers)]
    centre, outer_slots = [x.copy() for x in p0], [outer.init(x) for x in p0]
    pending, history = {}, []

    def apply(p, mean):
        for i, d in zip(members[p], mean, strict=True):
            u, outer_slots[i] = outer.step(d, outer_slots[i])
            centre[i] = centre[i] + u
            for w in range(workers):
                local[w][i] = blend * local[w][i] + (1 - blend) * centre[i]

    for t in range(1, steps + 1):
        for w in range(workers):
            g = grad_fn(w, t - 1, local[w])
            for i in range(len(p0)):
                u, slots[w][i] = inner.step(g[i], slots[w][i])
                local[w][i] = local[w][i] + u
                sums[w][i] = sums[w][i] + g[i]
        for p, mean in pending.pop(t, []):
            apply(p, mean)
        for p in range(count):
            if t < offsets[p] or (t - offsets[p]) % period:
                continue
            if commit == "gradients":
                mean = [
                    np.mean([sums[w][i] for w in range(workers)], 0) / period for i in members[p]
                ]
                for w, i in ((w, i) for w in range(workers) for i in members[p]):
                    sums[w][i] = np.zeros_like(sums[w][i])
            else:
                mean = [
                    np.mean([centre[i] - local[w][i] for w in range(workers)], 0) / period
                    for i in members[p]
                ]
            if delay:
                pending.setdefault(t + delay, []).append((p, mean))
            else:
                apply(p, mean)
        history.append(([[x.copy() for x in lw] for lw in local], list(centre), bool(pending)))
    return history


def _stream_problem(workers):
    rng = np.random.default_rng(2)
    a = {k: rng.uniform(0.5, 2.0, size=(workers, *s)) for k, s in STREAM_SHAPES.items()}
    b = {k: rng.normal(size=(workers, *s)) for k, s in STREAM_SHAPES.items()}
    p0 = {k: np.linspace(-1.0, 1.0, int(np.prod(s))).reshape(s) for k, s in STREAM_SHAPES.items()}
    return a, b, p0


def _members(fragments, p0):
    layout = optax_accum._streaming.layout(fragments, p0)
    return layout.members


def _stream_step(tx):
    def step(params, state, a, b):
        grads = jax.tree.map(lambda a, p, b: a * (p - b), a, params, b)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _check_against_reference(trajectory, centres, reference, workers):
    """`trajectory[t]` (the workers' params, stacked) and `centres[t]` (the centre)
    against the reference after every step; the centre where no outer step is pending
    (with a delay, agn moves the centre when the reduction is done, in the step after
    the sync, and the workers take it `delay` steps after the sync)."""
    keys = list(STREAM_SHAPES)
    for t, (local, centre, pending) in enumerate(reference):
        for i, k in enumerate(keys):
            expected = np.stack([local[w][i] for w in range(workers)])
            np.testing.assert_allclose(trajectory[k][t], expected, rtol=1e-12, atol=1e-13)
            if not pending:
                np.testing.assert_allclose(centres[k][t], centre[i], rtol=1e-12, atol=1e-13)


STREAMING = [
    # commit, delay, blend, fragments, period, workers, outer. period == fragments with a
    # delay: a fragment on every step, reduced outside any branch (`_packed_mean`).
    ("delta", 0, 0.0, 2, 4, 2, NpSGD(2.8, 0.9, nesterov=True)),
    ("gradients", 0, 0.5, "tree", 6, 3, NpSGD(0.3)),
    ("delta", 1, 0.0, 3, 3, 4, NpAdam(0.05)),
    ("gradients", 1, 0.5, "path", 4, 8, NpSGD(0.2, 0.9, nesterov=True)),
    ("delta", 2, 0.5, 3, 3, 5, NpSGD(1.5, 0.5)),
    ("gradients", 2, 0.0, 2, 6, 2, NpAdam(0.05)),
]


def _fragments_spec(spec):
    if spec == "tree":
        return {"a": 1, "b": 0, "c": 2}
    if spec == "path":
        return lambda path: int(jax.tree_util.keystr(path) == "['c']")
    return spec


@pytest.mark.parametrize(
    "commit,delay,blend,spec,period,workers,outer",
    STREAMING,
    ids=[f"{c[0]}-V{c[1]}-a{c[2]}-P{c[3]}-H{c[4]}-W{c[5]}" for c in STREAMING],
)
def test_streaming_matches_numpy_reference_in_float64(
    commit, delay, blend, spec, period, workers, outer
):
    """V in {0, 1, 2}, alpha in {0, 0.5}, both commits, SGD, Nesterov and Adam outer
    steps, 2 to 8 workers (`jax.vmap`), fragments by size, by tree and by path."""
    inner = NpSGD(0.1, 0.9)
    fragments = _fragments_spec(spec)
    steps = 2 * period + 3
    with _compat.enable_x64():
        a, b, p0 = _stream_problem(workers)
        tx = optax_accum.agn(
            inner.optax(), period, axis_name="w", outer=outer.optax(), commit=commit,
            fragments=fragments, delay=delay, blend=blend,
        )  # fmt: skip
        step = jax.vmap(_stream_step(tx), axis_name="w")

        def body(carry, _):
            params, state = step(*carry, a, b)
            return (params, state), (params, jax.tree.map(lambda c: c[0], state.centre))

        @jax.jit
        def run(params):
            state = jax.vmap(tx.init)(params)
            return jax.lax.scan(body, (params, state), length=steps)[1]

        stacked = jax.tree.map(lambda x: np.tile(x, (workers,) + (1,) * x.ndim), p0)
        trajectory, centres = jax.device_get(run(stacked))
        members = _members(fragments, p0)
        keys = list(STREAM_SHAPES)
        reference = np_streaming(
            lambda w, t, local: [a[k][w] * (local[i] - b[k][w]) for i, k in enumerate(keys)],
            [p0[k] for k in keys], period, steps, inner, outer, commit, workers, members,
            delay, blend,
        )  # fmt: skip
    _check_against_reference(trajectory, centres, reference, workers)


def _stream_mesh(n):
    return jax.make_mesh((n,), ("w",), axis_types=(jax.sharding.AxisType.Auto,))


ON_A_MESH = dict(commit="delta", delay=1, blend=0.5, fragments=3, period=3, workers=4)


def test_streaming_under_shard_map_and_jit_on_a_mesh():
    """One fragment a step (period == fragments, delay 1), 4 workers on 4 devices, in
    float64: under `jax.shard_map` (state specs from `state_partition_specs`) and under
    `jax.jit` of `jax.vmap(spmd_axis_name=...)`, each worker's params a row of an array
    sharded over the mesh axis; both equal the reference. The state is laid out like
    the params, and each step runs one all-reduce, outside any branch, of the largest
    fragment (the sync's bytes: a fragment's, not the model's)."""
    cfg = ON_A_MESH
    inner, outer = NpSGD(0.1, 0.9), NpSGD(2.1, 0.9, nesterov=True)
    steps, workers = 2 * cfg["period"] + 1, cfg["workers"]
    with _compat.enable_x64():
        a, b, p0 = _stream_problem(workers)
        tx = optax_accum.agn(
            inner.optax(), cfg["period"], axis_name="w", outer=outer.optax(),
            commit=cfg["commit"], fragments=cfg["fragments"], delay=cfg["delay"],
            blend=cfg["blend"],
        )  # fmt: skip
        mesh = _stream_mesh(workers)
        specs = optax_accum.state_partition_specs(tx, p0, mesh, param_axes=("w",))
        assert all(s == P() for s in jax.tree.leaves((specs.centre, specs.outer_state)))
        assert all(s == P("w") for s in jax.tree.leaves(specs.inner_state))
        stacked = jax.tree.map(lambda x: np.tile(x, (workers,) + (1,) * x.ndim), p0)
        host_a, host_b = a, b  # the reference's, in NumPy (no eager op on device arrays)
        with jax.set_mesh(mesh):
            rows = jax.sharding.NamedSharding(mesh, P("w"))
            stacked, a, b = jax.device_put((stacked, a, b), rows)
            # shard_map: each device one worker, its params a (1, ...) block.
            one = functools.partial(jax.tree.map, lambda x: x[0])

            def mapped(params, state, a, b):
                params, state = _stream_step(tx)(one(params), state, one(a), one(b))
                return jax.tree.map(lambda x: x[None], params), state

            per_worker = jax.tree.map(lambda _: P("w"), stacked)
            smap = jax.shard_map(
                mapped, mesh=mesh, in_specs=(per_worker, specs, per_worker, per_worker),
                out_specs=(per_worker, specs),
            )  # fmt: skip
            init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
            state = jax.jit(init)(p0)
            compiled = jax.jit(smap).lower(stacked, state, a, b).compile()
            # jit on the mesh: the workers a vmapped axis laid out over "w".
            vstep = jax.jit(jax.vmap(_stream_step(tx), axis_name="w", spmd_axis_name="w"))
            vstate = jax.jit(jax.vmap(tx.init, spmd_axis_name="w"))(stacked)
            runs = {"shard_map": (stacked, state), "jit": (stacked, vstate)}
            trajectories = {name: [] for name in runs}
            for _ in range(steps):
                runs["shard_map"] = compiled(*runs["shard_map"], a, b)
                runs["jit"] = vstep(*runs["jit"], a, b)
                for name, (params, state) in runs.items():
                    centre = jax.device_get(state.centre)  # read on the host: no eager op
                    centre = centre if name == "shard_map" else one(centre)
                    trajectories[name].append((jax.device_get(params), centre))
        vstate = runs["jit"][1]
        for leaf in jax.tree.leaves((vstate.centre, vstate.inner_state, vstate.outer_state)):
            if leaf.ndim:
                assert leaf.sharding.spec[0] == "w", leaf.sharding  # laid out like the params
        keys = list(STREAM_SHAPES)
        members = _members(cfg["fragments"], p0)
        reference = np_streaming(
            lambda w, t, local: [
                host_a[k][w] * (local[i] - host_b[k][w]) for i, k in enumerate(keys)
            ],
            [p0[k] for k in keys], cfg["period"], steps, inner, outer, cfg["commit"], workers,
            members, cfg["delay"], cfg["blend"],
        )  # fmt: skip
    for history in trajectories.values():
        trajectory = {k: np.stack([h[0][k] for h in history]) for k in keys}
        centres = {k: np.stack([h[1][k] for h in history]) for k in keys}
        _check_against_reference(trajectory, centres, reference, workers)
    largest = max(int(np.prod(s)) for s in STREAM_SHAPES.values())
    found = _hlo.collectives(compiled)
    assert [(c.opcode, c.nbytes, c.every_step) for c in found] == [
        ("all-reduce", 8 * largest, True)
    ]


def test_streaming_syncs_in_branches_and_int8_on_the_wire():
    """A sync every other step (period 4, 2 fragments) runs its reduction inside its
    fragment's branch only, and so does an unfragmented agn's sync in bfloat16; with a
    fragment every step and `communication_dtype` int8
    or float8, each step sends the fragment as an all-to-all and an all-gather of
    blocks: 1/3.94 of the bytes of the float32 all-reduce (8 workers under
    `jax.shard_map`)."""
    mesh = _stream_mesh(WORKERS)
    params = {"x": jnp.zeros((64, 256)), "y": jnp.zeros((32, 512))}  # 64 blocks each

    def compiled(**kwargs):
        tx = optax_accum.agn(optax.sgd(0.1), axis_name="w", commit="delta", **kwargs)
        specs = optax_accum.state_partition_specs(tx, params, mesh, param_axes=("w",))
        per_worker = jax.tree.map(lambda _: P("w"), params)

        def step(params, state):
            updates, state = tx.update(params, state, params)
            return optax.apply_updates(params, updates), state

        fn = jax.shard_map(
            step, mesh=mesh, in_specs=(per_worker, specs), out_specs=(per_worker, specs)
        )
        stacked = jax.tree.map(lambda x: jnp.zeros((WORKERS * x.shape[0], *x.shape[1:])), params)
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
        with jax.set_mesh(mesh):
            state = jax.eval_shape(init, params)
            return _hlo.collectives(jax.jit(fn).lower(stacked, state).compile())

    branches = compiled(communication_period=4, fragments=2, delay=1)
    assert branches and not any(c.every_step for c in branches)
    assert {c.opcode for c in branches} == {"all-reduce"}
    whole = compiled(communication_period=4, communication_dtype=jnp.bfloat16)  # no fragments
    assert {c.opcode for c in whole} == {"all-gather", "all-to-all"}
    assert not any(c.every_step for c in whole)
    plain = compiled(communication_period=2, fragments=2, delay=1)
    assert [(c.opcode, c.every_step) for c in plain] == [("all-reduce", True)]
    # Each device sends an all-reduce's result twice over a ring, an all-to-all's and an
    # all-gather's once: 1 byte a value and 4 a block of 256 against 4 bytes a value.
    sent = lambda found: sum({"all-reduce": 2}.get(c.opcode, 1) * c.nbytes for c in found)  # noqa: E731
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
        narrow = compiled(communication_period=2, fragments=2, delay=1, communication_dtype=dtype)
        assert {c.opcode for c in narrow} == {"all-gather", "all-to-all"}
        assert all(c.every_step for c in narrow)
        assert sent(narrow) / sent(plain) == (1 + 4 / 256) / 4 <= 1 / 3.9


def test_streaming_abstract_init_eager_equals_jit_and_skips_counted():
    """Init on `jax.ShapeDtypeStruct` params gives the state's shapes and dtypes; an
    eager run equals the jitted one bit for bit (2 workers under `jax.vmap`, a NaN
    gradient on one of them skipped there and counted at the next reduction)."""
    tx = optax_accum.agn(
        optax.sgd(0.1), 4, axis_name="w", outer=optax.sgd(0.5, momentum=0.9), fragments=2,
        delay=2, blend=0.5, skip_nonfinite=True,
    )  # fmt: skip
    p0 = {"a": jnp.linspace(-1.0, 1.0, 3), "b": jnp.ones((2, 2))}
    abstract = tx.init(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p0))
    concrete = tx.init(p0)
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for x, y in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete), strict=True):
        assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert len(concrete.outer_state) == 2

    def step(params, state, poison):
        grads = jax.tree.map(lambda p: jnp.where(poison, jnp.nan, p - 0.5), params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = jax.tree.map(lambda x: jnp.stack([x, -x]), p0)
    runs = {"eager": jax.vmap(step, axis_name="w"), "jit": jax.jit(jax.vmap(step, axis_name="w"))}
    ends = {}
    for name, run in runs.items():
        carry = (params, jax.vmap(tx.init)(params))
        for t in range(4):
            carry = run(*carry, jnp.asarray([t == 1, False]))
        ends[name] = carry
    for x, y in zip(*(jax.tree.leaves(e) for e in ends.values()), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    state = ends["jit"][1]
    # Sync steps 2 and 4, each reduced in the next step (delay >= 1): one done by step 4,
    # the skip of step 2 counted in it; fragment 0's centre blended in at step 4.
    np.testing.assert_array_equal(state.global_step, [1, 1])
    np.testing.assert_array_equal(state.num_nonfinite, [1, 1])
