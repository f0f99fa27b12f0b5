"""Weighted means: the `weight` extra argument of the dense and sparse accumulators.

MEAN releases sum(w * g) / sum(w) over the accepted gradients (per row, over the
gradients that touched the row, for the sparse accumulator), SUM releases sum(w * g);
gradients that are not accepted add neither gradient nor weight; a window whose
weights sum to 0 releases zeros; a release still comes after `num_required` accepted
gradients. Checked against float64 NumPy references, under jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _matrix import pairwise
from hypothesis import given, settings
from hypothesis import strategies as st

from optax_accum import (
    IndexedSlices,
    accumulated,
    conditional_accumulator,
    sparse_conditional_accumulator,
)

# weight None: the default (1). The others are exact in float32, and so are their sums.
_WEIGHTS = st.sampled_from([None, 0.0, 0.5, 1.0, 2.0, 3.25, 7])


def _rule_skips(first_value: float) -> bool:
    """The test's skip rule, in NumPy: skip a gradient whose first value is 3.5."""
    return first_value == 3.5


# --------------------------------------------------------------------------- dense


class _DenseReference:
    """The weighted accumulator in float64 NumPy, with stale, non-finite and skipped."""

    def __init__(self, k: int, mean: bool):
        self.k, self.mean = k, mean
        self.gs = self.dropped = self.nonfinite = self.skipped = 0
        self._reset()

    def _reset(self):
        self.count, self.acc, self.wsum = 0, np.zeros(3), 0.0

    def offer(self, grad, local_step, weight):
        if local_step < self.gs:
            self.dropped += 1
            return np.zeros(3)
        if not np.all(np.isfinite(grad)):
            self.nonfinite += 1
            return np.zeros(3)
        if _rule_skips(grad[0]):
            self.skipped += 1
            return np.zeros(3)
        w = 1.0 if weight is None else float(weight)
        if w > 0:
            self.acc = self.acc + w * np.asarray(grad, np.float64)
        self.wsum += w
        self.count += 1
        if self.count < self.k:
            return np.zeros(3)
        out = self.acc / (self.wsum if self.wsum > 0 else 1.0) if self.mean else self.acc
        self.gs += 1
        self._reset()
        return out


@functools.cache
def _dense_update(k: int, mean: bool):
    tx = conditional_accumulator(
        optax.identity(),
        k,
        reduction="mean" if mean else "sum",
        skip_nonfinite=True,
        should_skip_update_fn=lambda u, step, params: u[0] == 3.5,
    )
    return tx, jax.jit(lambda g, s, ls, w: tx.update(g, s, local_step=ls, weight=w))


_dense_event = st.tuples(
    st.lists(st.integers(-8, 16), min_size=3, max_size=3),  # quarters; 14 -> 3.5: skipped
    st.integers(-1, 1),  # local step relative to the global step: -1 is stale
    _WEIGHTS,
    st.sampled_from([None, None, None, np.nan, np.inf]),  # a non-finite first value
)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(k=st.integers(1, 3), mean=st.booleans(), events=st.lists(_dense_event, max_size=14))
def test_dense_matches_numpy_reference(k, mean, events):
    tx, update = _dense_update(k, mean)
    ref = _DenseReference(k, mean)
    state = tx.init(jnp.zeros(3))
    for values, lag, weight, bad in events:
        grad = np.asarray(values, np.float64) / 4
        if bad is not None:
            grad[1] = bad
        ls = ref.gs + lag
        w = None if weight is None else jnp.asarray(weight, jnp.float32)
        u, state = update(jnp.asarray(grad, jnp.float32), state, jnp.int32(ls), w)
        expected = ref.offer(grad, ls, weight)
        np.testing.assert_allclose(np.asarray(u), expected, rtol=1e-6, atol=1e-6)
        assert int(state.global_step) == ref.gs and int(state.count) == ref.count
        assert float(state.weight_sum) == ref.wsum
    assert (int(state.num_dropped), int(state.num_nonfinite), int(state.num_skipped)) == (
        ref.dropped,
        ref.nonfinite,
        ref.skipped,
    )
    np.testing.assert_allclose(np.asarray(accumulated(state)), ref.acc, rtol=1e-6, atol=1e-6)


