"""The data and model the convergence benchmarks share: scikit-learn's digits, a small MLP.

scikit-learn ships the 1797 8x8 digits, so nothing is downloaded. The MLP is Flax linen
(64 -> 64 -> 10). Needs the `[demo]` extra (`pip install -e ".[demo]"`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): digits scaled to [0, 1], shuffled, split 80/20."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


class MLP(nn.Module):
    """64 -> hidden -> 10, ReLU."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


def init_mlp(seed: int = 0) -> tuple[MLP, Any]:
    """The model and its initial params."""
    model = MLP()
    return model, model.init(jax.random.key(seed), jnp.zeros((1, 64)))["params"]


def loss_fn(model: nn.Module, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy."""
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(x: np.ndarray, y: np.ndarray, batch: int, seed: int) -> Iterator[tuple]:
    """An endless stream of random minibatches."""
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(x), size=batch)
        yield x[idx], y[idx]


def progress(iterable: Iterable, desc: str) -> Iterable:
    """A tqdm progress bar that leaves no line behind."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True)
