"""sparse_conditional_accumulator and sparse_sgd: TF vectors, a NumPy model, devices."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import examples, lenient
from _compiled import compiled_once
from _hlo import AS_USERS_COMPILE, instructions
from _matrix import pairwise
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import IndexedSlices, sparse_conditional_accumulator
from optax_accum.sparse import DenseRows

ROWS = 6  # table rows in the small tests; id 6 is padding


def _g(ids, rows, shape=(ROWS, 2)):
    return IndexedSlices(jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.float32), shape)


def _feeder(tx, params):
    """A jitted `offer(grad, local_step)` returning the updates, tracking state."""
    box = {"state": tx.init(params)}
    update = jax.jit(lambda g, s, ls: tx.update(g, s, params, local_step=ls))

    def offer(grad, local_step=None):
        ls = None if local_step is None else jnp.int32(local_step)
        updates, box["state"] = update(grad, box["state"], ls)
        return updates

    return offer, box


def _rows(u: IndexedSlices) -> tuple[list, np.ndarray]:
    """The non-padding (ids, values) of an emitted IndexedSlices; checks the padding."""
    ids, vals = np.asarray(u.indices), np.asarray(u.values)
    real = ids < u.dense_shape[0]
    assert np.all(real[: real.sum()]), f"padding must come last: {ids}"
    assert np.all(np.diff(ids[real]) > 0), f"ids must be sorted and unique: {ids}"
    assert np.all(ids[~real] == u.dense_shape[0]) and np.all(vals[~real] == 0)
    return ids[real].tolist(), vals[real]


# --------------------------------------------------------------------------- TF vectors


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [("MEAN", [[0.5, 0.5], [0, 2], [3, 0]]), ("SUM", [[1, 1], [0, 2], [3, 0]])],
)
def test_two_gradients_per_row_mean_and_sum(reduction, expected):
    tx = sparse_conditional_accumulator(
        optax.identity(), 2, capacity=4, reduction=reduction, sparse=True
    )
    offer, box = _feeder(tx, jnp.zeros((ROWS, 2)))
    assert _rows(offer(_g([0, 1], [[1, 0], [0, 2]]), 0))[0] == []
    ids, vals = _rows(offer(_g([0, 2], [[0, 1], [3, 0]]), 0))
    assert ids == [0, 1, 2]
    np.testing.assert_allclose(vals, expected)
    # The next window, tagged with local step 1.
    offer(_g([0, 1], [[10, 0], [0, 20]]), 1)
    ids, vals = _rows(offer(_g([0, 2], [[0, 10], [30, 0]]), 1))
    scale = 1 if reduction == "SUM" else 0.5
    np.testing.assert_allclose(vals, np.array([[10, 10], [0, 20], [30, 0]]) * [[scale], [1], [1]])
    assert int(optax_accum.global_step(box["state"])) == 2


def test_each_row_divided_by_the_gradients_that_touched_it():
    tx = sparse_conditional_accumulator(optax.identity(), 3, capacity=4, sparse=True)
    offer, _ = _feeder(tx, jnp.zeros((ROWS, 2)))
    offer(_g([0, 1], [[3, 3], [6, 6]]))
    offer(_g([1], [[3, 3]]))
    ids, vals = _rows(offer(_g([1, 3], [[0, 0], [9, 9]])))
    assert ids == [0, 1, 3]
    np.testing.assert_allclose(vals, [[3, 3], [3, 3], [9, 9]])


@pytest.mark.parametrize(("reduction", "expected"), [("MEAN", 55.0), ("SUM", 550.0)])
def test_ten_replicas_offer_diagonals(reduction, expected):
    """TF's ten threads applying diag(x, x), as ten replicas of one axis."""
    tx = sparse_conditional_accumulator(
        optax.identity(), 10, capacity=2, reduction=reduction, sparse=True, axis_name="r"
    )
    xs = jnp.arange(10, 110, 10, dtype=jnp.float32)
    params = jnp.zeros((2, 2))

    def offer(x):
        g = IndexedSlices(jnp.array([0, 1]), jnp.array([[x, 0.0], [0.0, x]]), (2, 2))
        return tx.update(g, tx.init(params), params)[0]

    u = jax.jit(jax.vmap(offer, axis_name="r"))(xs)
    np.testing.assert_array_equal(u.indices, np.tile([0, 1], (10, 1)))
    np.testing.assert_allclose(u.values[3], [[expected, 0], [0, expected]])


def test_blocking_take_of_three():
    tx = sparse_conditional_accumulator(optax.identity(), 3, capacity=2, sparse=True)
    offer, _ = _feeder(tx, jnp.zeros((ROWS, 2)))
    for x in (10.0, 20.0):
        assert _rows(offer(_g([0], [[0, x]])))[0] == []
    ids, vals = _rows(offer(_g([0], [[0, 30.0]])))
    assert ids == [0]
    np.testing.assert_allclose(vals, [[0, 20]])


def test_stale_gradients_are_dropped_future_ones_accepted():
    tx = sparse_conditional_accumulator(optax.identity(), 2, capacity=2, sparse=True)
    offer, box = _feeder(tx, jnp.zeros((ROWS, 2)))
    box["state"] = optax_accum.set_global_step(box["state"], 5)
    offer(_g([1], [[9.0, 9.0]]), 4)
    assert (
        int(box["state"].num_dropped) == 1 and int(optax_accum.num_accumulated(box["state"])) == 0
    )
    offer(_g([1], [[2.0, 2.0]]), 5)
    assert int(optax_accum.num_accumulated(box["state"])) == 1
    ids, vals = _rows(offer(_g([1], [[4.0, 4.0]]), 100))
    assert ids == [1] and bool(optax_accum.has_updated(box["state"]))
    np.testing.assert_allclose(vals, [[3.0, 3.0]])
    assert int(optax_accum.global_step(box["state"])) == 6
    offer(_g([1], [[1.0, 1.0]]), 5)
    offer(_g([2], [[1.0, 1.0]]), 6)
    assert int(box["state"].num_dropped) == 2
    assert int(optax_accum.num_accumulated(box["state"])) == 1
    assert not bool(optax_accum.has_updated(box["state"]))


def test_empty_gradient_is_accepted_and_counts():
    """An empty gradient to a row buffer ("s") and to a dense leaf ("d"): counted, and a
    window of them releases no rows (the property test below pads its empty gradients,
    so this is where a zero-row gradient reaches both kinds of leaf)."""
    tx = sparse_conditional_accumulator(
        optax.identity(), 2, capacity=2, sparse={"s": True, "d": False}
    )
    offer, box = _feeder(tx, {"s": jnp.zeros((ROWS, 2)), "d": jnp.zeros((ROWS, 2))})
    empty = IndexedSlices(jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)), (ROWS, 2))
    offer({"s": empty, "d": empty})
    assert int(optax_accum.num_accumulated(box["state"])) == 1
    assert type(box["state"].storage["d"]).__name__ == "DenseRows"
    u = offer({"s": empty, "d": empty})
    assert bool(box["state"].emitted)
    assert _rows(u["s"])[0] == []
    np.testing.assert_array_equal(_dense_meaning(u["d"]), np.zeros((ROWS, 2)))