def test_default_weight_is_weight_one_bit_for_bit():
    rng = np.random.default_rng(0)
    grads = jnp.asarray(rng.normal(size=(7, 5)), jnp.float32)
    outs = {}
    for weight in (None, 1):
        tx = conditional_accumulator(optax.identity(), 3)
        update = jax.jit(lambda g, s, tx=tx, w=weight: tx.update(g, s, weight=w))
        state, got = tx.init(jnp.zeros(5)), []
        for g in grads:
            u, state = update(g, state)
            got.append(np.asarray(u))
        outs[weight] = np.stack(got)
    np.testing.assert_array_equal(outs[None], outs[1])
    # ...and both are the plain mean, to the bit as today's sum / count.
    expected = (grads[0] + grads[1] + grads[2]) / jnp.float32(3)
    np.testing.assert_array_equal(outs[None][2], np.asarray(expected))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dense_zero_weight_window_releases_zeros_and_counts(reduction):
    tx = conditional_accumulator(optax.identity(), 2, reduction=reduction)
    update = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    state = tx.init(jnp.zeros(2))
    _, state = update(jnp.array([np.nan, 1.0]), state, jnp.float32(0))  # adds nothing
    u, state = update(jnp.array([2.0, 3.0]), state, jnp.float32(0))
    np.testing.assert_array_equal(np.asarray(u), [0.0, 0.0])
    assert bool(state.emitted) and int(state.global_step) == 1
    assert int(state.count) == 0 and float(state.weight_sum) == 0.0


def test_release_after_num_required_gradients_whatever_their_weights():
    tx = conditional_accumulator(optax.identity(), 3)
    update = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    state = tx.init(jnp.zeros(1))
    for weight, emitted in [(100.0, False), (0.5, False), (0.5, True)]:
        u, state = update(jnp.array([weight]), state, jnp.float32(weight))
        assert bool(state.emitted) == emitted
    # (100 * 100 + 0.5 * 0.5 + 0.5 * 0.5) / 101
    np.testing.assert_allclose(np.asarray(u), [(10000 + 0.5) / 101], rtol=1e-6)


# --------------------------------------------------------------------------- a token-mean loss


