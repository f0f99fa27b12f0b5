"""embedding_value_and_grad on Flax models, and training one through the sparse path."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

VOCAB, DIM, CLASSES, BAG = 40, 4, 2, 6


class Bag(nn.Module):
    """Embedding bag: token and position embeddings, mean-pooled, then a Dense head."""

    @nn.compact
    def __call__(self, ids):
        tokens = nn.Embed(VOCAB, DIM, name="tokens")(ids)
        positions = nn.Embed(BAG, DIM, name="positions")(jnp.arange(ids.shape[-1]))
        hidden = nn.tanh(nn.Dense(8, name="hidden")((tokens + positions).mean(axis=-2)))
        return nn.Dense(CLASSES, name="head")(hidden)


class Tied(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, DIM)
        return embed.attend(embed(ids).mean(axis=-2))


def _data(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, BAG)).astype(np.int32)
    labels = ((ids < VOCAB // 2).sum(axis=1) > BAG // 2).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(labels)


@functools.cache
def _bag_params(seed: int):
    """Bag's params, initialized in one compiled program (eager Flax init compiles
    every op on its own); shared by the tests that start from the same seed. The
    params do not depend on the batch size, so a one-example batch initializes them."""
    return jax.jit(Bag().init)(jax.random.key(seed), _data(1, 0)[0])["params"]


@functools.cache
def _embed300():
    """The 300-row table of the id tests, initialized once in one compiled program."""
    model = nn.Embed(num_embeddings=300, features=2)
    return model, jax.jit(model.init)(jax.random.key(0), jnp.zeros(1, jnp.int32))["params"]


def _to_dense(g: optax_accum.IndexedSlices) -> np.ndarray:
    """`IndexedSlices.to_dense` in NumPy (rows scatter-added, padding ignored), without
    compiling a scatter per shape; test_indexed_slices checks to_dense itself."""
    ids, values = np.asarray(g.indices), np.asarray(g.values)
    real = (ids >= 0) & (ids < g.dense_shape[0])
    dense = np.zeros(g.dense_shape, values.dtype)
    np.add.at(dense, ids[real], values[real])
    return dense


def _loss(model):
    def loss(params, ids, labels):
        logits = model.apply({"params": params}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

    return loss


def test_matches_dense_value_and_grad():
    model = Bag()
    ids, labels = _data(5, 0)
    params = _bag_params(0)
    sparse_fn = jax.jit(optax_accum.embedding_value_and_grad(_loss(model), has_aux=True))
    (value, logits), grads = sparse_fn(params, ids, labels)
    dense_fn = jax.jit(jax.value_and_grad(_loss(model), has_aux=True))
    (dense_value, dense_logits), dense = dense_fn(params, ids, labels)
    np.testing.assert_allclose(value, dense_value, rtol=1e-6)
    np.testing.assert_allclose(logits, dense_logits, rtol=1e-6)
    tokens = grads["tokens"]["embedding"]
    assert isinstance(tokens, optax_accum.IndexedSlices)
    assert tokens.dense_shape == (VOCAB, DIM) and tokens.indices.shape == (5 * BAG,)
    np.testing.assert_array_equal(tokens.indices, np.ravel(ids))
    for path in (("tokens", "embedding"), ("positions", "embedding")):
        got = _to_dense(grads[path[0]][path[1]])
        np.testing.assert_allclose(got, dense[path[0]][path[1]], rtol=1e-5, atol=1e-7)
    for name in ("hidden", "head"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            grads[name],
            dense[name],
        )


def test_no_table_sized_array_is_computed():
    """The jaxpr never produces an array of the table's shape (only reads the table)."""
    vocab = 100_003  # a shape no other array in the model has
    model = nn.Embed(vocab, 3)
    # One compiled program, not one compile per op of Flax's eager init.
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros(1, jnp.int32))["params"]
    fn = optax_accum.embedding_value_and_grad(lambda p, ids: model.apply({"params": p}, ids).sum())
    jaxpr = jax.make_jaxpr(fn)(params, jnp.array([1, 5, 1]))

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval.shape for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    assert (vocab, 3) not in set(shapes(jaxpr.jaxpr))
    dense = jax.make_jaxpr(jax.grad(lambda p, ids: model.apply({"params": p}, ids).sum()))
    assert (vocab, 3) in set(shapes(dense(params, jnp.array([1, 5, 1])).jaxpr))  # it can fail


def test_attend_is_refused():
    model = Tied()
    ids, _ = _data(2, 0)
    params = jax.jit(model.init)(jax.random.key(0), ids)["params"]  # one compile
    fn = optax_accum.embedding_value_and_grad(lambda p, x: model.apply({"params": p}, x).sum())
    with pytest.raises(ValueError, match="attend"):
        fn(params, ids)


