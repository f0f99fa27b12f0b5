"""Helpers shared by the host accumulator tests (tests/test_host*.py and the host
bad-input suite): the wait bound, polling, float32 arrays and small accumulators.
The thread pool they use is the `pool` fixture in conftest.py.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import optax_accum

WAIT = 20.0  # seconds: the bound on any wait that should finish promptly


def wait_until(predicate: Any) -> None:
    """Polls `predicate` every millisecond; fails the test after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def f32(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


def dense(reduction: str = "MEAN", **kwargs: Any) -> optax_accum.ConditionalAccumulator:
    """A scalar float32 `ConditionalAccumulator`."""
    return optax_accum.ConditionalAccumulator(
        np.float32, shape=(), reduction_type=reduction, **kwargs
    )


def sparse(reduction: str = "MEAN", **kwargs: Any) -> optax_accum.SparseConditionalAccumulator:
    """A float32 `SparseConditionalAccumulator` of shape (2, 2)."""
    return optax_accum.SparseConditionalAccumulator(
        np.float32, shape=(2, 2), reduction_type=reduction, **kwargs
    )
