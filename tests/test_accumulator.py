"""conditional_accumulator: TF conformance vectors, a NumPy model, anchors, devices."""

from __future__ import annotations

import warnings

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
from optax_accum import _compat, conditional_accumulator


def _feeder(tx, params):
    """A jitted `offer(grad, local_step)` returning the updates, tracking state."""
    box = {"state": tx.init(params)}
    update = jax.jit(lambda g, s, ls: tx.update(g, s, params, local_step=ls))

    def offer(grad, local_step=None):
        ls = None if local_step is None else jnp.int32(local_step)
        updates, box["state"] = update(jnp.asarray(grad, jnp.float32), box["state"], ls)
        return np.asarray(updates)

    return offer, box


def _released(tx, params, grads_and_steps):
    """Offers every (grad, local_step); returns the last updates and the state."""
    offer, box = _feeder(tx, params)
    updates = None
    for g, ls in grads_and_steps:
        updates = offer(g, ls)
    return updates, box["state"]


# --------------------------------------------------------------------------- TF vectors


def test_mean_of_two_matrices():
    tx = conditional_accumulator(optax.identity(), num_required=2)
    a = [[1, 2], [3, 4], [5, 6]]
    b = [[10, 20], [30, 40], [50, 60]]
    out, _ = _released(tx, jnp.zeros((3, 2)), [(a, 0), (b, 0)])
    np.testing.assert_allclose(out, [[5.5, 11], [16.5, 22], [27.5, 33]])


@pytest.mark.parametrize(("reduction", "expected"), [("MEAN", 15.0), ("SUM", 30.0)])
def test_mean_and_sum_across_two_windows(reduction, expected):
    tx = conditional_accumulator(optax.identity(), num_required=2, reduction=reduction)
    offer, box = _feeder(tx, jnp.zeros(()))
    offer(10.0, 0)
    np.testing.assert_allclose(offer(20.0, 0), expected)
    offer(10.0, 1)
    np.testing.assert_allclose(offer(20.0, 1), expected)
    assert int(optax_accum.global_step(box["state"])) == 2


@pytest.mark.parametrize(("reduction", "first", "second"), [("mean", 15, 25), ("sum", 30, 50)])
def test_repeated_vectors(reduction, first, second):
    tx = conditional_accumulator(optax.identity(), num_required=2, reduction=reduction)
    offer, _ = _feeder(tx, jnp.zeros(()))
    offer(10.0, 0)
    np.testing.assert_allclose(offer(20.0, 0), first)
    offer(20.0, 1)
    np.testing.assert_allclose(offer(30.0, 1), second)


def test_num_accumulated_counts_and_resets():
    tx = conditional_accumulator(optax.identity(), num_required=2)
    offer, box = _feeder(tx, jnp.zeros(()))
    counts = [int(optax_accum.num_accumulated(box["state"]))]
    for _ in range(2):
        offer(1.0, 0)
        counts.append(int(optax_accum.num_accumulated(box["state"])))
    assert counts == [0, 1, 0]  # the second accepted gradient releases and resets
    tx = conditional_accumulator(optax.identity(), num_required=5)
    offer, box = _feeder(tx, jnp.zeros(()))
    for _ in range(4):
        offer(1.0, 1)
    assert int(optax_accum.num_accumulated(box["state"])) == 4


@pytest.mark.parametrize(
    ("global_step", "expected"),
    [(1000, 1002.0), (1001, 1002.5), (1002, 1003.0), (1003, 1003.5), (1004, 1004.0)],
)
def test_set_global_step_then_only_fresh_steps_count(global_step, expected):
    # Local steps 1000..1004 carry gradients equal to their step. After
    # set_global_step(s), only steps >= s are accepted; the release is their mean.
    tx = conditional_accumulator(optax.identity(), num_required=1005 - global_step)
    offer, box = _feeder(tx, jnp.zeros(()))
    box["state"] = optax_accum.set_global_step(box["state"], global_step)
    outs = [offer(float(s), s) for s in range(1000, 1005)]
    np.testing.assert_allclose(outs[-1], expected)
    assert int(box["state"].num_dropped) == global_step - 1000


def test_stale_future_and_global_step_advance():
    tx = conditional_accumulator(optax.identity(), num_required=2)
    offer, box = _feeder(tx, jnp.zeros(()))
    box["state"] = optax_accum.set_global_step(box["state"], 5)
    offer(1.0, 4)  # stale: dropped
    assert int(optax_accum.num_accumulated(box["state"])) == 0
    offer(2.0, 5)
    np.testing.assert_allclose(offer(4.0, 100), 3.0)  # from the future: accepted
    assert int(optax_accum.global_step(box["state"])) == 6
    offer(1.0, 5)  # now stale
    assert int(optax_accum.num_accumulated(box["state"])) == 0
    offer(1.0, 6)
    assert int(optax_accum.num_accumulated(box["state"])) == 1
    assert int(box["state"].num_dropped) == 2


