"""What `dense.py`, `sharded.py` and `train_step.py` share: the train steps users write,
the two optimizers they compare, how a compiled step is timed, and how their
interleaved rounds are ordered and paired.

A script imports it as `benchmarks._steps` when it runs as part of the package
(`python -m benchmarks`, the tests) and as `_steps` when it runs as a file
(`python benchmarks/dense.py`, whose folder is then first on `sys.path`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax

import optax_accum


def canonical(tx: Any, params: Any, opt_state: Any, grads: Any) -> tuple:
    """The canonical optax step: `tx.update`, then `optax.apply_updates`."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def fused(tx: Any, params: Any, opt_state: Any, grads: Any) -> tuple:
    """The same step through `optax_accum.apply_gradients`."""
    return optax_accum.apply_gradients(tx, grads, opt_state, params)


def accumulating_adam(ours: bool, every: int) -> Any:
    """Adam released every `every` gradients: `conditional_accumulator` (`ours`) or
    `optax.MultiSteps`."""
    adam = optax.adam(1e-3)
    if ours:
        return optax_accum.conditional_accumulator(adam, num_required=every)
    return optax.MultiSteps(adam, every_k_schedule=every)


def rotations(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """`(round, name)` for a warm-up round 0 and `rounds` timed rounds, in an order that
    rotates from round to round."""
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            yield r, name


def paired(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of `num / den`, both timed in the same round."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den], strict=True))


class Contender:
    """A compiled step, the buffers it carries from call to call, and its timing.

    `fn(*carry, batch)` returns the next carry (a tuple when the carry has more than
    one element); the carry is donated, the batch (or the gradients) is not. A sample
    times `every` calls.
    """

    def __init__(self, fn: Callable, carry: tuple, batch: Any, every: int):
        self.carry, self.batch, self.every = carry, batch, every
        donate = tuple(range(len(carry)))
        self.compiled = jax.jit(fn, donate_argnums=donate).lower(*carry, batch).compile()

    def call(self) -> None:
        out = self.compiled(*self.carry, self.batch)
        self.carry = out if len(self.carry) > 1 else (out,)

    def sample(self) -> tuple[float, float]:
        """Seconds per step over `every` steps: wall-clock, and this process's CPU
        time (every device's threads), which a busy machine disturbs less."""
        jax.block_until_ready(self.carry)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(self.every):
            self.call()
        jax.block_until_ready(self.carry)
        return (time.perf_counter() - start) / self.every, (time.process_time() - cpu) / self.every
