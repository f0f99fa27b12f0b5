"""Demo section: conditional_accumulator against optax.MultiSteps and asynchronous Adam.

Four simulated asynchronous workers deliver gradients in the order their (random,
exponentially distributed) compute times give; worker 0 is a straggler, `SLOWDOWN`
times slower. Each gradient is computed at the parameters its worker pulled after its
previous delivery, and tagged with the global step it saw then, so gradients arrive
stale. Three learners train on the same stream, gradient for gradient, as the
accumulation notebook (colab/accumulation_with_staleness.py) does:

- plain asynchronous Adam applies every gradient as it comes, stale or not;
- `optax.MultiSteps(adam, 3)` applies the mean of every 3 gradients, stale or not;
- `conditional_accumulator(adam, num_required=3)` drops the stale gradients and
  applies the mean of 3 fresh ones, TF's ConditionalAccumulator.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import Row, Sizes, _data

WORKERS = 4
SLOWDOWN = 6.0  # worker 0 takes this many times longer per gradient
EVERY = 3  # gradients per update: MultiSteps' every_k_schedule, the accumulator's num_required
LR = 3e-3


def arrival_order(
    steps: int, seed: int, *, workers: int = WORKERS, slowdown: float = SLOWDOWN
) -> list[int]:
    """Which worker delivers each of `steps` gradients: exponential compute times,
    worker 0 `slowdown` times slower than the others (the notebook uses it too)."""
    rng = np.random.default_rng(seed)
    mean = np.ones(workers)
    mean[0] = slowdown
    events = [(rng.exponential(m), w) for w, m in enumerate(mean)]
    heapq.heapify(events)
    order = []
    while len(order) < steps:
        t, w = heapq.heappop(events)
        order.append(w)
        heapq.heappush(events, (t + rng.exponential(mean[w]), w))
    return order


def _learners() -> dict[str, tuple[optax.GradientTransformationExtraArgs, Callable]]:
    """name -> (transform taking `local_step`, state -> updates applied so far)."""
    multi = optax.MultiSteps(optax.adam(LR), EVERY)
    return {
        "async adam, every gradient": (
            optax.with_extra_args_support(optax.adam(LR)),
            lambda state: int(state[0].count),
        ),
        f"MultiSteps(adam, {EVERY}), every gradient": (
            optax.with_extra_args_support(multi.gradient_transformation()),
            lambda state: int(state.gradient_step),
        ),
        f"conditional_accumulator(adam, {EVERY})": (
            optax_accum.conditional_accumulator(optax.adam(LR), num_required=EVERY),
            lambda state: int(optax_accum.global_step(state)),
        ),
    }


def _train(sizes: Sizes, method: str, tx: Any, updates_of: Callable, order: list[int]) -> Row:
    x, y, xt, yt = _data.digits(sizes.seed)
    model, params = _data.init_mlp(sizes.seed)
    grad_fn = jax.grad(lambda p, xb, yb: _data.loss_fn(model, p, xb, yb))

    @jax.jit
    def step(params, state, snapshot, xb, yb, tag):
        grads = grad_fn(snapshot, xb, yb)  # at the parameters the worker pulled
        updates, state = tx.update(grads, state, params, local_step=tag)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    pulled = [(params, 0)] * WORKERS  # (params, global step) each worker last pulled
    data = _data.batches(x, y, sizes.batch, sizes.seed)  # the same batches for everyone
    curve = []
    start = time.perf_counter()
    for i, w in enumerate(_data.progress(order, f"accumulate: {method}")):
        snapshot, tag = pulled[w]
        xb, yb = next(data)
        params, state = step(params, state, snapshot, jnp.asarray(xb), jnp.asarray(yb), tag)
        pulled[w] = (params, updates_of(state))
        if _data.evaluate_now(i, sizes.steps):
            curve.append((i + 1, _data.accuracy(model, params, xt, yt)))
    return Row(
        section="accumulate",
        method=method,
        accuracy=curve[-1][1],
        updates=updates_of(state),
        dropped=int(getattr(state, "num_dropped", 0)),
        seconds=time.perf_counter() - start,
        curve=curve,
    )


def run(sizes: Sizes) -> list[Row]:
    order = arrival_order(sizes.steps, sizes.seed)
    with jax.numpy_dtype_promotion("standard"):  # optax.adam computes float ** int32
        return [
            _train(sizes, method, tx, updates_of, order)
            for method, (tx, updates_of) in _learners().items()
        ]
