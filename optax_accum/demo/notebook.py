"""The data and the model the notebooks in colab/ share with `python -m optax_accum.demo`.

Each notebook installs optax_accum in its first cell and then takes its data and its
model from here, in two short cells, so that every notebook trains on the same digits
with the same MLP as the demo::

    x_train, y_train, x_test, y_test = notebook.digits()
    sample = notebook.sampler(x_train, y_train)
    model, init_params, loss_fn, accuracy = notebook.mlp(x_test, y_test)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_accum.demo import _data


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), scaled to [0, 1].

    Shuffled with `seed` and split 80/20: `(x_train, y_train, x_test, y_test)`, the
    images as float32 rows of 64 pixels, the labels as int32.
    """
    return _data.digits(seed)


def sampler(x: np.ndarray, y: np.ndarray) -> Callable[[np.random.Generator, int], tuple]:
    """`sample(rng, size)`: `size` examples of `(x, y)` drawn at random, with replacement."""

    def sample(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, len(x), size)
        return x[idx], y[idx]

    return sample


def mlp(x_test: np.ndarray, y_test: np.ndarray, seed: int = 0) -> tuple[Any, Any, Callable, Any]:
    """A Flax linen MLP (64 -> 64 -> 10, ReLU), its loss and its test accuracy.

    Returns `(model, init_params, loss_fn, accuracy)`: the linen module, its
    parameters initialised from `seed`, `loss_fn(params, xb, yb)` (the mean softmax
    cross-entropy of a batch) and the jitted `accuracy(params)` on `(x_test, y_test)`.
    """
    model, init_params = _data.init_mlp(seed)

    def loss_fn(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return _data.loss_fn(model, params, xb, yb)

    @jax.jit
    def accuracy(params: Any) -> jax.Array:
        return (model.apply({"params": params}, x_test).argmax(-1) == y_test).mean()

    return model, init_params, loss_fn, accuracy
