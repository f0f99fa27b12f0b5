"""IndexedSlices, apply_updates and densify: pytree behaviour, padding, misuse errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, lenient

import optax_accum
from optax_accum import IndexedSlices


def _slices(ids, rows, shape=(4, 2)):
    return IndexedSlices(jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.float32), shape)


def _dense_reference(ids, rows, shape):
    """float64 scatter-add that ignores ids outside [0, rows)."""
    out = np.zeros(shape, np.float64)
    for i, r in zip(ids, np.asarray(rows, np.float64), strict=True):
        if 0 <= i < shape[0]:
            out[i] += r
    return out


# --------------------------------------------------------------------------- construction


def test_validation_names_the_problem():
    with pytest.raises(ValueError, match="indices must be a vector"):
        IndexedSlices(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 2)), (4, 2))
    with pytest.raises(ValueError, match="rank >= 1"):
        IndexedSlices(jnp.zeros((0,), jnp.int32), jnp.float32(1.0), (4, 2))
    with pytest.raises(ValueError, match="expected 2 rows"):
        IndexedSlices(jnp.zeros((2,), jnp.int32), jnp.zeros((1, 2)), (4, 2))
    with pytest.raises(ValueError, match=r"dense_shape\[1:\] = \(2,\), got \(3,\)"):
        IndexedSlices(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3)), (4, 2))
    with pytest.raises(TypeError, match="integer"):
        IndexedSlices(jnp.zeros((2,), jnp.float32), jnp.zeros((2, 2)), (4, 2))
    with pytest.raises(ValueError, match="dense_shape"):
        IndexedSlices(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2)), (-2, 2))
    with pytest.raises(TypeError, match="dense_shape must be a tuple"):
        IndexedSlices(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2)), 4)


def test_tree_operations_rebuild_with_any_leaves():
    g = _slices([0, 2], [[1, 2], [3, 4]])
    assert jax.tree.structure(g).num_leaves == 2
    nones = jax.tree.map(lambda x: None, g)
    assert nones.indices is None and nones.dense_shape == (4, 2)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), g)
    assert specs.values.shape == (2, 2)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), g, g)  # leading batch axis: not validated
    np.testing.assert_array_equal(jax.vmap(IndexedSlices.to_dense)(stacked)[1], g.to_dense())
    out = jax.jit(lambda t: t)(g)
    assert isinstance(out, IndexedSlices) and out.dense_shape == (4, 2)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(g)[0]]
    assert paths == [".indices", ".values"]


def test_to_dense_sums_duplicates_and_ignores_padding():
    ids = [3, 0, 3, 4, -1]  # 4 is the padding id, -1 is out of range (never wrapped)
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    dense = jax.jit(IndexedSlices.to_dense)(_slices(ids, rows))
    np.testing.assert_allclose(dense, _dense_reference(ids, rows, (4, 2)))
    assert _slices(ids, rows).padding_index == 4


def test_unknown_row_count_cannot_densify_alone():
    g = _slices([0, 1], [[1, 1], [2, 2]], (-1, 2))
    with pytest.raises(ValueError, match="known number of rows"):
        g.to_dense()
    np.testing.assert_allclose(optax_accum.apply_updates(jnp.zeros((3, 2)), g)[1], [2, 2])
    tx = optax_accum.densify()
    dense, _ = tx.update(g, tx.init(jnp.zeros((3, 2))), jnp.zeros((3, 2)))
    np.testing.assert_allclose(dense, [[1, 1], [2, 2], [0, 0]])


def test_from_dense_keeps_nonzero_rows_sorted_and_pads():
    dense = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, -2.0]])
    g = jax.jit(lambda d: IndexedSlices.from_dense(d, 3))(dense)
    np.testing.assert_array_equal(g.indices, [1, 3, 4])
    np.testing.assert_array_equal(g.to_dense(), dense)
    every = IndexedSlices.from_dense(dense)
    np.testing.assert_array_equal(every.indices, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="2 nonzero rows, more than num_rows=1"):
        IndexedSlices.from_dense(dense, 1)
    with pytest.raises(ValueError, match="num_rows"):
        IndexedSlices.from_dense(dense, -1)


# --------------------------------------------------------------------------- misuse


def test_arithmetic_is_refused():
    g = _slices([0], [[1, 1]])
    for op in (lambda: g * 2.0, lambda: 0.1 * g, lambda: g + g, lambda: -g, lambda: g / 2):
        with pytest.raises(TypeError, match="does not support arithmetic"):
            op()
    with pytest.raises(TypeError, match="not an array"):
        jnp.asarray(g)


@pytest.mark.parametrize(
    "make_tx", [lambda: lenient(optax.sgd(0.1)), lambda: adam(0.1)], ids=["sgd", "adam"]
)
def test_optax_elementwise_transform_on_raw_slices_raises(make_tx):
    """optax would scale the ids as well; the float ids it produces are refused.

    (Under standard promotion, as users run; strict promotion fails even earlier.)
    """
    tx = make_tx()
    g = _slices([0, 3], [[1, 1], [2, 2]])
    with pytest.raises(TypeError, match="densify"):
        jax.jit(tx.update)(g, tx.init(g))


# --------------------------------------------------------------------------- apply_updates


def test_apply_updates_scatters_slices_and_adds_dense_leaves():
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(3,)), jnp.bfloat16),
        "none": None,
    }
    ids = [5, 1, 5, 6, -3]
    rows = rng.normal(size=(5, 3)).astype(np.float32)
    updates = {
        "emb": _slices(ids, rows, (6, 3)),
        "w": jnp.ones(3, jnp.bfloat16),
        "none": None,
    }
    new = jax.jit(optax_accum.apply_updates)(params, updates)
    expected = np.asarray(params["emb"], np.float64) + _dense_reference(ids, rows, (6, 3))
    np.testing.assert_allclose(new["emb"], expected, rtol=1e-6)
    dense_only = optax.apply_updates({"w": params["w"]}, {"w": updates["w"]})
    assert new["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(new["w"], dense_only["w"])
    assert new["none"] is None
    untouched = np.array([0, 2, 3, 4])
    np.testing.assert_array_equal(new["emb"][untouched], params["emb"][untouched])


def test_apply_updates_rejects_mismatched_slices():
    with pytest.raises(ValueError, match=r"updates\['e'\] has dense_shape \(5, 2\)"):
        optax_accum.apply_updates({"e": jnp.zeros((4, 2))}, {"e": _slices([0], [[1, 1]], (5, 2))})
    float_ids = jax.tree.map(lambda x: x, _slices([0], [[1, 1]]))
    float_ids.indices = float_ids.indices.astype(jnp.float32)
    with pytest.raises(TypeError, match="must be integer"):
        optax_accum.apply_updates(jnp.zeros((4, 2)), float_ids)


# --------------------------------------------------------------------------- densify


def test_densify_then_adam_equals_adam_on_the_dense_gradient():
    rng = np.random.default_rng(1)
    params = {"emb": jnp.zeros((5, 2)), "b": jnp.zeros(2)}
    sparse_tx = optax.chain(optax_accum.densify(), adam(0.1))
    dense_tx = adam(0.1)
    s_state, d_state = sparse_tx.init(params), dense_tx.init(params)
    s_update, d_update = jax.jit(sparse_tx.update), jax.jit(dense_tx.update)
    for _ in range(3):
        ids = rng.integers(0, 6, size=4)  # 5 is the padding id
        rows = rng.normal(size=(4, 2))
        g = {"emb": _slices(ids, rows, (5, 2)), "b": jnp.asarray(rng.normal(size=2), jnp.float32)}
        dense_g = {
            "emb": jnp.asarray(_dense_reference(ids, rows, (5, 2)), jnp.float32),
            "b": g["b"],
        }
        su, s_state = s_update(g, s_state, params)
        du, d_state = d_update(dense_g, d_state, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), su, du)


def test_densify_passes_unknown_extra_args_and_works_without_params():
    tx = optax_accum.densify()
    out, state = tx.update(_slices([1], [[2, 2]]), tx.init(None), unknown=3)
    assert state == optax.EmptyState()
    np.testing.assert_array_equal(out[1], [2, 2])


@pytest.mark.parametrize("leaf", ["indices", "values"])
@pytest.mark.parametrize("kind", [list, tuple, float])
def test_python_lists_tuples_and_numbers_are_refused_at_construction(leaf, kind):
    ok = {"indices": jnp.array([0, 1]), "values": jnp.ones((2, 2))}
    bad = {"indices": [0, 1], "values": [[1.0, 1.0], [1.0, 1.0]]}[leaf]
    bad = 1.0 if kind is float else kind(bad)
    with pytest.raises(
        TypeError, match=rf"IndexedSlices {leaf} must be an array .*got {kind.__name__}"
    ):
        IndexedSlices(**{**ok, leaf: bad}, dense_shape=(4, 2))
    # Spec trees (shard_map's in_specs / out_specs) are built with the constructor too.
    spec = IndexedSlices(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec("i"), (4, 2))
    assert spec.values == jax.sharding.PartitionSpec("i")


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "uint16", "uint32", "int32"])
def test_ids_of_every_integer_dtype_scatter_exactly(dtype):
    """to_dense, apply_updates and densify compare ids with the row count exactly: a
    uint8 255 is a row of a 300-row table, an int8 -1 is padding."""
    info = np.iinfo(dtype)
    ids = np.array([i for i in (-1, 0, 127, 255, 299) if info.min <= i <= info.max], dtype)
    values = np.arange(1, len(ids) + 1, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    g = IndexedSlices(jnp.asarray(ids), jnp.asarray(values), (300, 2))
    expected = np.zeros((300, 2), np.float32)
    for i, v in zip(ids.astype(np.int64), values, strict=True):
        if 0 <= i < 300:
            expected[i] += v
    np.testing.assert_array_equal(jax.jit(IndexedSlices.to_dense)(g), expected)
    table = jax.jit(optax_accum.apply_updates)(jnp.zeros((300, 2)), g)
    np.testing.assert_array_equal(table, expected)
    dense, _ = optax_accum.densify().update(g, optax.EmptyState(), jnp.zeros((300, 2)))
    np.testing.assert_array_equal(dense, expected)


def test_int64_ids_beyond_int32_are_padding_under_x64():
    with jax.enable_x64(True):
        ids = jnp.array([2**32 + 1, 2, -(2**40), 2**31], jnp.int64)
        g = IndexedSlices(ids, jnp.ones((4, 1), jnp.float32), (3, 1))
        np.testing.assert_array_equal(jax.jit(IndexedSlices.to_dense)(g)[:, 0], [0, 0, 1])
