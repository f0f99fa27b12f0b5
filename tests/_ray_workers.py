"""The other processes of tests/test_ray.py: a Ray actor class whose methods call the
accumulator handles there, as workers and chiefs on other machines would.

This module imports no JAX (nor does `optax_accum.ray`), so each of these processes
starts in a fraction of a second; one that takes a gradient imports JAX then, as the
handle returns a `jax.Array`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray

import optax_accum.ray as oray
from optax_accum.ray import _callers


def host(x: Any) -> Any:
    """`x` with every array (a `jax.Array` included) as NumPy, tuples, lists and dicts
    kept."""
    if isinstance(x, tuple | list):
        return type(x)(host(v) for v in x)
    if isinstance(x, dict):
        return {k: host(v) for k, v in x.items()}
    if hasattr(x, "__array__") and not isinstance(x, np.ndarray):
        return np.asarray(x)
    return x


DIM, ROWS = 8, 32


def data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A worker's own regression data."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    return x, (x @ np.linspace(-1, 1, DIM, dtype=np.float32)).astype(np.float32)


def gradient(params: np.ndarray, seed: int) -> np.ndarray:
    """The mean squared error's gradient on worker `seed`'s data, on a grid of 2**-10
    (and bounded): sums of a few are exact in any order."""
    x, y = data(seed)
    g = (2 / ROWS) * (x.T @ (x @ params - y))
    return (np.round(np.clip(g, -64, 64) * 1024) / 1024).astype(np.float32)


@ray.remote(max_concurrency=8, num_cpus=0)
class Process:
    """Another process of the cluster, calling a handle's methods for the test."""

    def __init__(self) -> None:
        self.board = None

    def call(self, handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return host(getattr(handle, method)(*args, **kwargs))

    def error(self, handle: Any, method: str, *args: Any, **kwargs: Any) -> tuple[type, str]:
        """The error a call raises here (its type and message)."""
        try:
            getattr(handle, method)(*args, **kwargs)
        except Exception as error:  # returned to the test
            return type(error), str(error)
        raise AssertionError(f"{method} raised nothing")

    def pid(self) -> int:
        return os.getpid()

    def modules(self) -> list[str]:
        import sys

        return sorted(sys.modules)

    def build_and_apply(self, shared_name: str, grad: np.ndarray, local_step: int = 0) -> bool:
        acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name=shared_name)
        return acc.apply_grad(grad, local_step)

    def apply_until_killed(self, handle: Any, log_path: str, n: int) -> int:
        """Applies gradient i = 2**i (for i < n), logging each acknowledged one."""
        for i in range(n):
            grad = np.full(2, 2.0**i, np.float64)
            assert handle.apply_grad(grad, local_step=0)
            with open(log_path, "a") as log:
                log.write(f"{i}\n")
        return n

    def take_from_afar(self, handle: Any, num_required: int, lease: float) -> tuple[type, str]:
        """A take as a caller on another node makes it (its liveness is its lease, of
        `lease` seconds); the error it ends with."""
        here = _callers.Caller.this_process()
        _callers.Caller.this_process = classmethod(  # type: ignore[method-assign]
            lambda cls: here._replace(node_id="another-node", lease=lease)
        )
        return self.error(handle, "take_grad", num_required, 60.0)

    def publish(self, step: int, params: np.ndarray, done: bool = False) -> None:
        self.board = (step, params, done)

    def read(self) -> Any:
        return self.board

    def train(self, acc: Any, board: Any, seed: int, delay: float) -> list:
        """Computes gradients on its own data at its own pace, and sends them tagged
        with the step of the parameters it read from `board` (a Process); its log."""
        log = []
        while True:
            step, params, done = ray.get(board.read.remote())
            if done:
                return log
            grad = gradient(params, seed)
            time.sleep(delay)
            log.append((step, grad, acc.apply_grad(grad, local_step=step)))

    # ----------------------------------------------------------------- the chaos test

    def push(self, acc: Any, first: int, count: int, log_path: str, stop_path: str) -> int:
        """Sends one-hot gradients `first`, `first + 1`, ... (each names itself in a SUM
        take), tagged with the step it last read, until `stop_path` exists; logs each
        answer (`id accepted`) as it comes. Returns how many it sent."""
        size, step, sent = acc.shape[0], acc.global_step, 0
        with open(log_path, "a", buffering=1) as log:
            for k in range(first, first + count):
                if os.path.exists(stop_path):
                    break
                grad = np.zeros(size, np.float32)
                grad[k] = 1.0
                accepted = acc.apply_grad(grad, local_step=step)
                log.write(f"{k} {int(accepted)}\n")
                sent += 1
                if not accepted:
                    step = acc.global_step
        return sent

    def chief(self, acc: Any, num_required: int, log_path: str, stop_path: str) -> int:
        """Takes SUMs of `num_required` gradients until `stop_path` exists, logging the
        ids each take got (`id:times ...`); returns how many takes it logged."""
        takes = 0
        with open(log_path, "a", buffering=1) as log:
            while not os.path.exists(stop_path):
                try:
                    taken = np.asarray(acc.take_grad(num_required, timeout=1.0))
                except TimeoutError:
                    continue
                ids = np.flatnonzero(taken)
                log.write(" ".join(f"{i}:{int(taken[i])}" for i in ids) + "\n")
                takes += 1
        return takes
