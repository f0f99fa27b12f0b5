"""NaN and Inf gradients: the documented policy, for every accumulating transform.

Policy (README, "Guarantees"):
- Default: a gradient is accumulated as given, as TF does. An accepted Inf or NaN shows
  in the released aggregate, in its own elements (or rows) only.
- A held gradient never makes NaN on its own: a holding step returns exact zeros.
  A dropped gradient (stale, or rejected for overflowing a sparse capacity) and a
  padding row never reach the state or the updates at all.
- `skip_nonfinite=True` skips a fresh gradient holding any NaN or Inf (it is neither
  accumulated nor counted toward `num_required`) and counts it in `num_nonfinite`.
  A stale gradient is dropped (and counted in `num_dropped`) whatever it holds.

Covered: conditional_accumulator (alone and shared over an axis),
sparse_conditional_accumulator (sparse and dense leaves), agn, drop_stale_gradients,
and the host ConditionalAccumulator and SparseConditionalAccumulator.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, spent_as_zeros
from _host import WAIT

import optax_accum
from optax_accum import IndexedSlices

SGD = optax.sgd(1.0)
ADAM = adam(0.1)
SPARSE_SGD = optax_accum.sparse_sgd(1.0)
BAD = [np.inf, -np.inf, np.nan]
BAD_IDS = ["inf", "-inf", "nan"]


def _poisoned(value: float, shape=(2, 3), at=(0, 1)) -> np.ndarray:
    """Ones with `value` at `at`, as float32."""
    g = np.ones(shape, np.float32)
    g[at] = value
    return g


@functools.cache
def _stepper(factory, *args, **kw):
    """(tx, jitted step) for `factory(*args, **kw)`, built once per module: the
    parametrizations reuse one compilation."""
    tx = factory(*args, **kw)
    return tx, jax.jit(lambda g, s, p, ls: tx.update(g, s, p, local_step=ls))


def _same(a, b) -> bool:
    """Bit-identical trees (NaN equals NaN)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def _all_finite(tree) -> bool:
    return all(
        np.isfinite(np.asarray(x, np.float64)).all()
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    )


