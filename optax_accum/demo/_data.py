"""Digits data, a small Flax MLP, and the training helpers the demo sections share."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


def digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split 80/20 (train/test)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


class MLP(nn.Module):
    """64 -> hidden -> 10."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


def init_mlp(seed: int = 0) -> tuple[MLP, Any]:
    model = MLP()
    return model, model.init(jax.random.key(seed), jnp.zeros((1, 64)))["params"]


def loss_fn(model: nn.Module, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(model: nn.Module, params: Any, x: np.ndarray, y: np.ndarray) -> float:
    logits = model.apply({"params": params}, jnp.asarray(x))
    return float((jnp.argmax(logits, -1) == jnp.asarray(y)).mean())


def batches(x: np.ndarray, y: np.ndarray, batch: int, seed: int):
    """An endless stream of random minibatches."""
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(x), size=batch)
        yield x[idx], y[idx]


def evaluate_now(i: int, steps: int, points: int = 20) -> bool:
    """Whether step `i` (0-based) of `steps` is one of about `points` evaluation points,
    the last step included."""
    return (i + 1) % max(1, steps // points) == 0 or i + 1 == steps


def progress(iterable: Any, desc: str, total: int | None = None) -> Any:
    """A tqdm progress bar that stays out of the way of the final table."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