def test_duplicates_sum_and_count_once_unsorted_ids_come_back_sorted():
    tx = sparse_conditional_accumulator(optax.identity(), 2, capacity=3, sparse=True)
    offer, _ = _feeder(tx, jnp.zeros((ROWS, 2)))
    offer(_g([2, 0, 2], [[1, 0], [5, 5], [2, 0]]))  # row 2 gets [3, 0], counted once
    ids, vals = _rows(offer(_g([0, 2], [[1, 1], [1, 2]])))
    assert ids == [0, 2]  # TF would return [0, 2, 0] for unsorted input
    np.testing.assert_allclose(vals, [[3, 3], [2, 1]])


def test_out_of_range_and_negative_ids_are_padding():
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=2, sparse=True)
    offer, _ = _feeder(tx, jnp.zeros((ROWS, 2)))
    ids, vals = _rows(offer(_g([-1, 4, ROWS, 99], [[1, 1], [2, 2], [3, 3], [4, 4]])))
    assert ids == [4]
    np.testing.assert_allclose(vals, [[2, 2]])


# --------------------------------------------------------------------------- capacity


def test_overflowing_gradient_is_rejected_whole():
    params = {"a": jnp.zeros((ROWS, 2)), "b": jnp.zeros((ROWS, 1)), "d": jnp.zeros(2)}
    tx = sparse_conditional_accumulator(
        optax.identity(), 2, capacity=2, sparse={"a": True, "b": True, "d": False}
    )
    offer, box = _feeder(tx, params)

    def grad(a_ids, b_ids, d):
        """Each leaf's ids padded to 2 with the padding id `ROWS` (ignored), so every
        gradient has one shape and the update compiles once."""
        a_ids, b_ids = (list(i) + [ROWS] * (2 - len(i)) for i in (a_ids, b_ids))
        return {
            "a": _g(a_ids, np.ones((2, 2))),
            "b": _g(b_ids, np.ones((2, 1)), (ROWS, 1)),
            "d": jnp.full(2, d, jnp.float32),
        }

    offer(grad([0], [0], 1.0))
    before = box["state"]
    # "a" fits (rows 0, 1) but "b" would need 3 slots: nothing of it is kept.
    offer(grad([1], [1, 2], jnp.nan))
    after = box["state"]
    assert int(after.num_overflowed) == 1 and int(after.count) == 1
    jax.tree.map(np.testing.assert_array_equal, after._replace(num_overflowed=0), before)
    u = offer(grad([1, 0], [5], 3.0))
    assert _rows(u["a"])[0] == [0, 1] and _rows(u["b"])[0] == [0, 5]
    np.testing.assert_allclose(u["d"], [2.0, 2.0])


def test_capacity_refills_after_each_release():
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=2, sparse=True)
    offer, box = _feeder(tx, jnp.zeros((ROWS, 2)))
    for ids in ([0, 1], [2, 3], [4, 5], [1, 4]):
        assert _rows(offer(_g(ids, np.ones((2, 2)))))[0] == ids
    assert int(box["state"].num_overflowed) == 0
    assert int(box["state"].storage.size) == 0  # a release only resets the size
    before = box["state"]  # its map still points at slots from earlier windows
    offer(_g([0, 4], np.full((2, 2), np.nan)), -1)  # stale: dropped
    after = box["state"]
    assert int(after.num_dropped) == 1 and not bool(after.emitted)
    same = after._replace(num_dropped=before.num_dropped, emitted=before.emitted)
    jax.tree.map(np.testing.assert_array_equal, same, before)


# --------------------------------------------------------------------------- NumPy model


class Reference:
    """float64 model of the accumulator with `optax.identity()` inside.

    `offer` takes the gradients of one step (one per replica, in replica order):
    each is dropped if stale, rejected whole if its new rows overflow the capacity,
    otherwise accumulated; the release check runs after the whole step.
    """

    def __init__(self, num_required, capacity, mean, rows=ROWS):
        self.k, self.capacity, self.mean, self.num_rows = num_required, capacity, mean, rows
        self.gs = self.dropped = self.overflowed = 0
        self._reset()

    def _reset(self):
        self.count, self.sums, self.touches, self.dense = 0, {}, {}, 0.0

    def offer(self, grads):
        for ids, values, dense, ls in grads:
            if ls < self.gs:
                self.dropped += 1
                continue
            touched = sorted({int(i) for i in ids if 0 <= i < self.num_rows})
            if len(set(self.sums) | set(touched)) > self.capacity:
                self.overflowed += 1
                continue
            for row in touched:
                total = np.sum(np.asarray(values, np.float64)[np.asarray(ids) == row], axis=0)
                self.sums[row] = self.sums.get(row, 0.0) + total
                self.touches[row] = self.touches.get(row, 0) + 1
            self.dense = self.dense + np.asarray(dense, np.float64)
            self.count += 1
        if self.count < self.k:
            return None
        ids = sorted(self.sums)
        vals = [self.sums[i] / (self.touches[i] if self.mean else 1) for i in ids]
        dense = self.dense / (self.count if self.mean else 1)
        self.gs += 1
        self._reset()
        return ids, np.array(vals).reshape(len(ids), 2), dense


@functools.cache
def _jitted_update(num_required, capacity, mean):
    tx = sparse_conditional_accumulator(
        optax.identity(),
        num_required,
        capacity=capacity,
        reduction="mean" if mean else "sum",
        sparse={"e": True, "d": False},
    )
    return tx, jax.jit(lambda g, s, ls: tx.update(g, s, local_step=ls))


_step = st.tuples(
    st.lists(st.integers(-1, ROWS), min_size=4, max_size=4),  # ids, with padding and dups
    st.lists(st.floats(-4, 4, width=32), min_size=8, max_size=8),
    st.floats(-4, 4, width=32),
    st.integers(0, 3),  # local-step lag behind a counter that moves with releases
)


# num_required 1 (a release per accepted gradient) or 3 (windows of several; 2 runs the
# same code), capacity 2 (overflows) or ROWS (never), MEAN or SUM: each combination
# compiles its own update, so the examples draw from the pairwise combinations (every
# pair of the three factors' values, 4 setups instead of 8).
_REFERENCE_SETUPS = pairwise([1, 3], [2, ROWS], [True, False])