def _tokens_sparse(params):
    """The sparse mask: only the token table (the position table takes the dense path)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: jax.tree_util.keystr(path) == "['tokens']['embedding']", params
    )


def _train(tx, grad_fn, steps, params, apply_updates):
    state = jax.jit(tx.init)(params)  # one compile, not one per op of each leaf's init

    @jax.jit
    def step(params, state, ids, labels):
        (loss, _), grads = grad_fn(params, ids, labels)
        updates, state = tx.update(grads, state, params)
        return apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        ids, labels = _data(16, 100 + i)
        params, state, loss = step(params, state, ids, labels)
        losses.append(float(loss))
    return params, state, losses


def test_sparse_path_with_sum_equals_the_dense_path():
    """SUM is per row in both, so sparse accumulate + sparse_sgd == dense accumulate + sgd."""
    model = Bag()
    params = _bag_params(1)
    sparse_tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(0.2), 3, capacity=VOCAB, reduction="sum", sparse=_tokens_sparse
    )
    dense_tx = optax_accum.conditional_accumulator(optax.sgd(0.2), 3, reduction="sum")
    sparse_grad = optax_accum.embedding_value_and_grad(_loss(model), has_aux=True)
    dense_grad = jax.value_and_grad(_loss(model), has_aux=True)
    got, state, _ = _train(sparse_tx, sparse_grad, 7, params, optax_accum.apply_updates)
    want, _, _ = _train(dense_tx, dense_grad, 7, params, optax.apply_updates)
    assert hasattr(state.storage["tokens"]["embedding"], "slot_of")  # a row buffer
    assert int(optax_accum.global_step(state)) == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)


def test_trains_an_embedding_bag_with_the_sparse_path():
    model = Bag()
    params = _bag_params(2)
    tx = optax_accum.sparse_conditional_accumulator(
        optax.chain(optax_accum.densify(), optax.sgd(0.5, momentum=0.9)),
        2,
        capacity=VOCAB,
        sparse=_tokens_sparse,
    )
    grad_fn = optax_accum.embedding_value_and_grad(_loss(model), has_aux=True)
    params, state, losses = _train(tx, grad_fn, 120, params, optax_accum.apply_updates)
    assert int(optax_accum.global_step(state)) == 60
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    ids, labels = _data(200, 999)
    logits = jax.jit(model.apply)({"params": params}, ids)  # one compile, not one per op
    accuracy = float((np.asarray(logits).argmax(-1) == np.asarray(labels)).mean())
    assert accuracy > 0.8


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "uint16", "int32"])
def test_ids_of_every_integer_dtype_give_exact_rows(dtype):
    """uint8 id 255 of a 300-row table is row 255 (not wrapped); the sparse gradient
    densifies to the dense gradient of sum(table[ids] ** 2), 2 * table[id] per lookup
    (computed in NumPy: eager jax.grad would compile each op for each dtype)."""
    model, params = _embed300()
    info = np.iinfo(dtype)
    ids = jnp.asarray(np.array([i for i in (255, 3, 255, 127) if i <= info.max], dtype))

    def loss(p, ids):
        return (model.apply({"params": p}, ids) ** 2).sum()

    value, grads = jax.jit(optax_accum.embedding_value_and_grad(loss))(params, ids)
    table = np.asarray(params["embedding"], np.float64)
    rows = np.asarray(ids).astype(np.int64)
    expected = np.zeros_like(table)
    np.add.at(expected, rows, 2 * table[rows])
    g = grads["embedding"]
    assert g.indices.dtype == jnp.int32
    assert g.indices.tolist() == rows.tolist()
    np.testing.assert_allclose(value, (table[rows] ** 2).sum(), rtol=1e-6)
    np.testing.assert_allclose(_to_dense(g), expected, rtol=1e-6)


def test_int64_ids_beyond_int32_are_padding_under_x64():
    """An int64 id of 2**32 + 3 is out of the table (padding, id `rows`), never row 3."""
    with jax.enable_x64(True):
        model = nn.Embed(num_embeddings=300, features=2, param_dtype=jnp.float32)
        # Jitted: eager, each op of the init and the gradient would compile on its own.
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros(1, jnp.int32))["params"]

        def loss(p, ids):
            return jnp.nansum(model.apply({"params": p}, ids))

        ids = jnp.array([2**32 + 3, 3, -1], jnp.int64)
        _, grads = jax.jit(optax_accum.embedding_value_and_grad(loss))(params, ids)
        assert grads["embedding"].indices.tolist() == [300, 3, 300]
