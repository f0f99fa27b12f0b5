"""What `dense.py`, `sharded.py` and `train_step.py` share: the train steps users write,
the two optimizers they compare, and how their interleaved rounds are ordered and
paired.

A script imports it as `benchmarks._steps` when it runs as part of the package
(`python -m benchmarks`, the tests) and as `_steps` when it runs as a file
(`python benchmarks/dense.py`, whose folder is then first on `sys.path`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

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