def test_mean_divides_by_all_accepted_when_more_than_required_arrive():
    # TF: apply 1, 2, 3, 6 then take(2) -> 3.0. Here four replicas offer at once.
    tx = conditional_accumulator(optax.identity(), num_required=2, axis_name="r")
    grads = jnp.array([1.0, 2.0, 3.0, 6.0])
    states = jax.vmap(tx.init)(jnp.zeros(4))
    out, states = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="r"))(grads, states)
    np.testing.assert_allclose(out, [3.0] * 4)
    assert np.all(np.asarray(states.global_step) == 1)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_float_dtypes_mean_of_zero_to_nine(dtype):
    with _compat.enable_x64(dtype == jnp.float64):
        tx = conditional_accumulator(optax.identity(), num_required=10)
        params = jnp.zeros((1,), dtype)
        state = tx.init(params)
        update = jax.jit(tx.update)
        for i in range(10):
            out, state = update(jnp.full((1,), i, dtype), state, params)
        assert out.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(out, np.float64), [4.5])
        expected_acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
        assert state.storage.dtype == jnp.dtype(expected_acc)


@pytest.mark.parametrize("bad", [0, -1])
def test_num_required_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"num_required must be a positive int, got {bad}"):
        conditional_accumulator(optax.identity(), num_required=bad)


# --------------------------------------------------------------------------- behaviour


def test_inner_state_untouched_and_zero_updates_on_held_steps():
    tx = conditional_accumulator(adam(0.1), num_required=3)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(2):
        before = state.inner_state
        updates, state = update({"w": jnp.ones(3)}, state, params)
        assert not bool(optax_accum.has_updated(state))
        assert np.all(np.asarray(updates["w"]) == 0)
        jax.tree.map(np.testing.assert_array_equal, before, state.inner_state)
    updates, state = update({"w": jnp.ones(3)}, state, params)
    assert bool(optax_accum.has_updated(state))
    assert int(state.inner_state[0].count) == 1


def test_low_precision_params_accumulate_in_float32_and_return_their_dtype():
    tx = conditional_accumulator(optax.sgd(1.0), num_required=2)
    params = jnp.zeros(4, jnp.bfloat16)
    state = tx.init(params)
    assert state.storage.dtype == jnp.float32
    g = jnp.full(4, 1.0 + 2.0**-9, jnp.bfloat16)  # not representable after bf16 sums
    updates, state = tx.update(g, state)
    updates, state = tx.update(g, state)
    assert updates.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(updates, np.float32), -np.asarray(g, np.float32))


def test_explicit_accumulator_dtype():
    tx = conditional_accumulator(optax.sgd(1.0), 2, accumulator_dtype=jnp.float16)
    assert tx.init(jnp.zeros(2)).storage.dtype == jnp.float16


def test_num_required_schedule():
    tx = conditional_accumulator(optax.identity(), num_required=lambda step: step + 1)
    offer, box = _feeder(tx, jnp.zeros(()))
    released = []
    for i in range(1, 7):
        out = offer(float(i))
        if bool(optax_accum.has_updated(box["state"])):
            released.append(float(out))
    # windows of 1, 2, 3 gradients: [1], [2, 3], [4, 5, 6]
    assert released == [1.0, 2.5, 5.0]


def test_set_global_step_lower_warns_and_traced_does_not():
    tx = conditional_accumulator(optax.identity(), num_required=2)
    state = optax_accum.set_global_step(tx.init(jnp.zeros(())), 5)
    with pytest.warns(UserWarning, match="lower than the current 5"):
        state = optax_accum.set_global_step(state, 3)
    assert int(optax_accum.global_step(state)) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(optax_accum.set_global_step)(state, jnp.int32(1))


def test_nonfinite_dropped_never_reaches_state_and_held_never_reaches_updates():
    tx = conditional_accumulator(optax.sgd(1.0), num_required=2)
    offer, box = _feeder(tx, jnp.zeros(2))
    offer([np.inf, np.nan], -1)  # stale: dropped
    assert np.all(np.isfinite(box["state"].storage))
    held = offer([np.inf, 1.0], 0)  # accepted and held: TF accumulates what it is given
    np.testing.assert_array_equal(held, [0.0, 0.0])