@settings(max_examples=examples(30), deadline=None)
@given(st.sampled_from(_REFERENCE_SETUPS), st.lists(_step, min_size=1, max_size=10))
def test_matches_numpy_reference(setup, steps):
    num_required, capacity, mean = setup
    tx, update = _jitted_update(num_required, capacity, mean)
    ref = Reference(num_required, capacity, mean)
    state = tx.init({"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros(())})
    for ids, values, dense, lag in steps:
        ls = ref.gs + 1 - lag  # lag 0: from the future; 1: current; 2, 3: stale
        values = np.asarray(values, np.float32).reshape(4, 2)
        grad = {"e": _g(ids, values), "d": jnp.float32(dense)}
        u, state = update(grad, state, jnp.int32(ls))
        expected = ref.offer([(ids, values, dense, ls)])
        assert bool(state.emitted) == (expected is not None)
        if expected is None:
            assert _rows(u["e"])[0] == [] and float(u["d"]) == 0.0
            continue
        got_ids, got_vals = _rows(u["e"])
        assert got_ids == expected[0]
        np.testing.assert_allclose(got_vals, expected[1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(u["d"]), expected[2], rtol=1e-5, atol=1e-5)
    assert int(state.global_step) == ref.gs and int(state.count) == ref.count
    assert int(state.num_dropped) == ref.dropped
    assert int(state.num_overflowed) == ref.overflowed


# --------------------------------------------------------------------------- mixed trees


def test_dense_leaves_match_conditional_accumulator_exactly():
    rng = np.random.default_rng(3)
    params = {"e": jnp.zeros((ROWS, 2)), "w": jnp.zeros((2, 3)), "b": jnp.zeros(3, jnp.bfloat16)}
    sparse_tx = sparse_conditional_accumulator(
        optax.identity(), 3, capacity=ROWS, sparse=lambda p: {"e": True, "w": False, "b": False}
    )
    dense_tx = optax_accum.conditional_accumulator(optax.identity(), 3)
    dense_params = {"w": params["w"], "b": params["b"]}
    s_offer, s_box = _feeder(sparse_tx, params)
    d_offer, d_box = _feeder(dense_tx, dense_params)
    for i in range(8):
        dense = {
            "w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=3), jnp.bfloat16),
        }
        ls = i // 4 - (i % 4 == 3)  # every fourth gradient is stale
        su = s_offer({"e": _g([i % ROWS], [[1, 1]]), **dense}, ls)
        du = d_offer(dense, ls)
        for k in ("w", "b"):
            assert su[k].dtype == du[k].dtype
            np.testing.assert_array_equal(su[k], du[k])
            # Both sums restart lazily: after a release they are read as zeros.
            s_state = s_box["state"]
            held = np.where(s_state.emitted, 0, s_state.storage[k].values)
            np.testing.assert_array_equal(held, optax_accum.accumulated(d_box["state"])[k])
    assert int(s_box["state"].num_dropped) == int(d_box["state"].num_dropped) == 2


def test_default_marks_tall_matrices_sparse():
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=4)
    state = tx.init({"emb": jnp.zeros((10, 2)), "kernel": jnp.zeros((4, 2)), "b": jnp.zeros(10)})
    kinds = {k: type(v).__name__ for k, v in state.storage.items()}
    assert kinds == {"emb": "RowBuffer", "kernel": "DenseRows", "b": "DenseRows"}


# --------------------------------------------------------------------------- errors


def test_construction_errors_name_the_argument():
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        sparse_conditional_accumulator(optax.identity(), 1, capacity=0)
    with pytest.raises(TypeError, match="capacity"):
        sparse_conditional_accumulator(optax.identity(), 1, capacity=2.0)
    with pytest.raises(ValueError, match="num_required"):
        sparse_conditional_accumulator(optax.identity(), 0, capacity=2)
    with pytest.raises(ValueError, match="reduction"):
        sparse_conditional_accumulator(optax.identity(), 1, capacity=2, reduction="median")
    with pytest.raises(TypeError, match="sparse"):
        sparse_conditional_accumulator(optax.identity(), 1, capacity=2, sparse={"a": 1})
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=2, sparse={"a": True})
    with pytest.raises(ValueError, match="structure"):
        tx.init({"a": jnp.zeros((3, 2)), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match="scalar and cannot be sparse"):
        tx.init({"a": jnp.zeros(())})


def test_trace_time_errors_for_bad_gradients():
    """Every bad gradient raises while tracing; the good ones are lowered, not compiled
    (what is checked is that tracing accepts them: running them is other tests' work)."""
    params = {"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros(2)}
    tx = sparse_conditional_accumulator(
        optax.identity(), 1, capacity=2, sparse={"e": True, "d": False}
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    ok = {"e": _g([0], [[1, 1]]), "d": jnp.zeros(2)}
    update.lower(ok, state)
    cases = [
        ({**ok, "e": jnp.zeros((ROWS, 2))}, TypeError, r"updates\['e'\] must be an IndexedSlices"),
        (
            {**ok, "d": _g([0], [1], (3,))},
            ValueError,
            r"updates\['d'\] must have dense_shape \(2,\), got \(3,\)",
        ),
        ({**ok, "e": _g([0], [[1, 1]], (ROWS + 1, 2))}, ValueError, "dense_shape"),
        ({**ok, "e": _g([0], [[1, 1, 1]], (ROWS, 3))}, ValueError, "dense_shape"),
        ({**ok, "d": jnp.zeros(3)}, ValueError, "shape"),
        ({"e": ok["e"]}, ValueError, "tree structure"),
        (
            {**ok, "e": IndexedSlices(jnp.array([0]), jnp.array([[1, 1]]), (ROWS, 2))},
            TypeError,
            "floating",
        ),
    ]
    for grads, error, match in cases:
        with pytest.raises(error, match=match):
            update(grads, state)
    with pytest.raises(TypeError, match="local_step"):
        update(ok, state, local_step=1.5)
    # An unknown row count (TF's -1) is accepted.
    update.lower({**ok, "e": _g([0], [[1, 1]], (-1, 2))}, state)


def test_skip_nonfinite_skips_and_counts():
    for skip in (False, True):
        tx = sparse_conditional_accumulator(
            optax.identity(), 2, capacity=2, sparse=True, skip_nonfinite=skip
        )
        offer, box = _feeder(tx, jnp.zeros((ROWS, 2)))
        offer(_g([1, ROWS], [[np.nan, 1.0], [0.0, 0.0]]))  # padded: one shape, one compile
        assert int(box["state"].num_nonfinite) == int(skip)
        assert int(box["state"].count) == int(not skip)
        offer(_g([2, ROWS], [[1.0, 1.0], [np.nan, np.inf]]))  # NaN in a padding row only
        assert int(box["state"].num_nonfinite) == int(skip)


# --------------------------------------------------------------------------- sparse path


def test_sparse_sgd_updates_only_the_touched_rows():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(50, 3)), jnp.float32)
    tx = sparse_conditional_accumulator(optax_accum.sparse_sgd(0.5), 2, capacity=4, sparse=True)
    state = tx.init(table)

    @jax.jit
    def step(table, state, g):
        u, state = tx.update(g, state, table)
        return optax_accum.apply_updates(table, u), state, u

    g1 = IndexedSlices(jnp.array([7, 3]), jnp.ones((2, 3)), (50, 3))
    g2 = IndexedSlices(jnp.array([3, 50]), 3 * jnp.ones((2, 3)), (50, 3))
    new, state, u = step(table, state, g1)
    np.testing.assert_array_equal(new, table)
    assert np.all(np.asarray(u.indices) == 50)  # held: all padding, nothing written
    new, state, u = step(new, state, g2)
    expected = np.asarray(table, np.float64)
    expected[3] -= 0.5 * 2.0  # mean of 1 and 3
    expected[7] -= 0.5 * 1.0
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    untouched = np.setdiff1d(np.arange(50), [3, 7])
    np.testing.assert_array_equal(new[untouched], table[untouched])


def test_sparse_sgd_schedule_and_inject_hyperparams():
    g = {"e": IndexedSlices(jnp.array([1]), jnp.ones((1, 2)), (3, 2)), "b": jnp.ones(2)}
    params = {"e": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    sched = optax_accum.sparse_sgd(lambda count: 0.1 * (count + 1).astype(jnp.float32))
    state = sched.init(params)
    for lr in (0.1, 0.2):
        u, state = jax.jit(sched.update)(g, state)
        np.testing.assert_allclose(u["e"].values, [[-lr, -lr]], rtol=1e-6)
        np.testing.assert_allclose(u["b"], [-lr, -lr], rtol=1e-6)
    injected = optax.inject_hyperparams(optax_accum.sparse_sgd)(learning_rate=0.3)
    u, _ = jax.jit(injected.update)(g, injected.init(params))
    np.testing.assert_allclose(u["e"].values, [[-0.3, -0.3]], rtol=1e-6)
    np.testing.assert_array_equal(u["e"].indices, [1])


# --------------------------------------------------------------------------- devices


def test_axis_name_on_eight_devices_matches_the_reference():
    """shard_map over 8 devices: rows gathered each step, dense leaves summed on release."""
    n, steps = 8, 4
    mesh = jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(2)
    ids = rng.integers(0, ROWS + 1, size=(steps, n, 3)).astype(np.int32)
    values = rng.normal(size=(steps, n, 3, 2)).astype(np.float32)
    dense = rng.normal(size=(steps, n)).astype(np.float32)
    lags = rng.integers(0, 2, size=(steps, n))  # lag 1: stale
    capacity, k = 5, 4
    tx = sparse_conditional_accumulator(
        optax.identity(), k, capacity=capacity, sparse={"e": True, "d": False}, axis_name="i"
    )
    params = {"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros((1,))}
    state = tx.init(params)
    per_replica = DenseRows(jnp.zeros((n,)), jnp.zeros((n,), jnp.int32), jnp.zeros((n,)))
    state = state._replace(storage={**state.storage, "d": per_replica})
    state_spec = jax.tree.map(lambda _: P(), state)
    state_spec = state_spec._replace(
        storage={
            "e": jax.tree.map(lambda _: P(), state.storage["e"]),
            "d": DenseRows(P("i"), P("i"), P("i")),
        }
    )
    # Placed as the step returns it, so every step runs the first step's compile (an
    # uncommitted first state would compile the program a second time).
    state = jax.device_put(state, jax.tree.map(lambda p: jax.NamedSharding(mesh, p), state_spec))
    out_spec = {"e": IndexedSlices(P(), P(), (ROWS, 2)), "d": P()}

    def local(state, i, v, d, ls):
        g = {"e": IndexedSlices(i[0], v[0], (ROWS, 2)), "d": d}
        return tx.update(g, state, params, local_step=ls[0])

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(state_spec, P("i"), P("i"), P("i"), P("i")),
            out_specs=(out_spec, state_spec),
        )
    )
    ref = Reference(k, capacity, mean=True)
    released = 0
    for t in range(steps):
        ls = (ref.gs - lags[t]).astype(np.int32)
        u, state = step(state, ids[t], values[t], dense[t], ls)
        expected = ref.offer([(ids[t, r], values[t, r], dense[t, r], ls[r]) for r in range(n)])
        assert int(state.num_overflowed) == ref.overflowed
        assert int(state.num_dropped) == ref.dropped
        if expected is None:
            assert not bool(state.emitted)
            continue
        released += 1
        got_ids, got_vals = _rows(u["e"])
        assert got_ids == expected[0]
        np.testing.assert_allclose(got_vals, expected[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(u["d"], [expected[2]], rtol=1e-5)
    assert released >= 2 and ref.overflowed >= 1  # the data exercise both paths


def test_slices_offered_to_a_dense_leaf_are_scatter_added_and_averaged_per_row():
    """A dense leaf takes the dense meaning of an IndexedSlices, and MEAN divides each
    row by the gradients that touched it, as a sparse leaf does (not by the count)."""
    tx = sparse_conditional_accumulator(optax.identity(), 3, capacity=2, sparse=False)
    offer, _ = _feeder(tx, jnp.zeros((ROWS, 2)))
    offer(_g([1, 1, ROWS], [[1, 1], [2, 2], [7, 7]]))  # row 1 gets [3, 3], counted once
    offer(_g([0, 1], [[4, 0], [1, 1]]))
    u = offer(_g([0], [[2, 2]]))
    expected = np.zeros((ROWS, 2))
    expected[0], expected[1] = [3, 1], [2, 2]
    np.testing.assert_array_equal(u, expected)


def test_update_does_no_table_sized_work():
    """Structure, not the clock: a donated update's program reads and writes nothing
    of the table's size, on holding and releasing paths alike. The rows are found
    among the buffer's own `capacity` slots; `slot_of`, the one array of the table's
    rows in the state, only passes through (parameter, tuple, the branch's loop), and
    nothing of the table's float shape is built."""
    rows = 100_003  # a size no other array in the program has
    tx = sparse_conditional_accumulator(optax_accum.sparse_sgd(0.1), 2, capacity=16, sparse=True)
    g = IndexedSlices(jnp.zeros(8, jnp.int32), jnp.zeros((8, 3)), (rows, 3))
    state = tx.init(jnp.zeros((rows, 3)))
    lowered = jax.jit(lambda s, g: tx.update(g, s), donate_argnums=0).lower(state, g)
    hlo = lowered.compile(compiler_options=AS_USERS_COMPILE).as_text()
    table_sized = [op for op in instructions(hlo) if re.search(rf"\[{rows}[,\]]", op.result)]
    passing = {"parameter", "get-tuple-element", "tuple", "while", "call", "conditional"}
    assert any(op.opcode == "parameter" for op in table_sized)  # the reader sees it
    assert not [op for op in table_sized if op.opcode not in passing], table_sized
    assert f"f32[{rows}," not in hlo


def test_ids_too_many_to_pack_take_the_same_slots(monkeypatch):
    """A gradient's ids sort packed with their positions into one uint32 key when
    `(table rows + 1) * nnz` fits; otherwise they sort alone and a second search finds
    each one's run. Both paths give the same buffer and release, bit for bit: a
    duplicate id, one outside the table (the padding id by then), a row held from an
    earlier gradient, and a gradient refused for overflow."""
    from optax_accum import _row_buffer

    ids = jnp.asarray(
        [[3, 7, 3, 12, 3], [7, 12, 2, 0, 7], [1, 5, 6, 9, 10], [9, 9, 3, 7, 0]], jnp.int32
    )  # the third adds 5 rows to 4: more than the 8 slots, refused
    values = jnp.asarray(
        [[1, 2, 4, 8, 0.5], [16, 32, 64, 0.5, 1], [1] * 5, [0.25, 0.125, 2, 3, 1]]
    )[..., None]

    def run(ids, values):
        buf = _row_buffer.empty(jnp.zeros((12, 1)), 8)
        taken = []
        for i in range(4):
            (buf,), took, _ = _row_buffer.insert_all(
                [buf], [(ids[i : i + 1], values[i : i + 1])], jnp.ones(1, bool), None
            )
            taken.append(took[0])
        like = IndexedSlices(ids[0], values[0], (12, 1))
        return buf, _row_buffer.release(buf, True, like), jnp.stack(taken)

    packed = jax.jit(run)(ids, values)
    monkeypatch.setattr(_row_buffer, "_PACKED", 0)
    unpacked = jax.jit(run)(ids, values)
    np.testing.assert_array_equal(packed[2], [True, True, False, True])
    got_ids, got = _rows(packed[1])  # each row's mean over the gradients touching it
    assert got_ids == [0, 2, 3, 7, 9]
    sums = np.asarray([1.5, 64, 7.5, 22, 0.375], np.float32)
    np.testing.assert_array_equal(got[:, 0], sums / np.asarray([2, 1, 2, 3, 1], np.float32))
    jax.tree.map(np.testing.assert_array_equal, packed, unpacked)


def test_axis_name_under_pmap():
    """pmap over 2 devices: replica r offers rows 0 and r + 1 with value r + 1; row 0
    is touched twice. Up to `_row_buffer._UNROLL` (8) replicas the insertion runs the
    same unrolled code whatever their number, and each replica costs its own copy of it
    in the compiled program, so 2 replicas check pmap for a fraction of 8's compile time
    (the shard_map test above runs 8 devices, the ten-replica vmap test the scanned
    path)."""
    n = 2
    tx = sparse_conditional_accumulator(optax.identity(), n, capacity=8, sparse=True, axis_name="i")
    params = jnp.zeros((ROWS, 2))
    state = jax.pmap(tx.init, axis_name="i")(jnp.stack([params] * n))
    ids = jnp.asarray([[0, r + 1] for r in range(n)], jnp.int32)
    values = jnp.asarray([[[r + 1.0] * 2] * 2 for r in range(n)], jnp.float32)
    offer = jax.pmap(lambda s, i, v: tx.update(IndexedSlices(i, v, (ROWS, 2)), s), axis_name="i")
    u, state = offer(state, ids, values)
    for r in range(n):
        got_ids, got_vals = _rows(jax.tree.map(lambda x, r=r: x[r], u))
        assert got_ids == [0, 1, 2]
        np.testing.assert_allclose(got_vals[:, 0], [1.5, 1, 2])  # row 0: (1 + 2) / 2
    assert np.all(np.asarray(state.global_step) == 1)


# --------------------------------------------------------------------------- every capacity


def _dense_meaning(u) -> np.ndarray:
    """What `IndexedSlices.to_dense` gives (rows scatter-added, padding ignored), in
    NumPy: no scatter compiled per shape and dtype (test_indexed_slices checks
    to_dense itself)."""
    if not isinstance(u, IndexedSlices):
        return np.asarray(u)
    ids, values = np.asarray(u.indices), np.asarray(u.values)
    real = (ids >= 0) & (ids < u.dense_shape[0])
    dense = np.zeros(u.dense_shape, values.dtype)
    np.add.at(dense, ids[real], values[real])
    return dense


@pytest.mark.parametrize("capacity", [3, 5, 6, 64])
def test_mean_is_per_row_whatever_the_capacity(capacity):
    """Issue 14's reproducer, with the default `sparse`: at capacity 6 and 64 the table
    is kept dense, and rows 1 and 2 must still be averaged over their own gradients."""
    tx = sparse_conditional_accumulator(optax.identity(), 3, capacity=capacity)
    state = tx.init(jnp.zeros((ROWS, 2)))
    grads = [_g(ids, np.full((3, 2), 2.0)) for ids in ([0, 1, 2], [0, 1, ROWS], [0, ROWS, ROWS])]
    # Padded: one shape, one compile; at 6 and 64 the dense leaf never reads the
    # capacity, so the two lower to one program and share its compile.
    update = compiled_once(tx.update, grads[0], state)
    for g in grads:
        u, state = update(g, state)
    kind = "RowBuffer" if capacity < ROWS else "DenseRows"
    assert type(state.storage).__name__ == kind
    expected = np.zeros((ROWS, 2))
    expected[:3] = 2.0
    np.testing.assert_array_equal(_dense_meaning(u), expected)


def _per_row_reference(window, rows, mean):
    """float64: each row's sum over a window's gradients, divided by the gradients
    that touched it (duplicates within a gradient summed, counted once)."""
    total, touches = np.zeros((rows, 2)), np.zeros(rows)
    for ids, values in window:
        touched = np.zeros(rows, bool)
        for i, v in zip(ids, values, strict=True):
            if 0 <= i < rows:
                total[i] += np.asarray(v, np.float64)
                touched[i] = True
        touches += touched
    return total / np.maximum(touches, 1)[:, None] if mean else total


def _boundary_capacities(touched: int) -> list[int]:
    """The capacities at which a window touching `touched` rows of the `ROWS`-row table
    takes another path: the fewest that fit (one fewer would overflow), the largest row
    buffer (one below the table's rows), the table's rows (the default `sparse` keeps
    the table dense from there) and beyond it. Nothing in `_row_buffer` branches on the
    capacity between the first two (a larger buffer only pads the release further), and
    a dense leaf never reads it."""
    fewest = max(touched, 1)
    return sorted({fewest, max(fewest, ROWS - 1), ROWS, ROWS + 2})


def _padded(ids: list, values: list, nnz: int = 5) -> IndexedSlices:
    """A gradient padded to `nnz` rows with the padding id `ROWS` (an empty one too):
    the same dense meaning, in one shape, so the compilations do not multiply by every
    gradient size (no code branches on it; padding ids, with values, are among the
    drawn ids anyway; a zero-row gradient reaches both kinds of leaf in
    `test_empty_gradient_is_accepted_and_counts`)."""
    pad = nnz - len(ids)
    ids, values = list(ids) + [ROWS] * pad, list(values) + [[7.0, 7.0]] * pad
    return _g(np.asarray(ids, np.int32), np.reshape(np.asarray(values, np.float32), (-1, 2)))


@functools.cache
def _capacity_update(capacity: int, mean: bool):
    """One transform and update per (capacity, mean), shared by every example, so each
    setup compiles once (every gradient has one shape: see `_padded`). At and beyond the
    table's rows the leaf is dense and never reads the capacity: those setups lower to
    one program and share its compile (`_compiled.compiled_once`)."""
    tx = sparse_conditional_accumulator(
        optax.identity(), 3, capacity=capacity, reduction="mean" if mean else "sum"
    )
    state = tx.init(jnp.zeros((ROWS, 2)))

    like = _padded([], [])
    return tx, compiled_once(lambda g, s: tx.update(g, s, local_step=None), like, state)


@settings(max_examples=examples(25), deadline=None)
@given(
    st.booleans(),
    st.lists(
        st.lists(
            st.tuples(st.integers(-1, ROWS), st.floats(-4, 4, width=32)), min_size=0, max_size=5
        ),
        min_size=3,
        max_size=3,
    ),
)
def test_every_capacity_releases_the_per_row_mean(mean, window):
    """Every kind of capacity from the rows touched to beyond the table, with the
    default `sparse` (row buffer below the table's size, dense from it on): identical
    bits, equal to the float64 per-row mean. The capacities are the boundaries where
    the code changes (`_boundary_capacities`)."""
    grads = [([i for i, _ in g], [[v, -2 * v] for _, v in g]) for g in window]
    touched = {i for ids, _ in grads for i in ids if 0 <= i < ROWS}
    released = []
    for capacity in _boundary_capacities(len(touched)):
        tx, update = _capacity_update(capacity, mean)
        state = tx.init(jnp.zeros((ROWS, 2)))
        for ids, values in grads:
            u, state = update(_padded(ids, values), state)
        assert bool(state.emitted) and int(state.num_overflowed) == 0
        released.append(_dense_meaning(u))
    expected = _per_row_reference(grads, ROWS, mean)
    for got in released:
        np.testing.assert_array_equal(got, released[0])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- id dtypes


# Each id dtype at the table sizes that put it in a different situation (see
# `_row_ids.in_range`: the bound is compared in the ids' dtype only if the dtype holds
# it). uint8 addresses a 256-row byte vocabulary whole (its id 255 is the last row) but
# not a 300-row table (70,000 rows would be the same case); int8 holds none of the
# three sizes, so one is enough. The 16-bit dtypes hold 256 and 300 alike (300: id 299
# is the last row) but not 70,000; the 32-bit dtypes hold all three alike, and 70,000
# gives them the largest ids. Every dtype of a table size is its own pair of leaves in
# one tree, so each table size compiles one program.
_ID_TABLES = {
    256: ["uint8", "int8"],
    300: ["uint8", "int16", "uint16"],
    70_000: ["int16", "uint16", "uint32", "int32"],
}


@pytest.mark.parametrize("rows", list(_ID_TABLES))
def test_ids_of_every_integer_dtype_are_exact(rows):
    """A byte vocabulary of 256 rows (and tables beyond what 8 and 16 bits hold) with
    the largest ids each dtype holds, each dtype offered to a sparse leaf ("s_<dtype>")
    and a dense leaf ("d_<dtype>"): exactly those rows released, nothing counted out of
    range."""
    dtypes = _ID_TABLES[rows]
    candidates = (0, 3, 127, 128, 255, 299, 32767, 65535, 69_999)
    grads, expected = {}, {}
    for dtype in dtypes:
        info = np.iinfo(dtype)
        ids = [i for i in candidates if i <= min(info.max, rows - 1)]
        values = np.arange(2 * len(ids), dtype=np.float32).reshape(-1, 2) + 1
        dense = np.zeros((rows, 2), np.float32)
        dense[ids] = values
        for kind in ("s", "d"):
            grads[f"{kind}_{dtype}"] = IndexedSlices(
                jnp.asarray(np.asarray(ids, dtype)), jnp.asarray(values), (rows, 2)
            )
            expected[f"{kind}_{dtype}"] = dense
    tx = sparse_conditional_accumulator(
        optax.identity(), 2, capacity=16, sparse={k: k.startswith("s_") for k in grads}
    )
    table = jnp.zeros((rows, 2))
    s = tx.init(dict.fromkeys(grads, table))
    update = jax.jit(tx.update)
    for _ in range(2):
        u, s = update(grads, s)
    assert int(s.num_out_of_range) == 0 and bool(s.emitted)
    for leaf, dense in expected.items():
        kind = "RowBuffer" if leaf.startswith("s_") else "DenseRows"
        assert type(s.storage[leaf]).__name__ == kind, leaf
        np.testing.assert_array_equal(_dense_meaning(u[leaf]), dense, err_msg=leaf)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse leaf", "dense leaf"])
def test_out_of_range_ids_are_counted_for_sparse_and_dense_leaves(sparse):
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=4, sparse=sparse)
    offer, box = _feeder(tx, jnp.zeros((ROWS, 2)))
    u = offer(_g([-1, 2, ROWS, ROWS + 1, 2**30], np.ones((5, 2))))
    assert int(box["state"].num_out_of_range) == 3  # ROWS is the padding id
    expected = np.zeros((ROWS, 2))
    expected[2] = 1.0
    np.testing.assert_array_equal(_dense_meaning(u), expected)
    # int8 ids: -128 is out of range; every positive int8 id of a 300-row table is real.
    tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=4, sparse=sparse)
    state = tx.init(jnp.zeros((300, 2)))
    g = IndexedSlices(jnp.array([-128, 127], jnp.int8), jnp.ones((2, 2)), (300, 2))
    u, state = jax.jit(tx.update)(g, state)
    assert int(state.num_out_of_range) == 1
    assert _dense_meaning(u)[127].tolist() == [1.0, 1.0]


def test_int64_ids_under_x64():
    """int64 ids beyond int32 are out of range, never wrapped onto a real row."""
    with jax.enable_x64(True):
        for sparse in (True, False):
            tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=4, sparse=sparse)
            state = tx.init(jnp.zeros((ROWS, 2), jnp.float32))
            ids = jnp.array([3, 2**32 + 3, 2**31, 1], jnp.int64)
            g = IndexedSlices(ids, jnp.ones((4, 2), jnp.float32), (ROWS, 2))
            u, state = jax.jit(tx.update)(g, state)
            assert int(state.num_out_of_range) == 2
            dense = _dense_meaning(u)
            assert dense[:, 0].tolist() == [0, 1, 0, 1, 0, 0]
            table = optax_accum.apply_updates(jnp.zeros((ROWS, 2), jnp.float32), g)
            assert np.asarray(table)[:, 0].tolist() == [0, 1, 0, 1, 0, 0]


# --------------------------------------------------------------------------- determinism


def test_axis_path_sums_duplicates_in_a_fixed_order():
    """Shuffling each replica's (id, row) pairs gives the same bits: duplicates are
    summed in an order fixed by the ids and values, never by arrival. The values are
    chosen so that float32 addition in arrival order would differ (1e8 + 1 - 1e8)."""
    n, nnz = 2, 6  # two replicas: each sums its own duplicates, the rest is gathering
    rng = np.random.default_rng(0)
    ids = np.array([[1, 1, 1, 2, 2, ROWS]] * n, np.int32)
    big = np.array([1e8, 1.0, -1e8, 3.0, 1e-3, 9.0], np.float32)
    values = np.stack([np.stack([big * (r + 1), -big], axis=1) for r in range(n)])
    tx = sparse_conditional_accumulator(
        optax.identity(), 2 * n, capacity=4, sparse={"e": True, "d": False}, axis_name="r"
    )
    params = {"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros((ROWS, 2))}

    @jax.jit
    def run(ids, values):
        def replica(i, v):
            state = tx.init(params)
            g = {"e": IndexedSlices(i, v, (ROWS, 2)), "d": IndexedSlices(i, v, (ROWS, 2))}
            _, state = tx.update(g, state, params)
            u, state = tx.update(g, state, params)
            return u, state

        return jax.vmap(replica, axis_name="r")(ids, values)

    first = run(ids, values)
    for _ in range(3):
        order = np.stack([rng.permutation(nnz) for _ in range(n)])
        shuffled = run(
            np.take_along_axis(ids, order, 1), np.take_along_axis(values, order[..., None], 1)
        )
        jax.tree.map(np.testing.assert_array_equal, shuffled, first)
    u, _ = first
    assert _rows(jax.tree.map(lambda x: x[0], u["e"]))[0] == [1, 2]
    np.testing.assert_array_equal(np.asarray(u["d"][0]), np.asarray(u["d"][n - 1]))


# --------------------------------------------------------------------------- nested vmap


def test_nested_vmap_with_a_tuple_axis_name():
    """`vmap(vmap(f, axis_name="a"), axis_name="b")` with `axis_name=("b", "a")` is the
    flat `vmap` over b * a replicas in row-major order: the same bits."""
    b, a = 2, 3
    rng = np.random.default_rng(5)
    ids = rng.integers(0, ROWS + 1, size=(b * a, 3)).astype(np.int32)
    values = rng.normal(size=(b * a, 3, 2)).astype(np.float32)
    dense = rng.normal(size=(b * a, 2)).astype(np.float32)
    params = {"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros(2)}

    def make(axis_name):
        tx = sparse_conditional_accumulator(
            optax.identity(),
            b * a,
            capacity=ROWS,
            sparse={"e": True, "d": False},
            axis_name=axis_name,
        )

        def replica(i, v, d):
            g = {"e": IndexedSlices(i, v, (ROWS, 2)), "d": d}
            return tx.update(g, tx.init(params), params)

        return replica

    flat = jax.jit(jax.vmap(make("r"), axis_name="r"))(ids, values, dense)
    nested = jax.jit(jax.vmap(jax.vmap(make(("b", "a")), axis_name="a"), axis_name="b"))(
        *(x.reshape(b, a, *x.shape[1:]) for x in (ids, values, dense))
    )
    # Reshaped and indexed in NumPy: eager jnp ops would compile one program per leaf.
    nested = jax.tree.map(lambda x: np.asarray(x).reshape(b * a, *x.shape[2:]), nested)
    flat = jax.tree.map(np.asarray, flat)
    jax.tree.map(np.testing.assert_array_equal, nested, flat)
    u, state = flat
    assert bool(state.emitted[0])
    ref = Reference(b * a, ROWS, mean=True)
    expected = ref.offer([(ids[r], values[r], 0.0, 0) for r in range(b * a)])
    got_ids, got_vals = _rows(jax.tree.map(lambda x: x[0], u["e"]))
    assert got_ids == expected[0]
    np.testing.assert_allclose(got_vals, expected[1], rtol=1e-6)
    np.testing.assert_allclose(u["d"][0], dense.mean(0), rtol=1e-6)


def test_sparse_mask_of_numpy_bools():
    """A mask computed with NumPy (`np.bool_` leaves) works as one of Python bools."""
    params = {"e": jnp.zeros((ROWS, 2)), "d": jnp.zeros(2)}
    grads = {"e": _g([1], [[2.0, 2.0]]), "d": jnp.ones(2)}
    results, programs = [], []
    for mask in ({"e": True, "d": False}, {"e": np.True_, "d": np.False_}):
        for given_as in (mask, lambda p, mask=mask: mask):
            tx = sparse_conditional_accumulator(optax.identity(), 1, capacity=2, sparse=given_as)
            state = tx.init(params)
            assert type(state.storage["e"]).__name__ == "RowBuffer"
            programs.append(compiled_once(tx.update, grads, state))
            u, _ = programs[-1](grads, state)
            results.append(_dense_meaning(u["e"]))
    assert all(p is programs[0] for p in programs)  # the very same program, compiled once
    for r in results:
        np.testing.assert_array_equal(r, results[0])


# --------------------------------------------------------------------------- mixed precision

MIXED = [
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float32),
    (jnp.float32, jnp.bfloat16),
    (jnp.float32, jnp.float16),
]
INNERS = {
    "sgd": (lambda: optax_accum.sparse_sgd(0.5), lambda: optax.sgd(0.5)),
    "adam": (
        lambda: optax.chain(optax_accum.densify(), lenient(optax.adam(0.1))),
        lambda: lenient(optax.adam(0.1)),
    ),
}


def _mixed_grads(step, dtype):
    """Sparse rows (a table, and a small table kept dense) and a dense leaf. Every
    gradient touches the same rows, so the per-row mean is the mean of the window and
    optax.MultiSteps on the dense gradients is an exact anchor."""
    rng = np.random.default_rng(step)

    def rows(n, shape):
        values = jnp.asarray(rng.normal(size=(n, shape[1])), dtype)
        return IndexedSlices(jnp.array([4, 1, 4][:n], jnp.int32), values, shape)

    return {
        "e": rows(3, (ROWS, 2)),
        "k": rows(2, (3, 2)),
        "b": jnp.asarray(rng.normal(size=2), dtype),
    }


_MIXED_MASK = {"e": True, "k": False, "b": False}


@functools.cache
def _sgd_step():
    """The one-device `sparse_sgd(0.5)` accumulator of the mixed-precision tests (a
    window of 2, capacity 4) and its jitted step returning the new params, state and
    updates: the tests below share it, so each dtype pair compiles once in a process."""
    tx = sparse_conditional_accumulator(
        optax_accum.sparse_sgd(0.5), 2, capacity=4, sparse=_MIXED_MASK
    )

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax_accum.apply_updates(params, updates), state, updates

    return tx, step


# Each inner optimizer in both directions (low-precision params, low-precision
# gradients), and each of the four pairs once: the float64 reference below runs
# `sparse_sgd` on all four.
MULTISTEPS_CASES = [
    (jnp.bfloat16, jnp.float32, "sgd"),
    (jnp.float32, jnp.float16, "sgd"),
    (jnp.float16, jnp.float32, "adam"),
    (jnp.float32, jnp.bfloat16, "adam"),
]


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "inner"),
    MULTISTEPS_CASES,
    ids=lambda d: d if isinstance(d, str) else jnp.dtype(d).name,
)
def test_mixed_precision_matches_multisteps(param_dtype, grad_dtype, inner):
    """float32 gradients on low-precision params and the reverse: on every step, held
    or released, the updates have the dtypes of the inner optimizer's own updates (as
    optax.MultiSteps gives), and applying them keeps the params' dtypes."""
    make_sparse_inner, make_dense_inner = INNERS[inner]
    params = {
        "e": jnp.asarray(np.linspace(-1, 1, 2 * ROWS).reshape(ROWS, 2), param_dtype),
        "k": jnp.ones((3, 2), param_dtype),
        "b": jnp.zeros(2, param_dtype),
    }
    if inner == "sgd":
        tx, step = _sgd_step()
    else:
        tx = sparse_conditional_accumulator(make_sparse_inner(), 2, capacity=4, sparse=_MIXED_MASK)

        @jax.jit
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax_accum.apply_updates(params, updates), state, updates

    multi = optax.MultiSteps(make_dense_inner(), 2)

    def dense(g):
        return jax.tree.map(
            lambda x: x.to_dense() if isinstance(x, IndexedSlices) else x,
            g,
            is_leaf=lambda x: isinstance(x, IndexedSlices),
        )

    @jax.jit
    def multi_step(params, state, grads):
        with jax.numpy_dtype_promotion("standard"):  # optax's own code is not strict
            updates, state = multi.update(dense(grads), state, params)
            return optax.apply_updates(params, updates), state, updates

    dense_inner = make_dense_inner()
    own = jax.eval_shape(
        dense_inner.update, dense(_mixed_grads(0, grad_dtype)), dense_inner.init(params), params
    )[0]
    ours, theirs = (params, tx.init(params)), (params, multi.init(params))
    for i in range(4):
        grads = _mixed_grads(i, grad_dtype)
        before = ours[0]
        *ours, u = step(*ours, grads)
        *theirs, mu = multi_step(*theirs, grads)
        got = jax.tree.map(
            lambda x: x.values.dtype if isinstance(x, IndexedSlices) else x.dtype,
            u,
            is_leaf=lambda x: isinstance(x, IndexedSlices),
        )
        assert got == jax.tree.map(lambda x: x.dtype, own) == jax.tree.map(lambda x: x.dtype, mu)
        assert jax.tree.map(lambda x: x.dtype, ours[0]) == jax.tree.map(lambda x: x.dtype, params)
        if i % 2 == 0:  # held: nothing to apply
            jax.tree.map(np.testing.assert_array_equal, ours[0], before)
    for k in params:
        np.testing.assert_allclose(
            np.asarray(ours[0][k], np.float32),
            np.asarray(theirs[0][k], np.float32),
            rtol=2e-2,
            atol=2e-2,
        )
    assert not np.array_equal(
        np.asarray(ours[0]["e"], np.float32), np.asarray(params["e"], np.float32)
    )