def _same_nonfinite_pattern(got: np.ndarray, want: np.ndarray) -> None:
    """Equal where finite; the same Inf (with sign) or NaN elsewhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), (got, want)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])


# --------------------------------------------------------------------------- dense accumulator


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_accepted_and_held_nonfinite_is_accumulated_as_given(bad, reduction):
    tx, step = _stepper(optax_accum.conditional_accumulator, SGD, 2, reduction=reduction)
    params = jnp.zeros((2, 3))
    state = tx.init(params)
    held, state = step(jnp.asarray(_poisoned(bad)), state, params, 0)
    np.testing.assert_array_equal(np.asarray(held), np.zeros((2, 3)))  # exact zeros, no NaN
    released, state = step(jnp.full((2, 3), 3.0), state, params, 0)
    total = _poisoned(bad).astype(np.float64) + 3.0
    want = -(total / 2 if reduction == "mean" else total)
    _same_nonfinite_pattern(released, want)  # only the poisoned element is non-finite
    assert int(state.num_nonfinite) == 0 and int(optax_accum.global_step(state)) == 1


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_dropped_nonfinite_reaches_neither_state_nor_updates(bad):
    tx, step = _stepper(optax_accum.conditional_accumulator, ADAM, 2)
    params = jnp.zeros((2, 3))
    _, state = step(jnp.ones((2, 3)), tx.init(params), params, 0)
    _, state = step(jnp.ones((2, 3)), state, params, 1)  # releases: global step 1
    before = state
    updates, state = step(jnp.asarray(_poisoned(bad)), state, params, 0)  # stale
    np.testing.assert_array_equal(np.asarray(updates), np.zeros((2, 3)))
    assert int(state.num_dropped) == 1
    after = state._replace(num_dropped=before.num_dropped, emitted=before.emitted)
    assert _same(spent_as_zeros(after), spent_as_zeros(before))


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_skip_nonfinite_skips_counts_and_releases_the_finite_mean(bad):
    tx, step = _stepper(optax_accum.conditional_accumulator, ADAM, 2, skip_nonfinite=True)
    clean, clean_step = _stepper(optax_accum.conditional_accumulator, ADAM, 2)
    params = jnp.zeros((2, 3))
    state, clean_state = tx.init(params), clean.init(params)
    grads = [jnp.full((2, 3), 1.0), jnp.asarray(_poisoned(bad)), jnp.full((2, 3), 5.0)]
    outs = []
    for g in grads:
        updates, state = step(g, state, params, 0)
        outs.append(updates)
    assert int(state.num_nonfinite) == 1 and int(state.num_dropped) == 0
    assert int(optax_accum.global_step(state)) == 1
    np.testing.assert_array_equal(np.asarray(outs[1]), np.zeros((2, 3)))  # skipped: held
    for g in (grads[0], grads[2]):
        want, clean_state = clean_step(g, clean_state, params, 0)
    assert _same(outs[2], want)  # the release is the finite gradients' alone
    state = state._replace(num_nonfinite=clean_state.num_nonfinite)
    assert _same(spent_as_zeros(state), spent_as_zeros(clean_state))


def test_skip_nonfinite_stale_gradient_counts_as_dropped_not_nonfinite():
    tx, step = _stepper(optax_accum.conditional_accumulator, SGD, 1, skip_nonfinite=True)
    params = jnp.zeros(2)
    _, state = step(jnp.ones(2), tx.init(params), params, 0)
    _, state = step(jnp.array([np.nan, 1.0], np.float32), state, params, 0)  # stale
    assert (int(state.num_dropped), int(state.num_nonfinite)) == (1, 0)


def test_skip_nonfinite_under_an_axis_counts_the_replica_and_keeps_the_others():
    """Replica 1 offers NaN: the shared release is replica 0's gradient alone."""
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), 1, axis_name="r", skip_nonfinite=True)
    step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="r"))
    params = jnp.zeros((2, 3))
    state = jax.vmap(tx.init)(params)
    grads = jnp.stack([jnp.full(3, 2.0), jnp.array([1.0, np.nan, 1.0], np.float32)])
    updates, state = step(grads, state)
    np.testing.assert_array_equal(np.asarray(updates), np.full((2, 3), -2.0))
    np.testing.assert_array_equal(np.asarray(state.num_nonfinite), [1, 1])
    assert _all_finite(state)


def test_float16_gradients_whose_sum_overflows_float16_release_a_finite_mean():
    """float16 accumulates in float32, so a mean of large gradients does not become Inf."""
    tx, step = _stepper(optax_accum.conditional_accumulator, SGD, 2)
    params = jnp.zeros(2, jnp.float16)
    state = tx.init(params)
    big = jnp.full(2, 60000.0, jnp.float16)  # big + big overflows float16 (max 65504)
    _, state = step(big, state, params, 0)
    updates, state = step(big, state, params, 0)
    assert updates.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(updates, np.float32), [-60000.0, -60000.0])


# --------------------------------------------------------------------------- sparse accumulator

ROWS = 6


def _sparse_accumulator(**kw):
    return optax_accum.sparse_conditional_accumulator(
        SPARSE_SGD, 2, sparse={"emb": True, "b": False}, **kw
    )


def _sparse_tx(capacity: int, reduction: str = "mean", **kw):
    # Spelled out in one way, so the tests that build the same accumulator share its step.
    return _stepper(_sparse_accumulator, capacity=capacity, reduction=reduction, **kw)


def _sparse_grads(ids, rows, b=(1.0, 1.0)) -> dict:
    """A sparse gradient of `ids`, padded to two ids with a padding row (id `ROWS`, zero
    values), so that each accumulator compiles its step once for all the 1- and 2-id
    gradients (the padding test's 4 ids are the one other shape)."""
    ids, rows = list(ids), [list(r) for r in rows]
    while len(ids) < 2:
        ids, rows = [*ids, ROWS], [*rows, [0.0, 0.0]]
    return {
        "emb": IndexedSlices(
            jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.float32), (ROWS, 2)
        ),
        "b": jnp.asarray(b, jnp.float32),
    }


