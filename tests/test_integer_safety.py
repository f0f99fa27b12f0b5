"""Counters never overflow or wrap: they stop at the int32 maximum, as
`optax.safe_increment` does, and decisions made from them stay right there.

For every stateful transform, each counter (global_step, count, num_dropped,
num_nonfinite, num_overflowed, the sparse rows' touch counts) is set just below
int32 max and driven past it under `jax.jit`, alone and, where the increment is a
cross-replica sum, from 2 replicas at once. Step arithmetic (the staleness lag) and
step arguments beyond int32 (Python ints, NumPy int64) saturate instead of wrapping.
The host accumulators count with Python ints, which do not overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum
from optax_accum import IndexedSlices

MAX = int(np.iinfo(np.int32).max)
MIN = int(np.iinfo(np.int32).min)
SGD = optax.sgd(1.0)


def _at(state, **fields):
    """`state` with the given counters set (as int32 scalars, or arrays)."""
    return state._replace(**{k: jnp.asarray(v, jnp.int32) for k, v in fields.items()})


def _safe(value: int, times: int) -> list[int]:
    """The counter after 1..times `optax.safe_increment`s from `value`."""
    out, c = [], jnp.asarray(value, jnp.int32)
    for _ in range(times):
        c = optax.safe_increment(c)
        out.append(int(c))
    return out


def _drive(tx, state, grads, steps, params=None):
    """Runs `tx.update` under jit for each local step in `steps`; returns the states."""
    update = jax.jit(lambda g, s, p, ls: tx.update(g, s, p, local_step=ls))
    states = []
    for ls in steps:
        _, state = update(grads, state, params, ls)
        states.append(state)
    return states


def _field(states, name) -> list[int]:
    return [int(getattr(s, name)) for s in states]


def test_safe_helper_matches_optax():
    assert _safe(MAX - 2, 4) == [MAX - 1, MAX, MAX, MAX]


# --------------------------------------------------------------------------- dense accumulator


def test_accumulator_global_step_saturates_and_keeps_accepting():
    tx = optax_accum.conditional_accumulator(SGD, 1)
    state = _at(tx.init(jnp.zeros(2)), global_step=MAX - 2)
    states = _drive(tx, state, jnp.ones(2), [MAX] * 4)  # tagged with the max step
    assert _field(states, "global_step") == _safe(MAX - 2, 4)
    assert _field(states, "num_dropped") == [0, 0, 0, 0]  # MAX >= MAX: never stale
    assert all(bool(s.emitted) for s in states)


def test_accumulator_count_saturates_at_max_and_releases():
    tx = optax_accum.conditional_accumulator(SGD, lambda step: MAX, reduction="sum")
    state = _at(tx.init(jnp.zeros(2)), count=MAX - 2)
    states = _drive(tx, state, jnp.ones(2), [0, 0, 1])
    assert _field(states, "count") == [MAX - 1, 0, 1]  # reached MAX: released, reset
    assert _field(states, "global_step") == [0, 1, 1]


@pytest.mark.parametrize("field", ["num_dropped", "num_nonfinite"])
def test_accumulator_drop_counters_saturate(field):
    tx = optax_accum.conditional_accumulator(SGD, 2, skip_nonfinite=True)
    state = _at(tx.init(jnp.zeros(2)), global_step=5, **{field: MAX - 2})
    if field == "num_dropped":
        grads, steps = jnp.ones(2), [4] * 4  # stale
    else:
        grads, steps = jnp.array([np.nan, 1.0], np.float32), [5] * 4
    states = _drive(tx, state, grads, steps)
    assert _field(states, field) == _safe(MAX - 2, 4)
    assert _field(states, "count") == [0] * 4


def test_accumulator_cross_replica_increments_saturate():
    """Two replicas add 2 at once: MAX - 1 + 2 stops at MAX instead of wrapping."""
    tx = optax_accum.conditional_accumulator(SGD, 2, axis_name="r", skip_nonfinite=True)
    step = jax.jit(
        jax.vmap(
            lambda g, s, ls: tx.update(g, s, local_step=ls), axis_name="r", in_axes=(0, 0, None)
        )
    )
    init = jax.vmap(tx.init)(jnp.zeros((2, 3)))
    fields = dict(global_step=jnp.full(2, 7), num_dropped=jnp.full(2, MAX - 1))
    state = init._replace(**{k: v.astype(jnp.int32) for k, v in fields.items()})
    state = state._replace(num_nonfinite=jnp.full(2, MAX - 1, jnp.int32))
    _, state = step(jnp.ones((2, 3)), state, 6)  # both stale
    np.testing.assert_array_equal(np.asarray(state.num_dropped), [MAX, MAX])
    _, state = step(jnp.full((2, 3), np.inf, np.float32), state, 7)  # both non-finite
    np.testing.assert_array_equal(np.asarray(state.num_nonfinite), [MAX, MAX])


# --------------------------------------------------------------------------- sparse accumulator


def _sparse_grad(ids, value=1.0):
    """A gradient of the given ids, padded to three rows with the padding id 6."""
    ids = jnp.asarray(list(ids) + [6] * (3 - len(ids)), jnp.int32)
    return IndexedSlices(ids, jnp.full((3, 2), value, jnp.float32), (6, 2))


_SPARSE = optax_accum.sparse_conditional_accumulator(
    optax_accum.sparse_sgd(1.0), 1, capacity=2, skip_nonfinite=True
)
# One compiled update for every counter below: the gradients share one shape.
_sparse_update = jax.jit(lambda g, s, p, ls: _SPARSE.update(g, s, p, local_step=ls))


@pytest.mark.parametrize(
    "field", ["global_step", "num_dropped", "num_nonfinite", "num_overflowed", "num_out_of_range"]
)
def test_sparse_counters_saturate(field):
    state = _at(_SPARSE.init(jnp.zeros((6, 2))), **{field: MAX - 2})
    grads, steps = _sparse_grad([0]), [MAX] * 4  # accepted, released each time
    if field == "num_dropped":
        state = _at(state, global_step=5)
        steps = [4] * 4
    elif field == "num_nonfinite":
        grads = _sparse_grad([0], np.nan)
    elif field == "num_overflowed":
        grads = _sparse_grad([0, 1, 2])  # three rows > capacity 2
    elif field == "num_out_of_range":
        grads = _sparse_grad([0, -1])  # one row is ignored (and counted) per update
    states = []
    for ls in steps:
        _, state = _sparse_update(grads, state, None, ls)
        states.append(state)
    assert _field(states, field) == _safe(MAX - 2, 4)


def test_sparse_count_and_row_touches_reach_max_without_wrapping():
    """MEAN divides a row by its touches: at int32 max it is still a positive count."""
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), lambda step: MAX, capacity=2
    )
    state = tx.init(jnp.zeros((6, 2)))
    _, state = jax.jit(tx.update)(_sparse_grad([3]), state)
    (buffer,) = [b for b in jax.tree.leaves(state.storage, is_leaf=lambda x: hasattr(x, "touches"))]
    buffer = buffer._replace(touches=buffer.touches.at[0].set(MAX - 1))
    state = _at(state, count=MAX - 1)._replace(storage=buffer)
    updates, state = jax.jit(tx.update)(_sparse_grad([3]), state)
    assert int(optax_accum.global_step(state)) == 1 and int(state.count) == 0
    row = np.asarray(updates.to_dense())[3]
    assert np.all(row < 0) and np.all(np.isfinite(row))  # -(2 / MAX) per element


# --------------------------------------------------------------------------- agn


def test_agn_global_step_and_nonfinite_count_saturate():
    tx = optax_accum.agn(SGD, 1, skip_nonfinite=True)
    params = jnp.zeros(2)
    state = _at(tx.init(params), global_step=MAX - 2, num_nonfinite=MAX - 2)
    states = _drive(tx, state, jnp.array([np.inf, 1.0], np.float32), [0] * 4, params)
    assert _field(states, "global_step") == _safe(MAX - 2, 4)
    assert _field(states, "num_nonfinite") == _safe(MAX - 2, 4)


def test_agn_longest_period_syncs_at_int32_max():
    tx = optax_accum.agn(SGD, MAX)
    params = jnp.zeros(2)
    state = _at(tx.init(params), count=MAX - 2)
    states = _drive(tx, state, jnp.ones(2), [0] * 3, params)
    assert _field(states, "count") == [MAX - 1, 0, 1]
    assert _field(states, "global_step") == [0, 1, 1]


# --------------------------------------------------------------------------- drop_stale_gradients


def test_drop_stale_counters_saturate():
    tx = optax_accum.drop_stale_gradients(SGD, 0)
    state = _at(tx.init(jnp.zeros(2)), global_step=MAX - 2, num_dropped=MAX - 2)
    accepted = _drive(tx, state, jnp.ones(2), [MAX - 2, MAX - 1, MAX, MAX])
    assert _field(accepted, "global_step") == _safe(MAX - 2, 4)
    dropped = _drive(tx, accepted[-1], jnp.ones(2), [0] * 4)
    assert _field(dropped, "num_dropped") == _safe(MAX - 2, 4)


@pytest.mark.parametrize(
    "global_step, local_step, staleness, accepted",
    [
        (MAX, MIN, 10, False),  # lag 2**32 - 1 would wrap to -1: accepted by mistake
        (MIN, MAX, 0, True),  # lag -(2**32 - 1) would wrap to 1: dropped by mistake
        (MAX, 0, MAX, True),  # lag MAX <= MAX
        (MAX, -1, MAX - 1, False),  # lag MAX + 1 saturates to MAX > MAX - 1
    ],
    ids=["max-min", "min-max", "lag-max", "lag-beyond-max"],
)
def test_drop_stale_lag_saturates_instead_of_wrapping(global_step, local_step, staleness, accepted):
    tx = optax_accum.drop_stale_gradients(SGD, staleness)
    state = _at(tx.init(jnp.zeros(2)), global_step=global_step)
    (after,) = _drive(tx, state, jnp.ones(2), [local_step])
    assert bool(after.emitted) is accepted


# --------------------------------------------------------------------------- step arguments


@pytest.mark.parametrize(
    "local_step",
    [2**40, np.int64(2**40), np.array(2**40, np.int64)],
    ids=["python-int", "numpy-int64", "numpy-0d-int64-array"],
)
def test_local_step_beyond_int32_saturates_instead_of_wrapping(local_step):
    """A step from the far future stays in the future: clipped to int32 max, never 0."""
    tx = optax_accum.conditional_accumulator(SGD, 2)
    state = _at(tx.init(jnp.zeros(2)), global_step=7)
    _, state = tx.update(jnp.ones(2), state, local_step=local_step)
    assert int(optax_accum.num_accumulated(state)) == 1 and int(state.num_dropped) == 0
    later = optax_accum.set_global_step(state, local_step)
    assert int(optax_accum.global_step(later)) == MAX


def test_host_counters_are_python_ints_that_do_not_wrap():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(1,))
    acc.set_global_step(2**40)
    assert not acc.apply_grad(np.ones(1, np.float32), local_step=MAX)  # stale
    assert acc.apply_grad(np.ones(1, np.float32), local_step=2**40)
    assert float(acc.take_grad(1, timeout=10.0)[0]) == 1.0
    assert (acc.global_step, acc.num_dropped) == (2**40 + 1, 1)


def test_agn_round_nonfinite_summed_over_replicas_saturates():
    """Each replica skipped MAX gradients in a MAX-step round: the sum stops at MAX."""
    tx = optax_accum.agn(SGD, MAX, axis_name="r", skip_nonfinite=True)
    step = jax.jit(jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="r"))
    params = jnp.zeros((2, 3))
    state = jax.vmap(tx.init)(params)
    state = state._replace(
        count=jnp.full(2, MAX - 1, jnp.int32),
        round_nonfinite=jnp.full((2, 1), MAX - 1, jnp.int32),
    )
    _, state = step(jnp.full((2, 3), np.nan, np.float32), state, params)  # syncs
    np.testing.assert_array_equal(np.asarray(optax_accum.global_step(state)), [1, 1])
    np.testing.assert_array_equal(np.asarray(state.num_nonfinite), [MAX, MAX])
    np.testing.assert_array_equal(np.asarray(state.round_nonfinite), [[0], [0]])


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "make",
    [
        lambda n: optax_accum.conditional_accumulator(SGD, n),
        lambda n: optax_accum.sparse_conditional_accumulator(SGD, n, capacity=4),
        lambda n: optax_accum.sparse_conditional_accumulator(SGD, 2, capacity=n),
        lambda n: optax_accum.agn(SGD, n),
        lambda n: optax_accum.drop_stale_gradients(SGD, n),
    ],
    ids=["num_required", "sparse-num_required", "capacity", "communication_period", "staleness"],
)
@pytest.mark.parametrize("value", [2**31, 2**40, np.int64(2**31)], ids=["2**31", "2**40", "int64"])
def test_python_ints_beyond_int32_are_refused_at_construction(make, value):
    with pytest.raises(ValueError, match=r"2\*\*31"):
        make(value)


def test_staleness_at_the_int32_limits_is_accepted():
    for staleness in (MAX, MIN):
        optax_accum.drop_stale_gradients(SGD, staleness)


@pytest.mark.parametrize(
    "staleness, local_step, accepted",
    [
        (np.uint32(2**32 - 1), 0, True),  # would wrap to -1 and drop everything
        (np.uint32(2**31), 0, True),  # would wrap to int32 min
        (np.int64(2**40), -5, True),
    ],
    ids=["uint32-max", "uint32-2**31", "int64"],
)
def test_staleness_array_beyond_int32_saturates(staleness, local_step, accepted):
    with jax.enable_x64(True):
        tx = optax_accum.drop_stale_gradients(SGD, jnp.asarray(staleness))
        state = _at(tx.init(jnp.zeros(2)), global_step=100)
        _, state = jax.jit(lambda s: tx.update(jnp.ones(2), s, local_step=local_step))(state)
    assert bool(state.emitted) is accepted


# --------------------------------------------------------------------------- integer params


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax_accum.conditional_accumulator(SGD, 2),
        lambda: optax_accum.sparse_conditional_accumulator(SGD, 2, capacity=4),
        lambda: optax_accum.agn(SGD, 2),
        lambda: optax_accum.drop_stale_gradients(SGD, 1),
        lambda: optax_accum.cross_shard_optimizer(SGD, "i"),
    ],
    ids=["accumulator", "sparse", "agn", "drop_stale", "cross_shard_optimizer"],
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_params_are_refused_at_init(make, dtype):
    params = {"w": jnp.zeros(3), "steps": jnp.zeros(2, dtype)}
    with pytest.raises(TypeError, match=r"params\['steps'\] must be floating"):
        make().init(params)


@pytest.mark.parametrize(
    "staleness, local_step, accepted",
    [
        (np.array(2**40), -5, True),  # cast to int32 it would wrap to 0: dropped
        (np.array(2**32 + 1, np.int64), -5, True),  # would wrap to 1
        (np.array(-(2**40)), 100, False),  # saturates at int32 min: drops even lag 0
        (np.array(2**31, np.uint32), -5, True),  # would wrap to int32 min
    ],
    ids=["int64-2**40", "int64-2**32+1", "int64-minus-2**40", "uint32-2**31"],
)
def test_numpy_staleness_beyond_int32_saturates_without_x64(staleness, local_step, accepted):
    """A NumPy integer array, given while JAX runs in 32 bits, saturates as a JAX
    array does under x64."""
    tx = optax_accum.drop_stale_gradients(SGD, staleness)
    state = _at(tx.init(jnp.zeros(2)), global_step=100)
    _, state = jax.jit(lambda s: tx.update(jnp.ones(2), s, local_step=local_step))(state)
    assert bool(state.emitted) is accepted


@pytest.mark.parametrize(
    "staleness, accepted_lags",
    [(1.5, [0, 1]), (0.0, [0]), (-0.5, []), (2.999, [0, 1, 2]), (float("inf"), [0, 1, 2, 3])],
)
def test_a_python_float_staleness_is_accepted_like_a_float_array(staleness, accepted_lags):
    """The lag is an integer, so a float staleness s accepts the lags up to floor(s),
    exactly as the same value in a float32 array does."""
    for value in (staleness, jnp.float32(staleness)):
        tx = optax_accum.drop_stale_gradients(SGD, value)
        update = jax.jit(lambda s, ls, tx=tx: tx.update(jnp.ones(2), s, local_step=ls)[1])
        got = [
            lag
            for lag in range(4)
            if bool(update(_at(tx.init(jnp.zeros(2)), global_step=10), 10 - lag).emitted)
        ]
        assert got == accepted_lags, value


def _uint32_beyond(step):
    return jnp.where(step >= 0, jnp.uint32(2**32 - 1), jnp.uint32(2))


@pytest.mark.parametrize(
    "schedule",
    [
        lambda step: 2**31,  # a Python int: OverflowError inside JAX
        lambda step: 2**40,
        lambda step: np.int64(2**40),
        lambda step: np.array(2**33, np.int64),
        _uint32_beyond,  # would wrap to -1, clipped to 1: a release on every step
        lambda step: jnp.where(step >= 0, jnp.uint32(2**31), jnp.uint32(2)),
    ],
    ids=[
        "python-2**31",
        "python-2**40",
        "numpy-int64",
        "numpy-int64-array",
        "uint32-max",
        "uint32-2**31",
    ],
)
def test_a_num_required_schedule_beyond_int32_saturates(schedule):
    """A release needs int32-max gradients: three gradients are held, none released."""
    for make in (
        lambda: optax_accum.conditional_accumulator(SGD, schedule),
        lambda: optax_accum.sparse_conditional_accumulator(SGD, schedule, capacity=2),
    ):
        tx = make()
        step = jax.jit(lambda s, tx=tx: tx.update(jnp.ones(2), s)[1])
        state = tx.init(jnp.zeros(2))
        for _ in range(3):
            state = step(state)
        assert int(optax_accum.global_step(state)) == 0
        assert int(optax_accum.num_accumulated(state)) == 3


def test_a_num_required_schedule_beyond_int32_under_x64_saturates():
    with jax.enable_x64(True):
        tx = optax_accum.conditional_accumulator(
            SGD, lambda step: jnp.int64(2**40) + step.astype(jnp.int64)
        )
        state = tx.init(jnp.zeros(2))
        state = jax.jit(lambda s: tx.update(jnp.ones(2), s)[1])(state)
    assert int(optax_accum.global_step(state)) == 0
    assert int(optax_accum.num_accumulated(state)) == 1


def test_a_num_required_schedule_at_int32_max_is_int32_max():
    from optax_accum import _counters

    required = _counters.num_required_fn(lambda step: 2**40)
    assert int(jax.jit(required)(jnp.int32(0))) == MAX
    assert int(_counters.num_required_fn(lambda step: -(2**40))(jnp.int32(0))) == 1