@pytest.mark.parametrize(("param_dtype", "grad_dtype"), MIXED, ids=lambda d: jnp.dtype(d).name)
def test_mixed_precision_sparse_sgd_matches_a_float64_reference(param_dtype, grad_dtype):
    """`sparse_sgd` on the per-row mean of each window of 2 gradients, in float64 NumPy:
    an anchor that holds on every optax version (optax 0.2.5's MultiSteps, the anchor
    above, raises on low-precision gradients for float32 params under SGD). Every
    gradient touches the same rows, so the per-row mean is the mean of the window."""
    params = {
        "e": jnp.asarray(np.linspace(-1, 1, 2 * ROWS).reshape(ROWS, 2), param_dtype),
        "k": jnp.ones((3, 2), param_dtype),
        "b": jnp.zeros(2, param_dtype),
    }
    tx, step = _sgd_step()

    def dense64(g):
        if isinstance(g, IndexedSlices):
            out = np.zeros(g.dense_shape)
            ids, rows = np.asarray(g.indices), np.asarray(g.values, np.float64)
            inside = ids < g.dense_shape[0]  # the others are padding
            np.add.at(out, ids[inside], rows[inside])
            return out
        return np.asarray(g, np.float64)

    p, s = params, tx.init(params)
    expected = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for i in range(0, 6, 2):
        window = [_mixed_grads(i, grad_dtype), _mixed_grads(i + 1, grad_dtype)]
        for grads in window:
            p, s, _ = step(p, s, grads)
        for k in expected:
            expected[k] -= 0.5 * np.mean([dense64(g[k]) for g in window], axis=0)
    for k in expected:  # rounding in the low-precision dtype
        assert p[k].dtype == param_dtype
        np.testing.assert_allclose(np.asarray(p[k], np.float64), expected[k], rtol=2e-2, atol=2e-2)
    assert not np.allclose(expected["e"], np.asarray(params["e"], np.float64))


