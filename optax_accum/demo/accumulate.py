"""Demo section: conditional_accumulator against optax.MultiSteps and asynchronous Adam.

Simulated asynchronous workers deliver gradients in the order their (random,
exponentially distributed) compute times give; worker 0 is a straggler, `slowdown`
times slower than the others. Each gradient is computed at the parameters its worker
pulled after its previous delivery, and tagged with the global step it saw then, so
gradients arrive stale: with `W` workers, about `W - 1` other gradients arrive between
a worker's pull and its delivery. Three learners train on the same stream, gradient
for gradient, as the accumulation notebook (colab/accumulation_with_staleness.py) does:

- plain asynchronous Adam applies every gradient as it comes, stale or not;
- `optax.MultiSteps(adam, 3)` applies the mean of every 3 gradients, stale or not;
- `conditional_accumulator(adam, num_required=3)` drops the stale gradients and
  applies the mean of 3 fresh ones, TF's ConditionalAccumulator.

They run in two regimes (`REGIMES`), each its own block of the table and panel of the
plot, on the same x axis (gradients delivered):

- mild: 4 workers and Adam at 3e-3. A gradient is on average 3 updates old when async
  Adam applies it (1 for MultiSteps), and 3 small steps move the parameters little, so a
  stale gradient still points downhill. Using every gradient wins: async Adam and
  MultiSteps learn faster per gradient delivered, while the accumulator throws away
  about 40% of them. Here MultiSteps is enough.
- heavy: 16 workers and Adam at 3e-2. A gradient is on average 14 updates old for async
  Adam (5 for MultiSteps), updates 10 times larger: it was computed at parameters far
  from the ones it is applied to, and applying it undoes progress, so their accuracy
  stalls and swings. The accumulator applies only gradients computed at the current
  parameters (synchronous Adam on the mean of 3 fresh ones) and keeps learning,
  although it drops about 70% of the gradients. Either change alone costs little on
  this problem (16 workers at 3e-3: the three end within 0.06 of each other; 4 workers
  at 3e-2: all three near 0.96): the harm needs many updates of large steps between a
  gradient's pull and its use. Lowering the learning rate is the other way out.
"""

from __future__ import annotations

import dataclasses
import functools
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


@dataclasses.dataclass(frozen=True)
class Regime:
    """A simulated cluster: how many workers, how slow the straggler, which Adam step."""

    name: str
    workers: int
    slowdown: float  # worker 0 takes this many times longer per gradient
    learning_rate: float

    @property
    def label(self) -> str:
        """The regime's heading in the table and the plot."""
        return (
            f"{self.name} staleness: {self.workers} workers (one {self.slowdown:g}x slower), "
            f"Adam lr {self.learning_rate:.0e}".replace("e-0", "e-")
        )


MILD = Regime("mild", workers=4, slowdown=6.0, learning_rate=3e-3)
HEAVY = Regime("heavy", workers=16, slowdown=6.0, learning_rate=3e-2)
REGIMES = (MILD, HEAVY)
EVERY = 3  # gradients per update: MultiSteps' every_k_schedule, the accumulator's num_required

ASYNC = "async adam, every gradient"
MULTI = f"MultiSteps(adam, {EVERY}), every gradient"
ACCUMULATOR = f"conditional_accumulator(adam, {EVERY})"
# method -> state -> updates applied so far (the global step a worker pulls with).
UPDATES_OF: dict[str, Callable[[Any], int]] = {
    ASYNC: lambda state: int(state[0].count),
    MULTI: lambda state: int(state.gradient_step),
    ACCUMULATOR: lambda state: int(optax_accum.global_step(state)),
}


def arrival_order(
    steps: int, seed: int, *, workers: int = MILD.workers, slowdown: float = MILD.slowdown
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


def transform(method: str, learning_rate: Any) -> optax.GradientTransformationExtraArgs:
    """The learner `method` (ASYNC, MULTI or ACCUMULATOR), taking `local_step`."""
    adam = optax.adam(learning_rate)
    if method == ASYNC:
        return optax.with_extra_args_support(adam)
    if method == MULTI:
        multi = optax.MultiSteps(adam, EVERY).gradient_transformation()
        return optax.with_extra_args_support(multi)
    return optax_accum.conditional_accumulator(adam, num_required=EVERY)


# The learning rate is an argument, not a constant, so that both regimes share one
# compilation per learner.
@functools.partial(jax.jit, static_argnames=("method", "model"))
def _step(method, model, learning_rate, params, state, snapshot, xb, yb, tag):
    grads = jax.grad(_data.loss_fn, argnums=1)(model, snapshot, xb, yb)  # at the pulled params
    updates, state = transform(method, learning_rate).update(grads, state, params, local_step=tag)
    return optax.apply_updates(params, updates), state


def _train(sizes: Sizes, regime: Regime, method: str, order: list[int]) -> Row:
    x, y, xt, yt = _data.digits(sizes.seed)
    model, params = _data.init_mlp(sizes.seed)
    updates_of = UPDATES_OF[method]
    state = transform(method, regime.learning_rate).init(params)
    pulled = [(params, 0)] * regime.workers  # (params, global step) each worker last pulled
    data = _data.batches(x, y, sizes.batch, sizes.seed)  # the same batches for everyone
    curve = []
    start = time.perf_counter()
    for i, w in enumerate(_data.progress(order, f"accumulate, {regime.name}: {method}")):
        snapshot, tag = pulled[w]
        xb, yb = map(jnp.asarray, next(data))
        params, state = _step(
            method, model, regime.learning_rate, params, state, snapshot, xb, yb, tag
        )
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
        panel=regime.label,
    )


def run(sizes: Sizes) -> list[Row]:
    rows = []
    with jax.numpy_dtype_promotion("standard"):  # optax.adam computes float ** int32
        for regime in REGIMES:
            order = arrival_order(
                sizes.steps, sizes.seed, workers=regime.workers, slowdown=regime.slowdown
            )
            rows += [_train(sizes, regime, method, order) for method in UPDATES_OF]
    return rows
