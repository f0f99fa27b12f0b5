"""Malformed calls to sparse_conditional_accumulator get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_inputs import (
    GRADS,
    LOCAL_STEP_VECTOR,
    PARAMS,
    SGD,
    TABLE,
    UNBOUND,
    Bad,
    check,
    ids,
    jit_update,
    slices,
    sparse_tx,
    sparse_update,
)

import optax_accum
from optax_accum import IndexedSlices

BAD: list[Bad] = [
    Bad(
        "sparse/inner='sgd'",
        lambda: optax_accum.sparse_conditional_accumulator("sgd", 2, capacity=4),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "sparse/capacity=0",
        lambda: sparse_tx(capacity=0),
        ValueError,
        r"capacity must be a positive int, got 0",
    ),
    Bad(
        "sparse/capacity=4.0",
        lambda: sparse_tx(capacity=4.0),
        TypeError,
        r"capacity must be a positive int, got 4\.0 \(float\)",
    ),
    Bad(
        "sparse/num_required=-1",
        lambda: optax_accum.sparse_conditional_accumulator(SGD, -1, capacity=4),
        ValueError,
        r"num_required must be a positive int, got -1",
    ),
    Bad(
        "sparse/reduction",
        lambda: sparse_tx(reduction="avg"),
        ValueError,
        r"reduction must be \"mean\", \"sum\", \"max\" or \"min\" \(any case\), .*; got 'avg'",
    ),
    Bad(
        "sparse/communication_dtype",
        lambda: sparse_tx(communication_dtype="float16"),
        ValueError,
        r"communication_dtype must be None, .*, got float16",
    ),
    Bad(
        "sparse/sparse mask of another tree",
        lambda: sparse_tx(sparse={"a": True}).init(PARAMS),
        ValueError,
        r"sparse must be a tree of bools with the params' structure.*expected .*got "
        r"PyTreeDef\(\{'a': \*\}\)",
    ),
    Bad(
        "sparse/sparse mask of ints",
        lambda: sparse_tx(sparse={"w": 1, "b": 0}),
        TypeError,
        r"sparse must be a bool, got [01] \(int\)",
    ),
    Bad(
        "sparse/table of zero rows",
        lambda: sparse_tx(sparse=True).init(jnp.zeros((0, 2))),
        ValueError,
        r"params must have at least one row to be sparse, got shape \(0, 2\)",
    ),
    Bad(
        "sparse/IndexedSlices for a scalar leaf",
        lambda: jit_update(
            sparse_tx(sparse={"w": False, "b": False}),
            {"w": GRADS["w"], "b": IndexedSlices(jnp.array([0]), jnp.ones((1,)), (1,))},
            {"w": jnp.zeros((2, 3)), "b": jnp.zeros(())},
        ),
        ValueError,
        r"updates\['b'\] must have dense_shape \(\), got \(1,\)",
    ),
    Bad(
        "sparse/dense gradient for a sparse leaf",
        lambda: sparse_update(jnp.ones((10, 2))),
        TypeError,
        r"updates must be an IndexedSlices \(this leaf accumulates sparsely\), got",
    ),
    Bad(
        "sparse/dense_shape mismatch",
        lambda: sparse_update(slices([0], [[1, 2]], (11, 2))),
        ValueError,
        r"updates must have dense_shape \(10, 2\), got \(11, 2\)",
    ),
    Bad(
        "sparse/integer values",
        lambda: sparse_update(IndexedSlices(jnp.array([0]), jnp.ones((1, 2), jnp.int32), (10, 2))),
        TypeError,
        r"updates\.values must be floating, got dtype int32",
    ),
    Bad(
        "sparse/local_step vector",
        lambda: sparse_update(slices([0], [[1, 2]]), local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "sparse/unbound axis_name",
        lambda: jit_update(sparse_tx(axis_name="i"), slices([0], [[1, 2]]), TABLE),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "sparse.update/state of another transform",
        lambda: jit_update(sparse_tx(), slices([0], [[1, 2]]), TABLE, state=optax.EmptyState()),
        TypeError,
        r"state must be a SparseConditionalAccumulatorState \(as returned by this "
        r"transform's init\), got EmptyState",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)


# --------------------------------------------------------------------------- values inside jit


def test_out_of_range_sparse_ids_are_dropped_inside_jit():
    """Ids outside [0, rows) cannot raise under jit: those rows are ignored and counted."""
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=4, reduction="sum"
    )
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(TABLE)
    bad = slices([1, 10, -3, 2**30], [[1.0, 1.0], [9.0, 9.0], [7.0, 7.0], [5.0, 5.0]])
    _, state = step(bad, state)
    assert int(optax_accum.num_accumulated(state)) == 1
    assert int(state.num_out_of_range) == 2  # -3 and 2**30; id 10 is the padding id
    updates, state = step(slices([0], [[2.0, 0.0]]), state)
    dense = updates.to_dense()
    expected = np.zeros((10, 2), np.float32)
    expected[0], expected[1] = [-2.0, 0.0], [-1.0, -1.0]
    np.testing.assert_array_equal(np.asarray(dense), expected)
    assert np.isfinite(np.asarray(updates.values)).all()


def test_capacity_overflow_is_rejected_whole_and_counted_inside_jit():
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=3, reduction="sum"
    )
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(TABLE)
    _, state = step(slices([0, 1], [[1.0, 0.0], [0.0, 1.0]]), state)
    before = state
    # Two new rows on top of two: four distinct rows > capacity 3, rejected whole.
    _, state = step(slices([2, 3], [[5.0, 5.0], [6.0, 6.0]]), state)
    assert int(state.num_overflowed) == 1
    assert int(optax_accum.num_accumulated(state)) == 1
    fits = slices([1, 2], [[1.0, 1.0], [2.0, 2.0]])  # three distinct rows: fits
    updates, state = step(fits, state)
    # The rejected gradient left nothing behind: the same release as without it.
    unrejected, _ = step(fits, before)
    assert updates.to_dense().tobytes() == unrejected.to_dense().tobytes()
    expected = np.zeros((10, 2), np.float32)
    expected[0], expected[1], expected[2] = [-1.0, 0.0], [-1.0, -2.0], [-2.0, -2.0]
    np.testing.assert_array_equal(np.asarray(updates.to_dense()), expected)
    assert int(state.num_overflowed) == 1
