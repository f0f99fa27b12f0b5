"""The structural guards of test_regression_guard.py for Flax's train steps.

`optax_accum.TrainState.apply_gradients` (state donated) and `NNXOptimizer.update`
(the model and optimizer split into one donated state): a held step runs `acc + g`
and nothing else on a full-size array, copies nothing, and updates the state in place.

Entry point x inner optimizer x dtype is run pairwise (tests/_matrix.py): each entry
point with every inner and both dtypes, every inner in both dtypes; 6 compiles instead
of the 12 of the full product. The NNX case runs the very program it inspected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import every_call, full_size_counts
from _matrix import pairwise
from flax import nnx
from test_regression_guard import ACCUMULATE_OPS, INNERS, array_leaves, make_params

import optax_accum


def check_held_step(compiled, donated, n: int) -> None:
    ops = every_call(compiled.as_text())
    counts = full_size_counts(ops)
    opcodes = {op.opcode for op in ops}
    assert "while" in opcodes, f"XLA:CPU decides with a 0-or-1-trip loop, got {sorted(opcodes)}"
    assert set(counts) <= ACCUMULATE_OPS, counts
    assert counts["add"] == n, counts
    aliased = compiled.memory_analysis().alias_size_in_bytes
    assert aliased >= sum(x.nbytes for x in array_leaves(donated))


DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16}
MATRIX = pairwise(["train_state", "nnx"], sorted(INNERS), list(DTYPE))


def _cases(entry: str):
    """The (inner, dtype) pairs `entry` runs, as a parametrization."""
    pairs = [(inner, dtype) for e, inner, dtype in MATRIX if e == entry]
    return pytest.mark.parametrize(
        ("inner", "dtype"), [(i, DTYPE[d]) for i, d in pairs], ids=[f"{i}-{d}" for i, d in pairs]
    )


@_cases("train_state")
def test_train_state_held_step_touches_only_the_accumulator(inner, dtype):
    params = make_params(dtype)
    tx = optax_accum.conditional_accumulator(INNERS[inner](), num_required=4)
    state = optax_accum.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g), donate_argnums=0)
    check_held_step(step.lower(state, params).compile(), state, len(params))


class Leaves(nnx.Module):
    def __init__(self, params: dict) -> None:
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))


@_cases("nnx")
def test_nnx_held_step_touches_only_the_accumulator(inner, dtype):
    params = make_params(dtype)
    model = Leaves(params)
    tx = optax_accum.conditional_accumulator(INNERS[inner](), num_required=4)
    optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    grads = nnx.state(model, nnx.Param)

    def step(state, grads):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    compiled = jax.jit(step, donate_argnums=0).lower(state, grads).compile()
    check_held_step(compiled, state, len(params))
    # The step runs: a fresh state gives a held step, parameters unchanged. The compiled
    # program itself runs it; it donates `state`, which shares its buffers with `grads`
    # and `params`, so those are copied first.
    want = np.asarray(params["w"]).copy()
    grads = jax.tree.map(lambda x: np.asarray(x).copy(), grads)
    new_model, _ = nnx.merge(graphdef, compiled(state, grads))
    assert jnp.array_equal(new_model.w[...], want)