def _token_batches():
    """Four micro-batches of 2 sequences with 1 to 6 real tokens each (the rest masked)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 6, 3))
    y = rng.normal(size=(8, 6))
    lengths = np.array([1, 6, 2, 2, 5, 6, 1, 3])
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.float64)
    return x, y, mask


def _token_mean_loss(w, x, y, mask):
    err = jnp.einsum("btf,f->bt", x, w) - y
    return jnp.sum(mask * err**2) / jnp.sum(mask)


def test_token_weighted_micro_batches_equal_the_full_batch_token_mean_gradient():
    x, y, mask = _token_batches()
    w0 = np.array([0.3, -0.2, 0.1])
    # float64 NumPy: the full batch's token-mean loss gradient.
    err = np.einsum("btf,f->bt", x, w0) - y
    expected = 2 * np.einsum("bt,btf->f", mask * err, x) / mask.sum()

    tx = conditional_accumulator(optax.identity(), num_required=4)
    grad_fn = jax.grad(_token_mean_loss)
    w = jnp.asarray(w0, jnp.float32)

    @jax.jit
    def step(state, xb, yb, mb):  # weight: the micro-batch's number of tokens
        return tx.update(grad_fn(w, xb, yb, mb), state, weight=mb.sum())

    state = tx.init(w)
    parts = [
        tuple(jnp.asarray(a[2 * i : 2 * i + 2], jnp.float32) for a in (x, y, mask))
        for i in range(4)
    ]
    for part in parts:
        released, state = step(state, *part)
    assert bool(state.emitted)
    np.testing.assert_allclose(np.asarray(released), expected, rtol=1e-5, atol=1e-6)
    # The unweighted mean of the micro-batches' means is a different number.
    unweighted = np.mean([np.asarray(grad_fn(w, *part)) for part in parts], axis=0)
    assert not np.allclose(unweighted, expected, rtol=1e-3)


# --------------------------------------------------------------------------- sparse

ROWS = 6


class _SparseReference:
    """The weighted sparse accumulator in float64 NumPy: per-row weighted sums.

    Leaves: "e" sparse (at most `capacity` rows), "t" a dense leaf taking the same
    `IndexedSlices`, "b" a dense leaf taking a dense gradient.
    """

    def __init__(self, k: int, capacity: int, mean: bool):
        self.k, self.capacity, self.mean = k, capacity, mean
        self.gs = self.dropped = self.nonfinite = self.skipped = self.overflowed = 0
        self._reset()

    def _reset(self):
        self.count, self.sums, self.weights = 0, {}, {}
        self.b, self.bw = np.zeros(2), 0.0

    def offer(self, ids, values, b, local_step, weight):
        if local_step < self.gs:
            self.dropped += 1
        elif not (np.all(np.isfinite(values[np.asarray(ids) < ROWS])) and np.all(np.isfinite(b))):
            self.nonfinite += 1
        elif _rule_skips(b[0]):
            self.skipped += 1
        else:
            touched = sorted({int(i) for i in ids if 0 <= i < ROWS})
            if len(set(self.sums) | set(touched)) > self.capacity:
                self.overflowed += 1
            else:
                w = 1.0 if weight is None else float(weight)
                for row in touched:
                    total = np.sum(values[np.asarray(ids) == row], axis=0) * w
                    self.sums[row] = self.sums.get(row, 0.0) + total
                    self.weights[row] = self.weights.get(row, 0.0) + w
                self.b, self.bw = self.b + w * b, self.bw + w
                self.count += 1
        if self.count < self.k:
            return None
        e = np.zeros((ROWS, 2))
        for row, total in self.sums.items():
            wsum = self.weights[row]
            e[row] = total / (wsum if wsum > 0 else 1.0) if self.mean else total
        b = self.b / (self.bw if self.bw > 0 else 1.0) if self.mean else self.b
        rows = sorted(self.sums)
        self.gs += 1
        self._reset()
        return e, rows, b


def _sparse_tx(k: int, capacity: int, mean: bool, axis_name=None, skip_nonfinite=True):
    return sparse_conditional_accumulator(
        optax.identity(),
        k,
        capacity=capacity,
        reduction="mean" if mean else "sum",
        sparse={"e": True, "t": False, "b": False},
        skip_nonfinite=skip_nonfinite,
        should_skip_update_fn=lambda u, step, params: u["b"][0] == 3.5,
        axis_name=axis_name,
    )


@functools.cache
def _sparse_update(k: int, capacity: int, mean: bool):
    tx = _sparse_tx(k, capacity, mean)
    return tx, jax.jit(lambda g, s, ls, w: tx.update(g, s, local_step=ls, weight=w))


def _densified(u: IndexedSlices) -> np.ndarray:
    out = np.zeros((ROWS, 2))
    for i, v in zip(np.asarray(u.indices), np.asarray(u.values, np.float64), strict=True):
        if i < ROWS:
            out[i] += v
    return out


def _params():
    return {"e": jnp.zeros((ROWS, 2)), "t": jnp.zeros((ROWS, 2)), "b": jnp.zeros(2)}


_sparse_event = st.tuples(
    st.lists(st.integers(0, ROWS), min_size=3, max_size=3),  # ids; ROWS is padding
    st.lists(st.integers(-8, 8), min_size=6, max_size=6),
    st.lists(st.integers(-8, 16), min_size=2, max_size=2),  # b; 14 -> 3.5: skipped
    st.integers(-1, 1),
    _WEIGHTS,
    st.sampled_from([None, None, None, np.nan, -np.inf]),
)


# Each (k, capacity, mean) compiles its own update, twice (with and without a weight),
# so k takes the two values that differ: 1 releases every accepted gradient, 3 sums
# windows of several (2 would run the same code as 3). Capacity 2 overflows, ROWS never.
# The examples draw from the pairwise combinations of the three factors (every pair of
# their values: 4 setups of the 8), since each setup costs two compiles.
_SPARSE_SETUPS = pairwise([1, 3], [2, ROWS], [True, False])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(setup=st.sampled_from(_SPARSE_SETUPS), events=st.lists(_sparse_event, max_size=10))
def test_sparse_matches_numpy_reference(setup, events):
    k, capacity, mean = setup
    tx, update = _sparse_update(k, capacity, mean)
    ref = _SparseReference(k, capacity, mean)
    state = tx.init(_params())
    for ids, values, b, lag, weight, bad in events:
        values = np.asarray(values, np.float64).reshape(3, 2) / 4
        b = np.asarray(b, np.float64) / 4
        if bad is not None:
            values[0, 1] = bad
        ls = ref.gs + lag
        if k == 1 and weight is None:
            # The default weight's program (no multiply) runs in the k=3 setups, where
            # it mixes with weighted gradients in a window; with k=1 it would cost two
            # more compiles for a window of one gradient, so these weigh it 1.0.
            weight = 1.0
        slices = IndexedSlices(jnp.asarray(ids), jnp.asarray(values, jnp.float32), (ROWS, 2))
        grad = {"e": slices, "t": slices, "b": jnp.asarray(b, jnp.float32)}
        w = None if weight is None else jnp.asarray(weight, jnp.float32)
        u, state = update(grad, state, jnp.int32(ls), w)
        expected = ref.offer(ids, values, b, ls, weight)
        assert bool(state.emitted) == (expected is not None)
        if expected is None:
            assert np.all(np.asarray(u["e"].indices) == ROWS)
            continue
        e, rows, b_out = expected
        assert sorted(int(i) for i in np.asarray(u["e"].indices) if i < ROWS) == rows
        np.testing.assert_allclose(_densified(u["e"]), e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(u["t"]), e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(u["b"]), b_out, rtol=1e-6, atol=1e-6)
    counts = (
        state.global_step,
        state.count,
        state.num_dropped,
        state.num_nonfinite,
        state.num_skipped,
        state.num_overflowed,
    )
    assert [int(c) for c in counts] == [
        ref.gs,
        ref.count,
        ref.dropped,
        ref.nonfinite,
        ref.skipped,
        ref.overflowed,
    ]


@functools.cache
def _weighted_update():
    """The window-of-2 MEAN accumulator of the two tests below (non-finite rows kept, so
    a NaN row of weight 0 reaches the sums) and its update, jitted once: their
    gradients are padded to 3 rows (padding id `ROWS`), one shape."""
    tx = _sparse_tx(2, ROWS, mean=True, skip_nonfinite=False)
    return tx, jax.jit(lambda g, s, w: tx.update(g, s, weight=w))


def _rows3(ids, values):
    """An IndexedSlices of `ids` padded to 3 rows with the padding id (values 0)."""
    pad = 3 - len(ids)
    values = np.concatenate([np.asarray(values, np.float32), np.zeros((pad, 2), np.float32)])
    return IndexedSlices(jnp.asarray(list(ids) + [ROWS] * pad), jnp.asarray(values), (ROWS, 2))


def test_sparse_zero_weight_rows_release_zeros_and_count():
    tx, update = _weighted_update()
    state = tx.init(_params())
    slices = _rows3([1, 4, 1], np.full((3, 2), np.nan))
    grad = {"e": slices, "t": slices, "b": jnp.ones(2)}
    _, state = update(grad, state, jnp.float32(0))  # NaN rows of weight 0 add nothing
    slices = _rows3([4], np.ones((1, 2)))
    u, state = update({"e": slices, "t": slices, "b": jnp.ones(2)}, state, jnp.float32(0))
    assert bool(state.emitted) and int(state.global_step) == 1
    assert sorted(int(i) for i in np.asarray(u["e"].indices) if i < ROWS) == [1, 4]
    np.testing.assert_array_equal(_densified(u["e"]), np.zeros((ROWS, 2)))
    np.testing.assert_array_equal(np.asarray(u["t"]), np.zeros((ROWS, 2)))
    np.testing.assert_array_equal(np.asarray(u["b"]), np.zeros(2))


def test_sparse_rows_are_weighted_by_the_gradients_that_touched_them():
    tx, update = _weighted_update()
    state = tx.init(_params())
    first = _rows3([0, 2], [[1.0, 1.0], [2.0, 2.0]])
    second = _rows3([2], [[8.0, 8.0]])
    _, state = update({"e": first, "t": first, "b": jnp.ones(2)}, state, jnp.float32(1))
    u, state = update({"e": second, "t": second, "b": jnp.zeros(2)}, state, jnp.float32(3))
    expected = np.zeros((ROWS, 2))
    expected[0] = 1.0  # touched by the first gradient alone: (1 * 1) / 1
    expected[2] = (1 * 2.0 + 3 * 8.0) / 4
    np.testing.assert_allclose(_densified(u["e"]), expected)
    np.testing.assert_allclose(np.asarray(u["t"]), expected)
    np.testing.assert_allclose(np.asarray(u["b"]), [0.25, 0.25])  # (1 * 1 + 3 * 0) / 4


# --------------------------------------------------------------------------- replicas

_LAGS = np.array([0, -1, 0, 0, 0, -1, 0, 0], np.int32)  # replicas 1 and 5 are stale
_W = np.array([1.0, 5.0, 0.0, 2.0, 0.5, 9.0, 3.0, 1.5], np.float32)


def test_dense_weights_sum_across_replicas_under_pmap():
    tx = conditional_accumulator(optax.identity(), num_required=10, axis_name="d")
    states = jax.pmap(tx.init)(jnp.zeros((8, 2)))
    step = jax.pmap(lambda g, s, ls, w: tx.update(g, s, local_step=ls, weight=w), axis_name="d")
    rng = np.random.default_rng(4)
    acc, wsum, count = np.zeros(2), 0.0, 0
    for _ in range(2):
        grads = rng.integers(-4, 4, size=(8, 2)).astype(np.float64)
        fresh = _LAGS >= 0
        acc += (_W[fresh, None] * grads[fresh]).sum(0)
        wsum, count = wsum + _W[fresh].sum(), count + int(fresh.sum())
        tags = np.asarray(states.global_step) + _LAGS
        out, states = step(jnp.asarray(grads, jnp.float32), states, jnp.asarray(tags), _W)
    assert count >= 10 and np.all(np.asarray(states.emitted))
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(acc / wsum, (8, 2)), rtol=1e-6)
    assert np.all(np.asarray(states.num_dropped) == 4)


def test_sparse_weights_sum_across_replicas_under_pmap():
    """Four replicas (the first four lags and weights above: one stale, one of weight 0),
    as many as needed: up to eight, the row insertion runs the same unrolled code for
    each replica, and each replica adds its own copy to the compiled program."""
    n = 4
    lags, weights = _LAGS[:n], _W[:n]
    tx = _sparse_tx(3, ROWS, mean=True, axis_name="d")
    params = _params()
    states = jax.pmap(lambda _: tx.init(params))(jnp.zeros(n))

    def local(i, v, b, s, ls, w):
        slices = IndexedSlices(i, v, (ROWS, 2))
        return tx.update({"e": slices, "t": slices, "b": b}, s, local_step=ls, weight=w)

    step = jax.pmap(local, axis_name="d")
    rng = np.random.default_rng(5)
    ids = rng.integers(0, ROWS + 1, size=(n, 3))
    values = rng.integers(-4, 4, size=(n, 3, 2)).astype(np.float64)
    b = rng.integers(-4, 4, size=(n, 2)).astype(np.float64)
    ref = _SparseReference(3, ROWS, mean=True)
    released = [ref.offer(ids[r], values[r], b[r], lags[r], float(weights[r])) for r in range(n)]
    expected_e, _, expected_b = released[-1]
    u, states = step(
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(values, jnp.float32),
        jnp.asarray(b, jnp.float32),
        states,
        jnp.asarray(lags),
        weights,
    )
    assert np.all(np.asarray(states.emitted))
    assert np.all(np.asarray(states.num_dropped) == 1)
    u = jax.tree.map(np.asarray, u)  # indexed in NumPy: no slice compiled per replica
    for r in range(n):
        got_e = IndexedSlices(u["e"].indices[r], u["e"].values[r], (ROWS, 2))
        np.testing.assert_allclose(_densified(got_e), expected_e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(u["t"][r], expected_e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(u["b"][r], expected_b, rtol=1e-6)


# --------------------------------------------------------------------------- bad weights


def _both():
    dense = conditional_accumulator(optax.identity(), 2)
    sparse = _sparse_tx(2, ROWS, mean=True)
    g_sparse = IndexedSlices(jnp.array([1]), jnp.ones((1, 2)), (ROWS, 2))
    return [
        (dense, jnp.zeros(3), jnp.ones(3)),
        (sparse, _params(), {"e": g_sparse, "t": g_sparse, "b": jnp.ones(2)}),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    ("weight", "error", "match"),
    [
        (-1.0, ValueError, r"weight must be a non-negative, finite scalar .* got -1.0"),
        (np.float32(np.nan), ValueError, "weight must be a non-negative, finite"),
        (jnp.inf, ValueError, "weight must be a non-negative, finite"),
        (1e39, ValueError, r"\(in float32\)"),
        (np.int64(-3), ValueError, "got -3"),
        (True, TypeError, "weight must be a non-negative real scalar, got True"),
        ("2", TypeError, "weight must be a non-negative real scalar"),
        (1 + 2j, TypeError, "weight must be a non-negative real scalar"),
        (jnp.ones(2), ValueError, r"weight must be a non-negative real scalar, got shape \(2,\)"),
        (np.ones((1, 1)), ValueError, r"got shape \(1, 1\)"),
    ],
)
def test_bad_weight_raises_outside_jit(which, weight, error, match):
    tx, params, grad = _both()[which]
    state = tx.init(params)
    with pytest.raises(error, match=match):
        tx.update(grad, state, weight=weight)
    with pytest.raises(error, match=match):  # stale or not: a bad argument raises
        tx.update(grad, state, local_step=-1, weight=weight)


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "sparse"])
def test_bad_weight_shape_and_dtype_raise_inside_jit(which):
    tx, params, grad = _both()[which]
    state = tx.init(params)
    update = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    with pytest.raises(ValueError, match=r"weight must be .* got shape \(2,\)"):
        update(grad, state, jnp.ones(2))
    with pytest.raises(
        TypeError, match="weight must be a non-negative real scalar, got dtype bool"
    ):
        update(grad, state, jnp.asarray(True))


def _same(a, b) -> bool:
    """Leafwise equality of two trees, NaN equal to NaN."""

    def eq(x, y):
        x, y = np.asarray(x), np.asarray(y)
        return bool(np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))

    return all(jax.tree.leaves(jax.tree.map(eq, a, b)))


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "sparse"])
def test_bad_traced_weight_is_skipped_and_counted(which):
    tx, params, grad = _both()[which]
    update = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    state = tx.init(params)
    _, state = update(grad, state, jnp.float32(2))
    before = state
    for bad in (-1.0, np.nan, np.inf, -np.inf):
        u, state = update(grad, state, jnp.float32(bad))
        assert not bool(state.emitted)
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u) if x.dtype != jnp.int32)
    assert int(state.num_skipped) == 4
    assert _same(state._replace(num_skipped=before.num_skipped), before)
    # The accumulator still releases the good gradient's weighted mean.
    u, state = update(grad, state, jnp.float32(6))
    assert bool(state.emitted) and int(state.num_skipped) == 4


@pytest.mark.parametrize("weight", [jnp.int32(3), np.int8(3), 3])
def test_integer_weights(weight):
    tx = conditional_accumulator(optax.identity(), 2)
    state = tx.init(jnp.zeros(1))
    _, state = tx.update(jnp.array([1.0]), state, weight=weight)
    u, state = jax.jit(tx.update)(jnp.array([5.0]), state, weight=1)
    np.testing.assert_allclose(np.asarray(u), [(3 * 1.0 + 5.0) / 4])
    assert float(state.weight_sum) == 0.0 and bool(state.emitted)