SPARSE_PARAMS = {"emb": jnp.zeros((ROWS, 2)), "b": jnp.zeros(2)}


def _dense_updates(updates) -> dict:
    return {"emb": np.asarray(updates["emb"].to_dense()), "b": np.asarray(updates["b"])}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_sparse_nonfinite_row_stays_in_its_row(bad, reduction):
    tx, step = _sparse_tx(capacity=4, reduction=reduction)
    state = tx.init(SPARSE_PARAMS)
    held, state = step(
        _sparse_grads([1, 2], [[bad, 1.0], [2.0, 2.0]], b=(bad, 0.0)), state, SPARSE_PARAMS, 0
    )
    assert _all_finite(held["emb"].values) and _all_finite(held["b"])
    assert np.all(np.asarray(held["emb"].values) == 0) and np.all(np.asarray(held["b"]) == 0)
    released, state = step(
        _sparse_grads([2, 3], [[4.0, 4.0], [3.0, 3.0]], b=(1.0, 1.0)), state, SPARSE_PARAMS, 0
    )
    want = np.zeros((ROWS, 2))
    want[1] = [bad, 1.0]
    want[2] = [3.0, 3.0] if reduction == "mean" else [6.0, 6.0]  # touched twice
    want[3] = [3.0, 3.0]
    want_b = np.array([bad + 1.0, 1.0]) / (2 if reduction == "mean" else 1)
    got = _dense_updates(released)
    _same_nonfinite_pattern(got["emb"], -want)
    _same_nonfinite_pattern(got["b"], -want_b)
    padding = np.asarray(released["emb"].indices) >= ROWS
    assert np.all(np.asarray(released["emb"].values)[padding] == 0)  # padding rows stay zero


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_sparse_padding_and_out_of_range_rows_never_reach_the_state(bad):
    tx, step = _sparse_tx(capacity=4)
    state = tx.init(SPARSE_PARAMS)
    grads = _sparse_grads([0, ROWS, -1, ROWS + 7], [[1.0, 1.0], [bad, bad], [bad, 0.0], [bad, 1.0]])
    _, state = step(grads, state, SPARSE_PARAMS, 0)
    assert int(optax_accum.num_accumulated(state)) == 1
    assert _all_finite(state)
    released, state = step(_sparse_grads([0], [[1.0, 1.0]]), state, SPARSE_PARAMS, 0)
    assert _all_finite(released)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_sparse_stale_and_overflowing_nonfinite_reach_nothing(bad):
    tx, step = _sparse_tx(capacity=2)
    state = tx.init(SPARSE_PARAMS)
    _, state = step(_sparse_grads([0, 1], [[1.0, 1.0], [1.0, 1.0]]), state, SPARSE_PARAMS, 0)
    before = state
    # Overflowing: two new rows on top of two, capacity 2; rejected whole.
    updates, state = step(
        _sparse_grads([2, 3], [[bad, 1.0], [1.0, bad]], b=(bad, bad)), state, SPARSE_PARAMS, 0
    )
    assert int(state.num_overflowed) == 1 and _all_finite(updates)
    # Stale: tagged -1 while the global step is 0.
    updates, state = step(_sparse_grads([0], [[bad, bad]], b=(bad, bad)), state, SPARSE_PARAMS, -1)
    assert int(state.num_dropped) == 1 and _all_finite(updates)
    assert (int(state.count), int(optax_accum.global_step(state))) == (1, 0)
    # Neither left a trace: the next release is the one without them, bit for bit.
    finish = _sparse_grads([1], [[2.0, 2.0]])
    released, _ = step(finish, state, SPARSE_PARAMS, 0)
    unpoisoned, _ = step(finish, before, SPARSE_PARAMS, 0)
    assert _all_finite(released)
    assert _same(_dense_updates(released), _dense_updates(unpoisoned))


