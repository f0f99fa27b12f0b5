"""Demo section: conditional_accumulator with simulated workers that are sometimes stale.

Four simulated workers each compute a gradient at the global step they last saw; one
in five arrives a step late. The accumulator drops the stale ones and releases the
mean of `num_required` fresh gradients to Adam.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum
from optax_accum.demo import Row, Sizes, _data


def run(sizes: Sizes) -> list[Row]:
    x, y, xt, yt = _data.digits(sizes.seed)
    model, params = _data.init_mlp(sizes.seed)
    tx = optax_accum.conditional_accumulator(optax.adam(3e-3), num_required=4)
    state = tx.init(params)
    grad_fn = jax.grad(lambda p, xb, yb: _data.loss_fn(model, p, xb, yb))

    @jax.jit
    def step(params, state, xb, yb, local_step):
        grads = grad_fn(params, xb, yb)
        updates, state = tx.update(grads, state, params, local_step=local_step)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(sizes.seed)
    data = _data.batches(x, y, sizes.batch, sizes.seed)
    curve = []
    start = time.perf_counter()
    for i in _data.progress(range(sizes.steps), "accumulate: stale workers"):
        xb, yb = next(data)
        lag = int(rng.random() < 0.2)  # one gradient in five was computed a step ago
        local_step = optax_accum.global_step(state) - lag
        params, state = step(params, state, jnp.asarray(xb), jnp.asarray(yb), local_step)
        if _data.evaluate_now(i, sizes.steps):
            curve.append((i + 1, _data.accuracy(model, params, xt, yt)))
    return [
        Row(
            section="accumulate",
            method="conditional_accumulator(adam, 4), 20% stale",
            accuracy=curve[-1][1],
            updates=int(optax_accum.global_step(state)),
            dropped=int(state.num_dropped),
            seconds=time.perf_counter() - start,
            curve=curve,
        )
    ]