def test_skip_nonfinite_skips_and_counts():
    tx = conditional_accumulator(optax.identity(), num_required=2, skip_nonfinite=True)
    offer, box = _feeder(tx, jnp.zeros(2))
    offer([1.0, 1.0])
    offer([np.nan, 1.0])
    out = offer([3.0, 5.0])
    np.testing.assert_allclose(out, [2.0, 3.0])
    assert int(box["state"].num_nonfinite) == 1
    assert int(box["state"].num_dropped) == 0


def test_counters_saturate_instead_of_wrapping():
    tx = conditional_accumulator(optax.identity(), num_required=1)
    top = np.iinfo(np.int32).max
    state = tx.init(jnp.zeros(()))
    state = state._replace(global_step=jnp.int32(top), num_dropped=jnp.int32(top))
    update = jax.jit(lambda g, s, ls: tx.update(g, s, local_step=ls))
    _, state = update(jnp.float32(1), state, jnp.int32(top))  # accepted, releases
    assert int(state.global_step) == top
    _, state = update(jnp.float32(1), state, jnp.int32(0))  # stale
    assert int(state.num_dropped) == top


# --------------------------------------------------------------------------- a NumPy model


class _Reference:
    """docs/semantics.md §1 in float64 NumPy: accept iff local_step >= GS; release at k."""

    def __init__(self, k: int, mean: bool, shape):
        self.k, self.mean, self.gs, self.count = k, mean, 0, 0
        self.acc = np.zeros(shape)

    def offer(self, grad, local_step):
        if local_step < self.gs:
            return np.zeros_like(self.acc)
        self.acc = self.acc + grad
        self.count += 1
        if self.count < self.k:
            return np.zeros_like(self.acc)
        out = self.acc / self.count if self.mean else self.acc
        self.gs, self.count, self.acc = self.gs + 1, 0, np.zeros_like(self.acc)
        return out


_event = st.one_of(
    st.tuples(
        st.just("offer"),
        st.lists(st.integers(-8, 8), min_size=3, max_size=3),
        st.integers(-2, 2),
    ),
    st.tuples(st.just("set"), st.integers(0, 6), st.just(0)),
)


@settings(max_examples=examples(40), deadline=None)
@given(
    k=st.integers(1, 4),
    mean=st.booleans(),
    events=st.lists(_event, min_size=1, max_size=25),
)
def test_matches_numpy_reference(k, mean, events):
    tx = conditional_accumulator(optax.identity(), k, reduction="mean" if mean else "sum")
    ref = _Reference(k, mean, (3,))
    offer, box = _feeder(tx, jnp.zeros(3))
    for kind, a, b in events:
        if kind == "set":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                box["state"] = optax_accum.set_global_step(box["state"], a)
            ref.gs = a
            continue
        grad = np.asarray(a, np.float64) / 4  # exact in float32
        local_step = ref.gs + b  # relative tags reach both stale and future cases
        np.testing.assert_allclose(offer(grad, local_step), ref.offer(grad, local_step))
        assert int(optax_accum.global_step(box["state"])) == ref.gs
        assert int(optax_accum.num_accumulated(box["state"])) == ref.count
    np.testing.assert_allclose(optax_accum.accumulated(box["state"]), ref.acc)


# --------------------------------------------------------------------------- anchors


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_optax_multisteps_when_nothing_is_stale(inner, reduction):
    make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: adam(0.05)}[inner]
    k = 3
    ours = conditional_accumulator(make(), k, reduction=reduction)
    theirs = optax.MultiSteps(make(), k, use_grad_mean=reduction == "mean")
    rng = np.random.default_rng(0)
    p_ours = p_theirs = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    s_ours, s_theirs = ours.init(p_ours), theirs.init(p_theirs)
    step_ours = jax.jit(ours.update)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps itself is not strict-clean
        step_theirs = jax.jit(theirs.update)
        for _ in range(4 * k):
            g = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
            u_ours, s_ours = step_ours(g, s_ours, p_ours)
            u_theirs, s_theirs = step_theirs(g, s_theirs, p_theirs)
            p_ours = optax.apply_updates(p_ours, u_ours)
            p_theirs = optax.apply_updates(p_theirs, u_theirs)
    np.testing.assert_allclose(p_ours["w"], p_theirs["w"], rtol=1e-5, atol=1e-6)


def test_equals_sgd_on_the_concatenated_batch():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(12, 3)), rng.normal(size=(12,))
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731
    w0 = jnp.zeros(3)
    tx = conditional_accumulator(optax.sgd(0.1), num_required=4)
    state, w = tx.init(w0), w0
    xs, ys = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    for part in range(4):
        g = jax.grad(loss)(w, xs[3 * part : 3 * part + 3], ys[3 * part : 3 * part + 3])
        u, state = tx.update(g, state, w)
        w = optax.apply_updates(w, u)
    expected = w0 - 0.1 * jax.grad(loss)(w0, xs, ys)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- 8 devices