@pytest.mark.parametrize("where", ["sparse", "dense"])
def test_sparse_skip_nonfinite_skips_and_counts(where):
    tx, step = _sparse_tx(capacity=4, skip_nonfinite=True)
    clean, clean_step = _sparse_tx(capacity=4)
    state, clean_state = tx.init(SPARSE_PARAMS), clean.init(SPARSE_PARAMS)
    good = [_sparse_grads([0], [[1.0, 2.0]]), _sparse_grads([0, 1], [[3.0, 3.0], [4.0, 4.0]])]
    poisoned = (
        _sparse_grads([2], [[np.nan, 1.0]])
        if where == "sparse"
        else _sparse_grads([2], [[1.0, 1.0]], b=(np.inf, 0.0))
    )
    for g in (good[0], poisoned, good[1]):
        updates, state = step(g, state, SPARSE_PARAMS, 0)
    for g in good:
        want, clean_state = clean_step(g, clean_state, SPARSE_PARAMS, 0)
    assert int(state.num_nonfinite) == 1
    assert _same(updates, want)
    state = state._replace(num_nonfinite=clean_state.num_nonfinite)
    assert _same(spent_as_zeros(state), spent_as_zeros(clean_state))


def test_sparse_skip_nonfinite_ignores_padding_rows():
    """A NaN in a padding row is no part of the gradient: it is not skipped for it."""
    tx, step = _sparse_tx(capacity=4, skip_nonfinite=True)
    state = tx.init(SPARSE_PARAMS)
    grads = _sparse_grads([0, ROWS], [[1.0, 1.0], [np.nan, np.nan]])
    _, state = step(grads, state, SPARSE_PARAMS, 0)
    assert int(state.num_nonfinite) == 0 and int(optax_accum.num_accumulated(state)) == 1


# --------------------------------------------------------------------------- agn and drop_stale


def _agn(**kw):
    return optax_accum.agn(optax.sgd(0.1), kw.pop("period"), **kw)


def _agn_run(grads, **kw):
    tx, step = _stepper(_agn, **kw)
    params = jnp.zeros(3)
    state = tx.init(params)
    for g in grads:
        updates, state = step(jnp.asarray(g, jnp.float32), state, params, 0)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_agn_default_applies_a_nonfinite_gradient_as_given(bad):
    grads = [[1.0, 1.0, 1.0], [bad, 1.0, 1.0]]
    params, state = _agn_run(grads, period=4)
    step = np.float32(-0.1) * np.asarray(grads, np.float32)
    want = step[0] + step[1]  # as float32 SGD computes it
    _same_nonfinite_pattern(params, want)
    assert int(state.num_nonfinite) == 0


@pytest.mark.parametrize("commit", ["gradients", "delta"])
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_agn_skip_nonfinite_is_a_zero_gradient_step_and_counted(bad, commit):
    """Skipped: the local step still counts (replicas stay in step), nothing else moves."""
    kw = {"commit": commit}
    grads = [[1.0, 2.0, 3.0], [bad, 1.0, 1.0], [1.0, 1.0, 1.0], [2.0, 0.0, 1.0]]
    params, state = _agn_run(grads, period=2, skip_nonfinite=True, **kw)
    zeroed = [grads[0], [0.0, 0.0, 0.0], *grads[2:]]
    want_params, want_state = _agn_run(zeroed, period=2, **kw)
    np.testing.assert_array_equal(np.asarray(params), np.asarray(want_params))
    np.testing.assert_array_equal(np.asarray(state.centre), np.asarray(want_state.centre))
    assert int(state.num_nonfinite) == 1 and int(optax_accum.global_step(state)) == 2
    assert _all_finite(state)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_drop_stale_gradients_dropped_nonfinite_reaches_nothing(bad):
    tx, step = _stepper(optax_accum.drop_stale_gradients, ADAM, 0)
    params = jnp.zeros(3)
    _, state = step(jnp.ones(3), tx.init(params), params, 0)
    before = state
    updates, state = step(jnp.full(3, bad, jnp.float32), state, params, 0)  # lag 1 > 0
    np.testing.assert_array_equal(np.asarray(updates), np.zeros(3))
    assert int(state.num_dropped) == 1
    after = state._replace(num_dropped=before.num_dropped, emitted=before.emitted)
    assert _same(spent_as_zeros(after), spent_as_zeros(before))


