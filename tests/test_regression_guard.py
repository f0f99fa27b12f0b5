"""Structural guards for the speed of `conditional_accumulator` (no clocks involved).

benchmarks/dense.py times the dense path; these tests pin down the structure that
makes it fast, in the compiled XLA:CPU program of a held step, for every way users
write the step (benchmarks/README.md has the timings):

- canonical: `u, s = tx.update(g, s, p); p = optax.apply_updates(p, u)`, returning
  `(params, opt_state)`, both donated;
- `optax_accum.apply_gradients`, same arguments and return order;
- `jit(tx.update)` returning `(opt_state, updates)` or `(updates, opt_state)`, with
  the state donated;
- Flax's TrainState and NNX: tests/test_regression_guard_flax.py.

On every call of such a program (the loop body that releases is left out): no
arithmetic of the inner optimizer, no full-size copy of a donated buffer, every array
state leaf updated in place; with `apply_gradients`, nothing but `acc + g`.

Each held step is compiled once (`held`) and read by every test that checks it; inner
optimizer x pattern x dtype runs pairwise (tests/_matrix.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import lenient
from _hlo import every_call, full_size_counts
from _matrix import pairwise

import optax_accum

# Arithmetic of the inner optimizers below, which a held step must never run on a
# full-size array: Adam's moments and step (multiply, divide, sqrt), AdamW's weight
# decay (multiply), momentum (multiply).
OPTIMIZER_OPS = {"multiply", "divide", "sqrt", "rsqrt", "power", "exponential", "log"}
# What a fused held step may run on a full-size array: `acc + g`, in a fusion, with
# a convert when the gradient's dtype is not the accumulator's, and the selection of
# zeros in place of the sum after a release (`_sums.restarted`: a select of a
# broadcast 0, in the same fusion).
ACCUMULATE_OPS = {
    "add",
    "convert",
    "fusion",
    "parameter",
    "get-tuple-element",
    "bitcast",
    "select",
    "broadcast",
}

INNERS = {
    "adam": lambda: lenient(optax.adam(1e-3)),
    "adamw": lambda: lenient(optax.adamw(1e-3, weight_decay=1e-2)),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
}
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])


def make_params(dtype) -> dict:
    rng = np.random.default_rng(0)
    return {  # two leaves of one shape, whose zero updates XLA could merge
        "w": jnp.asarray(rng.normal(size=(64, 32)), dtype),
        "v": jnp.asarray(rng.normal(size=(64, 32)), dtype),
        "b": jnp.asarray(rng.normal(size=(32,)), dtype),
        "e": jnp.asarray(rng.normal(size=(16, 8)), dtype),
    }


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def array_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0)]


# Each pattern: (step, donated argument positions, whether params come first).
def canonical(tx, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def fused(tx, params, state, grads):
    return optax_accum.apply_gradients(tx, grads, state, params)


def state_first(tx, state, grads, params):
    updates, state = tx.update(grads, state, params)
    return state, updates


def updates_first(tx, state, grads, params):
    updates, state = tx.update(grads, state, params)
    return updates, state


PATTERNS = {
    "canonical": (canonical, (0, 1)),
    "apply_gradients": (fused, (0, 1)),
    "state_first": (state_first, (0,)),
    "updates_first": (updates_first, (0,)),
}


def compile_held(tx, pattern: str, params):
    """The compiled program of `pattern` (the state is a fresh one: its step holds)."""
    step, donate = PATTERNS[pattern]
    state = tx.init(params)
    args = (params, state, params) if donate == (0, 1) else (state, params, params)
    return jax.jit(functools.partial(step, tx), donate_argnums=donate).lower(*args).compile()


@functools.cache
def held(inner: str, pattern: str, dtype) -> tuple:
    """The params, a fresh state and the compiled held step of
    `conditional_accumulator(inner, 4)`: compiled once for every test that reads it
    (the program is only read, never run, so nothing is donated)."""
    tx = optax_accum.conditional_accumulator(INNERS[inner](), num_required=4)
    params = make_params(dtype)
    return params, tx.init(params), compile_held(tx, pattern, params)


DTYPE_IDS = {jnp.float32: "f32", jnp.bfloat16: "bf16"}


@pytest.mark.parametrize(
    ("inner", "pattern", "dtype"),
    pairwise(sorted(INNERS), sorted(PATTERNS), list(DTYPE_IDS)),
    ids=lambda x: DTYPE_IDS.get(x, x),
)
def test_held_step_runs_no_optimizer_arithmetic_and_copies_no_state(inner, pattern, dtype):
    """Pairwise (tests/_matrix.py), not the full product: every inner optimizer in
    every step pattern, and each of them in both dtypes (12 of 24 compiles); the
    canonical pattern also meets every inner in both dtypes below, in
    `test_canonical_step_carries_its_updates_in_the_accumulator`."""
    params, state, compiled = held(inner, pattern, dtype)
    ops = every_call(compiled.as_text())
    counts = full_size_counts(ops)

    opcodes = {op.opcode for op in ops}
    assert "while" in opcodes, f"XLA:CPU decides with a 0-or-1-trip loop, got {sorted(opcodes)}"
    arithmetic = sorted(set(counts) & OPTIMIZER_OPS)
    assert not arithmetic, f"a held step runs optimizer arithmetic: {arithmetic}"

    # Copy insertion adds a `copy` where a buffer cannot be updated in place.
    copies = counts["copy"]
    if pattern == "updates_first":
        # jit pairs the donated state buffers with outputs in output order, so the
        # updates take the accumulator's buffers and every state leaf moves to
        # another's: one copy into the loop and one out, at most (optax.MultiSteps
        # copies its state too).
        assert copies <= 2 * len(array_leaves(state)), counts
    else:
        assert copies == 0, f"arrays copied on every call: {counts}"
        donated = state if pattern == "state_first" else (params, state)
        aliased = compiled.memory_analysis().alias_size_in_bytes
        assert aliased >= sum(x.nbytes for x in array_leaves(donated))

    n = len(jax.tree.leaves(params))
    if pattern == "apply_gradients":  # the params and the inner state are not touched
        assert set(counts) <= ACCUMULATE_OPS, counts
        assert counts["add"] == n, counts
    elif pattern == "canonical":  # acc + g, and params + zeros
        assert counts["add"] <= 2 * n, counts


def test_the_guard_sees_optax_multisteps_copy_and_compute():
    """The checks above have teeth: MultiSteps' held step fails them."""
    tx = optax.MultiSteps(INNERS["adam"](), 4)
    params = make_params(jnp.float32)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes int32 and float32
        ops = every_call(compile_held(tx, "canonical", params).as_text())
    counts = full_size_counts(ops)
    assert set(counts) & OPTIMIZER_OPS
    assert counts["copy"] > 0
    assert "while" not in {op.opcode for op in ops}


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    ("param_dtype", "accumulator_dtype", "expected_accumulator_dtype"),
    [
        (jnp.float32, None, jnp.float32),
        (jnp.bfloat16, None, jnp.float32),
        (jnp.float16, None, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_state_is_one_accumulator_plus_inner_state(
    inner, param_dtype, accumulator_dtype, expected_accumulator_dtype
):
    inner_tx = INNERS[inner]()
    tx = optax_accum.conditional_accumulator(
        inner_tx, num_required=4, accumulator_dtype=accumulator_dtype
    )
    params = make_params(param_dtype)
    state = tx.init(params)

    one_accumulator = (
        sum(x.size for x in jax.tree.leaves(params))
        * jnp.dtype(expected_accumulator_dtype).itemsize
    )
    allowed = one_accumulator + tree_bytes(inner_tx.init(params))
    scalars = [x for x in jax.tree.leaves(state) if x.ndim == 0]
    assert tree_bytes(state) <= allowed + tree_bytes(scalars)
    assert tree_bytes(scalars) <= 32
    assert tree_bytes(state.storage) == one_accumulator


@DTYPES
@pytest.mark.parametrize("pattern", ["canonical", "apply_gradients"])
def test_train_step_temporaries_are_the_release_mean_and_updates(pattern, dtype):
    """A donated train step keeps no copy of the state, the accumulator or the params
    in flight: its temporaries are the release's mean (in the accumulator's dtype)
    and, when that is not the params' dtype, the updates (optax.MultiSteps needs three
    trees in float32)."""
    params, state, compiled = held("adam", pattern, dtype)

    allowed = tree_bytes(state.storage)
    if state.storage["w"].dtype != params["w"].dtype:
        allowed += tree_bytes(params)
    slack = 4096  # scalars, tuples and the loop flag
    assert compiled.memory_analysis().temp_size_in_bytes <= allowed + slack


@DTYPES
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_canonical_step_carries_its_updates_in_the_accumulator(inner, dtype):
    """XLA:CPU allocates a program's temporaries afresh on every call, a page fault for
    each 4 KiB, so the canonical step's full-size zero updates cost 8,193 faults a held
    step at 8M parameters. The updates travel in the accumulator's buffers instead
    (bfloat16 updates in a float32 sum too): the loop carries no tree besides the state
    it updates, and in float32 no temporary but scalars is left."""
    params, state, compiled = held(inner, "canonical", dtype)
    (loop,) = [op for op in every_call(compiled.as_text()) if op.opcode == "while"]
    # The state the loop updates, and the params where AdamW's weight decay reads them
    # (passed through, not copied); the old form also carried a tree of updates.
    carried = (state.inner_state, state.storage, params if inner == "adamw" else ())
    big = [x for x in array_leaves(carried) if x.shape == (64, 32)]
    assert loop.result.count("[64,32]") == len(big), loop.result
    if dtype == jnp.float32:  # bfloat16: jax 0.8's XLA keeps the release's float32 mean
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp <= 1024, f"{temp} bytes of temporaries; scalars and tuples take < 1 kB"


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_fresh_state_and_params_can_be_donated(pattern):
    """`init` gives every leaf its own buffer: donating a fresh state (and params) to
    a train step works as it comes, with no defensive copy."""
    tx = optax_accum.conditional_accumulator(INNERS["adam"](), num_required=2)
    params = make_params(jnp.float32)
    grads = jax.tree.map(jnp.ones_like, params)
    step, donate = PATTERNS[pattern]
    step = jax.jit(functools.partial(step, tx), donate_argnums=donate)
    state = tx.init(params)
    for _ in range(2):
        if donate == (0, 1):
            params, state = step(params, state, grads)
        else:
            out = step(state, grads, params)
            state = out[0] if pattern == "state_first" else out[1]
    assert int(optax_accum.global_step(state)) == 1
