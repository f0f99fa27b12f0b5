"""Demo section: an embedding-bag classifier trained through the sparse path.

Each 8x8 digit becomes a bag of tokens, one per (pixel, intensity) pair that is not
blank: 64 pixels x 16 intensities = 1024 token ids. The model averages the tokens'
embeddings and classifies them with a Dense layer. `embedding_value_and_grad` gives the
table's gradient as an `IndexedSlices` of the rows looked up; the sparse accumulator
sums them per row over 4 gradients and `sparse_sgd` updates only those rows. The same
model trained with dense gradients through `conditional_accumulator` is the reference;
with SUM and the same learning rate, the two compute the same numbers.
"""

from __future__ import annotations

import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import Row, Sizes, _data

LEVELS = 16  # intensities 1..16 (0, a blank pixel, is padding)
VOCAB = 64 * LEVELS
DIM = 32
NUM_REQUIRED = 4
LEARNING_RATE = 30.0  # SGD on the mean gradient; embeddings of a mean-pooled bag learn slowly


def tokens(x: np.ndarray) -> np.ndarray:
    """Pixel p at intensity v (1..16) is token p * 16 + v - 1; blank pixels get VOCAB."""
    level = np.rint(x * LEVELS).astype(np.int32)
    ids = np.arange(64, dtype=np.int32) * LEVELS + level - 1
    return np.where(level > 0, ids, VOCAB).astype(np.int32)


class EmbeddingBag(nn.Module):
    """Mean of the non-blank tokens' embeddings, then a linear classifier."""

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        real = (ids < VOCAB)[..., None]
        rows = nn.Embed(VOCAB, DIM, name="embed")(ids)  # blank: NaN rows, selected away
        pooled = jnp.where(real, rows, 0).sum(-2) / jnp.maximum(real.sum(-2), 1)
        return nn.Dense(10, name="head")(pooled)


def _train(sizes: Sizes, sparse: bool) -> tuple[list[tuple[int, float]], Any, float]:
    x, y, xt, yt = _data.digits(sizes.seed)
    model = EmbeddingBag()
    params = model.init(jax.random.key(sizes.seed), jnp.zeros((1, 64), jnp.int32))["params"]

    def loss(p, ids, labels):
        logits = model.apply({"params": p}, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    # SUM with the learning rate divided by NUM_REQUIRED is SGD on the mean gradient,
    # per row and dense alike, so both runs compute the same numbers.
    learning_rate = LEARNING_RATE / NUM_REQUIRED
    if sparse:
        tx = optax_accum.sparse_conditional_accumulator(
            optax_accum.sparse_sgd(learning_rate),
            NUM_REQUIRED,
            capacity=VOCAB,
            reduction="sum",
            sparse={"embed": {"embedding": True}, "head": {"kernel": False, "bias": False}},
        )
        grad_fn, apply = optax_accum.embedding_value_and_grad(loss), optax_accum.apply_updates
    else:
        tx = optax_accum.conditional_accumulator(
            optax.sgd(learning_rate), NUM_REQUIRED, reduction="sum"
        )
        grad_fn, apply = jax.value_and_grad(loss), optax.apply_updates
    state = tx.init(params)

    @jax.jit
    def step(params, state, ids, labels):
        _, grads = grad_fn(params, ids, labels)
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state

    test_ids, test_labels = jnp.asarray(tokens(xt)), jnp.asarray(yt)

    @jax.jit
    def accuracy(params):
        logits = model.apply({"params": params}, test_ids)
        return (jnp.argmax(logits, -1) == test_labels).mean()

    data = _data.batches(tokens(x), y, sizes.batch, sizes.seed)
    curve = []
    start = time.perf_counter()
    label = "sparse" if sparse else "dense"
    for i in _data.progress(range(sizes.steps), f"sparse: embedding bag ({label})"):
        ids, labels = next(data)
        params, state = step(params, state, jnp.asarray(ids), jnp.asarray(labels))
        if _data.evaluate_now(i, sizes.steps):
            curve.append((i + 1, float(accuracy(params))))
    return curve, state, time.perf_counter() - start


def run(sizes: Sizes) -> list[Row]:
    rows = []
    for sparse in (True, False):
        curve, state, seconds = _train(sizes, sparse)
        dropped = int(state.num_dropped) + int(getattr(state, "num_overflowed", 0))
        method = (
            "sparse_conditional_accumulator(sparse_sgd, 4)"
            if sparse
            else "conditional_accumulator(sgd, 4), dense reference"
        )
        rows.append(
            Row(
                section="sparse",
                method=method,
                accuracy=curve[-1][1],
                updates=int(optax_accum.global_step(state)),
                dropped=dropped,
                seconds=seconds,
                curve=curve,
            )
        )
    return rows
