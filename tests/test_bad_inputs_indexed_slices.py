"""Malformed calls to IndexedSlices, apply_updates and densify get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import Bad, check, ids, slices

import optax_accum
from optax_accum import IndexedSlices

BAD: list[Bad] = [
    Bad(
        "IndexedSlices/list indices",
        lambda: IndexedSlices([0, 1], jnp.ones((2, 2)), (10, 2)),
        TypeError,
        r"IndexedSlices indices must be an array \(jax\.Array or numpy\.ndarray\), got list",
    ),
    Bad(
        "IndexedSlices/list values",
        lambda: IndexedSlices(jnp.array([0]), [[1.0, 2.0]], (10, 2)),
        TypeError,
        r"IndexedSlices values must be an array \(jax\.Array or numpy\.ndarray\), got list",
    ),
    Bad(
        "IndexedSlices/float indices",
        lambda: IndexedSlices(jnp.array([0.0]), jnp.ones((1, 2)), (10, 2)),
        TypeError,
        r"IndexedSlices\.indices must be integer, got dtype float32",
    ),
    Bad(
        "IndexedSlices/matrix indices",
        lambda: IndexedSlices(jnp.array([[0]]), jnp.ones((1, 2)), (10, 2)),
        ValueError,
        r"indices must be a vector, got shape \(1, 1\)",
    ),
    Bad(
        "IndexedSlices/scalar values",
        lambda: IndexedSlices(jnp.array([0]), jnp.float32(1), (10, 2)),
        ValueError,
        r"values must have rank >= 1 \(one row per index\), got a scalar",
    ),
    Bad(
        "IndexedSlices/rows != indices",
        lambda: IndexedSlices(jnp.array([0, 1]), jnp.ones((1, 2)), (10, 2)),
        ValueError,
        r"values must have one row per index: expected 2 rows, got values of shape \(1, 2\)",
    ),
    Bad(
        "IndexedSlices/row shape",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 3)), (10, 2)),
        ValueError,
        r"values rows must have shape dense_shape\[1:\] = \(2,\), got \(3,\)",
    ),
    Bad(
        "IndexedSlices/dense_shape=None",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), None),
        TypeError,
        r"dense_shape must be a tuple of ints, got None",
    ),
    Bad(
        "IndexedSlices/dense_shape str",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), "10,2"),
        TypeError,
        r"dense_shape must be a tuple of ints, got '10,2' \(str\)",
    ),
    Bad(
        "IndexedSlices/dense_shape float",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (10.5, 2)),
        TypeError,
        r"dense_shape must be a tuple of ints, got \(10\.5, 2\)",
    ),
    Bad(
        "IndexedSlices/dense_shape=()",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), ()),
        ValueError,
        r"dense_shape must have at least one dimension \(the rows\), got \(\)",
    ),
    Bad(
        "IndexedSlices/negative dense_shape",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (10, -2)),
        ValueError,
        r"dense_shape must hold non-negative sizes.*got \(10, -2\)",
    ),
    Bad(
        "IndexedSlices/arithmetic",
        lambda: slices([0], [[1, 2]]) * 2.0,
        TypeError,
        r"IndexedSlices does not support arithmetic",
    ),
    Bad(
        "IndexedSlices/as an array",
        lambda: jnp.asarray(slices([0], [[1, 2]])),
        TypeError,
        r"IndexedSlices is not an array; call \.to_dense\(\)",
    ),
    Bad(
        "IndexedSlices.to_dense/unknown rows",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (-1, 2)).to_dense(),
        ValueError,
        r"to_dense\(\) needs a known number of rows, but dense_shape is \(-1, 2\)",
    ),
    Bad(
        "IndexedSlices.from_dense/scalar",
        lambda: IndexedSlices.from_dense(jnp.float32(1)),
        ValueError,
        r"dense must have rank >= 1, got shape \(\)",
    ),
    Bad(
        "IndexedSlices.from_dense/num_rows=-1",
        lambda: IndexedSlices.from_dense(jnp.ones((3, 2)), -1),
        ValueError,
        r"num_rows must be None or an int >= 0, got -1",
    ),
    Bad(
        "IndexedSlices.from_dense/too many rows",
        lambda: IndexedSlices.from_dense(jnp.ones((3, 2)), 1),
        ValueError,
        r"dense has 3 nonzero rows, more than num_rows=1",
    ),
    Bad(
        "apply_updates/row count mismatch",
        lambda: jax.jit(optax_accum.apply_updates)(jnp.zeros((5, 2)), slices([0], [[1, 2]])),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(5, 2\)",
    ),
    Bad(
        "apply_updates/tree mismatch",
        lambda: jax.jit(optax_accum.apply_updates)({"a": jnp.zeros(2)}, {"b": jnp.zeros(2)}),
        ValueError,
        r"updates must have the tree structure of params: expected PyTreeDef\(\{'a': \*\}\), "
        r"got PyTreeDef\(\{'b': \*\}\)",
    ),
    Bad(
        "apply_updates/vector param",
        lambda: jax.jit(optax_accum.apply_updates)(jnp.zeros(10), slices([0], [[1, 2]])),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(10,\)",
    ),
    Bad(
        "densify/param mismatch",
        lambda: jax.jit(lambda g, p: optax_accum.densify().update(g, optax.EmptyState(), p))(
            slices([0], [[1, 2]]), jnp.zeros((4, 2))
        ),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(4, 2\)",
    ),
    Bad(
        "densify/unknown rows without params",
        lambda: optax_accum.densify().update(
            IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (-1, 2)), optax.EmptyState()
        ),
        ValueError,
        r"needs a known number of rows, but dense_shape is \(-1, 2\)",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
