"""Malformed calls to the Flax names (TrainState, NNXOptimizer, embedding_value_and_grad)
get a clear error. Needs Flax (the extra), so the oldest-versions run leaves it out.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _bad_inputs import GRADS, PARAMS, TREE, Bad, accumulator_tx, check, ids
from flax import linen as nn
from flax import nnx

import optax_accum


def _train_state() -> optax_accum.TrainState:
    return optax_accum.TrainState.create(apply_fn=None, params=PARAMS, tx=accumulator_tx())


class _Tied(nn.Module):
    """An embedding whose table is also the output layer (attend): not row-sparse."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(10, 2)
        return embed.attend(embed(ids)).sum()


def _tied_params():
    return _Tied().init(jax.random.key(0), jnp.zeros(1, int))["params"]


def _tied_loss(params, ids):
    return _Tied().apply({"params": params}, ids)


def _embed_loss(params, ids):
    return nn.Embed(10, 2).apply({"params": params}, ids).sum()


def _scaled_table_loss(params, ids):
    """A loss that looks its ids up in twice the table: the gradient of the rows it
    gathers is not the table's."""
    return _embed_loss(jax.tree.map(lambda t: 2 * t, params), ids)


BAD: list[Bad] = [
    Bad(
        "embedding_value_and_grad/tied table used by attend",
        lambda: optax_accum.embedding_value_and_grad(_tied_loss)(_tied_params(), jnp.array([1])),
        ValueError,
        r"nn\.Embed at \('Embed_0',\) is used by attend\(\).*not row-sparse; use "
        r"jax\.value_and_grad",
    ),
    Bad(
        "embedding_value_and_grad/table transformed inside loss_fn",
        lambda: optax_accum.embedding_value_and_grad(_scaled_table_loss)(
            {"embedding": jnp.zeros((10, 2))}, jnp.array([1])
        ),
        ValueError,
        r"the table of nn\.Embed at \(\) is not a leaf of the params given \(was it "
        r"transformed inside loss_fn\?\)",
    ),
    Bad(
        "embedding_value_and_grad/loss_fn not callable",
        lambda: optax_accum.embedding_value_and_grad("loss"),
        TypeError,
        r"loss_fn must be callable, got 'loss' \(str\)",
    ),
    Bad(
        "embedding_value_and_grad/has_aux='yes'",
        lambda: optax_accum.embedding_value_and_grad(_embed_loss, has_aux="yes"),
        TypeError,
        r"has_aux must be a bool, got 'yes' \(str\)",
    ),
    Bad(
        "TrainState.apply_gradients/gradient tree",
        lambda: _train_state().apply_gradients(grads={"w": GRADS["w"]}),
        ValueError,
        TREE,
    ),
    Bad(
        "TrainState.apply_gradients/local_step=0.5",
        lambda: _train_state().apply_gradients(grads=GRADS, local_step=0.5),
        TypeError,
        r"local_step must be an integer scalar, got 0\.5",
    ),
    Bad(
        "NNXOptimizer/tx='sgd'",
        lambda: optax_accum.NNXOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), "sgd", wrt=nnx.Param),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