# --------------------------------------------------------------------------- host objects


def _take(acc, n):
    return acc.take_grad(n, timeout=WAIT)


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_host_dense_accumulates_nonfinite_as_given_and_drops_stale(bad, reduction):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2, 3), reduction_type=reduction)
    assert acc.apply_grad(_poisoned(bad), local_step=0)
    assert acc.apply_grad(np.full((2, 3), 3.0, np.float32), local_step=0)
    total = _poisoned(bad).astype(np.float64) + 3.0
    _same_nonfinite_pattern(_take(acc, 2), total / 2 if reduction == "MEAN" else total)
    assert not acc.apply_grad(_poisoned(bad), local_step=0)  # stale now: dropped
    assert acc.apply_grad(np.full((2, 3), 2.0, np.float32), local_step=1)
    np.testing.assert_array_equal(np.asarray(_take(acc, 1)), np.full((2, 3), 2.0))
    assert (acc.num_dropped, acc.num_nonfinite) == (1, 0)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_host_dense_skip_nonfinite_does_not_complete_a_waiting_take(bad):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), skip_nonfinite=True)
    result = {}
    taker = threading.Thread(target=lambda: result.update(value=_take(acc, 1)), daemon=True)
    taker.start()
    while acc.num_waiting_takes() == 0 and taker.is_alive():
        taker.join(0.001)
    assert not acc.apply_grad(np.array([bad, 1.0], np.float32), local_step=0)
    assert acc.num_waiting_takes() == 1 and acc.num_accumulated() == 0
    assert acc.apply_grad(np.array([4.0, 6.0], np.float32), local_step=0)
    taker.join(WAIT)
    assert not taker.is_alive()
    np.testing.assert_array_equal(np.asarray(result["value"]), [4.0, 6.0])
    assert (acc.num_nonfinite, acc.num_dropped, acc.global_step) == (1, 0, 1)
    assert not acc.apply_grad(np.array([bad, 1.0], np.float32), local_step=0)  # stale
    assert (acc.num_nonfinite, acc.num_dropped) == (1, 1)


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_host_sparse_nonfinite_row_stays_in_its_row(bad):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    assert acc.apply_grad([0, 1], np.array([[bad, 1.0], [2.0, 2.0]], np.float32))
    assert acc.apply_grad([1, 3], np.array([[4.0, 4.0], [1.0, 1.0]], np.float32))
    indices, values, _ = _take(acc, 2)
    assert indices.tolist() == [0, 1, 3]
    _same_nonfinite_pattern(values, np.array([[bad, 1.0], [3.0, 3.0], [1.0, 1.0]]))
    assert not acc.apply_grad([2], np.array([[bad, bad]], np.float32), local_step=0)  # stale
    assert acc.apply_grad([2], np.array([[1.0, 1.0]], np.float32), local_step=1)
    indices, values, _ = _take(acc, 1)
    assert indices.tolist() == [2] and np.asarray(values).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
def test_host_sparse_skip_nonfinite_skips_and_counts(bad):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2), skip_nonfinite=True)
    assert acc.apply_grad([0], np.array([[2.0, 2.0]], np.float32))
    assert not acc.apply_grad([0, 1], np.array([[bad, 1.0], [1.0, 1.0]], np.float32))
    assert acc.num_accumulated() == 1 and acc.num_nonfinite == 1
    assert acc.apply_grad([0], np.array([[4.0, 0.0]], np.float32))
    indices, values, _ = _take(acc, 2)
    assert indices.tolist() == [0] and np.asarray(values).tolist() == [[3.0, 1.0]]
