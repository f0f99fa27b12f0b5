"""Compile time of nested holding transforms: three levels against one.

`conditional_accumulator(conditional_accumulator(conditional_accumulator(adam)))`
against `conditional_accumulator(adam)`, 50 parameter leaves, the canonical train step
(`tx.update` + `optax.apply_updates`, params and state donated). Prints, per depth, the
number of times Adam's update was traced and the median seconds to trace, lower and
compile (fresh `jax.jit` each time, so nothing is cached).

Run from the repository root: `python benchmarks/compile_time.py` (`--repeats 1` for a
quick look).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optax_accum

LEAVES = 50


def counting_adam(counter: list[int]) -> optax.GradientTransformation:
    adam = optax.adam(1e-3)

    def update(updates, state, params=None):
        counter[0] += 1
        return adam.update(updates, state, params)

    return optax.GradientTransformation(adam.init, update)


def nested(depth: int, counter: list[int]) -> optax.GradientTransformation:
    tx = counting_adam(counter)
    for _ in range(depth):
        tx = optax_accum.conditional_accumulator(tx, num_required=2)
    return tx


def compile_once(depth: int) -> tuple[int, float]:
    counter = [0]
    tx = nested(depth, counter)
    params = {f"p{i}": jnp.ones((64, 32)) for i in range(LEAVES)}

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    start = time.perf_counter()
    jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile()
    return counter[0], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="compiles per depth")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {LEAVES} leaves")
    seconds = {}
    for depth in (1, 3):
        runs = [compile_once(depth) for _ in range(args.repeats)]
        seconds[depth] = statistics.median(s for _, s in runs)
        print(f"depth {depth}: Adam traced {runs[0][0]}x, {seconds[depth]:.2f} s to compile")
    print(f"three levels / one: {seconds[3] / seconds[1]:.2f}x")


if __name__ == "__main__":
    main()