# The axis path in both directions (low-precision params, low-precision gradients),
# each low-precision dtype once: the one-device tests above run all four pairs, and
# the axis path casts (`combined`, the gathers) do not tell bfloat16 from float16.
AXIS_MIXED = [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float16)]


@pytest.mark.parametrize(("param_dtype", "grad_dtype"), AXIS_MIXED, ids=lambda d: jnp.dtype(d).name)
def test_mixed_precision_on_the_axis_path(param_dtype, grad_dtype):
    """The same under `axis_name` (two replicas offering the same gradients, so one
    release per step equals one device releasing every second step)."""
    params = {
        "e": jnp.zeros((ROWS, 2), param_dtype),
        "k": jnp.zeros((3, 2), param_dtype),
        "b": jnp.zeros(2, param_dtype),
    }
    shared = sparse_conditional_accumulator(
        optax_accum.sparse_sgd(0.5), 2, capacity=4, sparse=_MIXED_MASK, axis_name="r"
    )

    def run(params, state, grads):
        updates, state = shared.update(grads, state, params)
        return optax_accum.apply_updates(params, updates), state

    # Stacked in NumPy: eager jnp.stack would compile one program per leaf and dtype.
    def two(tree):
        return jax.tree.map(lambda x: np.stack([np.asarray(x)] * 2), tree)

    pair = two((params, shared.init(params)))
    pair_step = jax.jit(jax.vmap(run, axis_name="r"))
    alone, single_step = _sgd_step()
    single = (params, alone.init(params))
    for i in range(2):
        grads = _mixed_grads(i, grad_dtype)
        pair = pair_step(*pair, two(grads))
        single = single_step(*single, grads)[:2]
        single = single_step(*single, grads)[:2]
    for k in params:
        assert pair[0][k].dtype == param_dtype
        got = np.asarray(pair[0][k])
        np.testing.assert_array_equal(got[0], got[1])
        np.testing.assert_allclose(
            np.asarray(got[0], np.float32),
            np.asarray(single[0][k], np.float32),
            rtol=1e-2,
            atol=1e-2,
        )