# Offsets from the global step: replicas 2 and 5 always lag one step behind.
_STALE = np.array([0, 0, -1, 0, 0, -1, 0, 0], np.int32)


def _expected_shared(grads_per_round, k):
    """NumPy: accepted replica gradients summed over rounds until >= k; SGD(1)."""
    acc, count, out = np.zeros(2), 0, []
    for grads, steps in grads_per_round:
        fresh = steps >= 0
        acc, count = acc + grads[fresh].sum(0), count + int(fresh.sum())
        if count >= k:
            out.append(-acc / count)
            acc, count = np.zeros(2), 0
        else:
            out.append(np.zeros(2))
    return out


def _rounds():
    rng = np.random.default_rng(2)
    return [(rng.integers(-4, 4, size=(8, 2)).astype(np.float64), _STALE) for _ in range(3)]


def test_shared_accumulator_under_pmap():
    tx = conditional_accumulator(optax.sgd(1.0), num_required=10, axis_name="d")
    states = jax.pmap(tx.init)(jnp.zeros((8, 2)))
    step = jax.pmap(lambda g, s, ls: tx.update(g, s, local_step=ls), axis_name="d")
    for (grads, steps), expected in zip(_rounds(), _expected_shared(_rounds(), 10), strict=True):
        tags = np.asarray(states.global_step) + steps
        out, states = step(jnp.asarray(grads, jnp.float32), states, jnp.asarray(tags))
        np.testing.assert_allclose(out, np.broadcast_to(expected, (8, 2)), rtol=1e-6)
    assert np.all(np.asarray(states.num_dropped) == 6)


def test_shared_accumulator_under_shard_map():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = conditional_accumulator(optax.sgd(1.0), num_required=10, axis_name="d")
    state = tx.init(jnp.zeros(2))
    spec = jax.tree.map(lambda _: P(), state)._replace(storage=P("d"))
    state = state._replace(storage=jnp.zeros(16))  # per-replica sums, stacked

    def body(g, s, ls):
        return tx.update(g.reshape(2), s, local_step=ls[0])

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("d"), spec, P("d")), out_specs=(P(), spec))
    )
    for (grads, steps), expected in zip(_rounds(), _expected_shared(_rounds(), 10), strict=True):
        tags = jnp.asarray(int(state.global_step) + steps)
        out, state = step(jnp.asarray(grads.reshape(-1), jnp.float32), state, tags)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert int(state.num_dropped) == 6


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_required": 1.5}, TypeError, "num_required must be a positive int, got 1.5"),
        ({"num_required": True}, TypeError, "num_required must be a positive int"),
        ({"num_required": 2, "reduction": "median"}, ValueError, "reduction must be"),
        ({"num_required": 2, "accumulator_dtype": jnp.int32}, TypeError, "floating dtype"),
        ({"num_required": 2, "axis_name": ["d"]}, TypeError, "axis_name must be"),
        ({"num_required": 2, "skip_nonfinite": 1}, TypeError, "skip_nonfinite must be a bool"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        conditional_accumulator(optax.identity(), **kwargs)


@pytest.mark.parametrize(
    ("grads", "local_step", "error", "match"),
    [
        ({"w": jnp.zeros(3), "b": jnp.zeros(1)}, None, ValueError, "tree structure"),
        ({"w": jnp.zeros(4)}, None, ValueError, r"updates\['w'\] must have shape \(3,\)"),
        ({"w": jnp.zeros(3, jnp.int32)}, None, TypeError, "must be floating"),
        ({"w": jnp.zeros(3)}, 1.0, TypeError, "local_step must be an integer scalar"),
        ({"w": jnp.zeros(3)}, jnp.zeros(2, jnp.int32), ValueError, "got shape"),
        ({"w": jnp.zeros(3)}, jnp.float32(1), TypeError, "got dtype float32"),
    ],
)
def test_bad_updates_raise_at_trace_time(grads, local_step, error, match):
    tx = conditional_accumulator(optax.identity(), num_required=2)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    with pytest.raises(error, match=match):
        jax.jit(lambda g, s: tx.update(g, s, params, local_step=local_step))(grads, state)


def test_unbound_axis_name_is_a_clear_error():
    tx = conditional_accumulator(optax.identity(), num_required=2, axis_name="nowhere")
    state = tx.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="axis_name='nowhere' is not bound"):
        jax.jit(tx.update)(jnp.zeros(2), state)
