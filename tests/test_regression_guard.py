"""Structural guards for the speed of `conditional_accumulator` (no clocks involved).

benchmarks/dense.py times the dense path; these tests pin down the structure that
makes it fast, by reading what a held update traces and compiles to:

- the inner optimizer is traced only inside 0-or-1-trip loops, and after XLA's
  optimizations none of its arithmetic runs outside them (XLA hoists loop-invariant
  work out of loops unless it is stopped);
- with the state donated, every state buffer is updated in place: nothing is copied
  on a held step, and all state leaves are aliased to outputs;
- the state is one accumulator plus the inner state plus scalar counters, and a held
  train step needs no temporaries beyond the updates it returns.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import lenient

import optax_accum

# Arithmetic of the inner optimizers below, which a held step must never run on a
# full-size array: Adam's moments and step (mul, div, sqrt), AdamW's weight decay
# (mul), momentum (mul).
OPTIMIZER_OPS = {"multiply", "divide", "sqrt", "rsqrt", "power", "exponential", "log"}
OPTIMIZER_PRIMITIVES = {"mul", "div", "sqrt", "rsqrt", "pow", "integer_pow", "exp", "log"}

INNERS = {
    "adam": lambda: lenient(optax.adam(1e-3)),
    "adamw": lambda: lenient(optax.adamw(1e-3, weight_decay=1e-2)),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


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


def held_update(tx):
    """`tx.update` as a user jits it, returning the (donated) state first."""

    def update(state, grads, params):
        updates, state = tx.update(grads, state, params)
        return state, updates

    return update


# --------------------------------------------------------------------------- jaxpr


def array_primitives(jaxpr: jax.extend.core.Jaxpr, *, into_loops: bool) -> Iterator[str]:
    """Names of the primitives in `jaxpr` (and nested jaxprs) with a non-scalar result.

    With `into_loops=False`, the bodies of `while` loops are not entered.
    """
    for eqn in jaxpr.eqns:
        if any(getattr(v.aval, "ndim", 0) for v in eqn.outvars):
            yield eqn.primitive.name
        if eqn.primitive.name == "while" and not into_loops:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from array_primitives(inner, into_loops=into_loops)


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_inner_update_is_traced_only_inside_a_loop(inner):
    tx = optax_accum.conditional_accumulator(INNERS[inner](), num_required=4)
    params = make_params(jnp.float32)
    jaxpr = jax.make_jaxpr(held_update(tx))(tx.init(params), params, params).jaxpr

    outside = set(array_primitives(jaxpr, into_loops=False))
    assert not outside & OPTIMIZER_PRIMITIVES, sorted(outside & OPTIMIZER_PRIMITIVES)
    inside = set(array_primitives(jaxpr, into_loops=True)) - outside
    assert inside & OPTIMIZER_PRIMITIVES, sorted(inside)


# --------------------------------------------------------------------------- HLO

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\w+)\[([^\]]*)\]\S*\s+([\w-]+)\((.*)$")
HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s")


def computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
    """The optimized HLO module as {computation name: instruction lines}, and ENTRY."""
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    assert entry is not None, "no ENTRY computation in the HLO"
    return entry, comps


def run_every_call(entry: str, comps: dict[str, list[str]]) -> list[str]:
    """Instruction lines that run on every call: ENTRY and what it calls, except the
    bodies (and conditions) of loops and the branches of conditionals."""
    seen, todo, lines = set(), [entry], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            lines.append(line)
            attrs = re.sub(r"(body|condition|branch_computations)=\{?[%\w.,\s-]+\}?", "", line)
            todo += re.findall(r"(?:calls|to_apply)=%([\w.-]+)", attrs)
    return lines


def full_size(instruction_line: str) -> tuple[str, str] | None:
    """(opcode, operands) of an instruction whose result has more than one element."""
    m = INSTRUCTION.match(instruction_line)
    if m is None or np.prod([int(d) for d in m.group(3).split(",") if d]) <= 1:
        return None
    return m.group(4), m.group(5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_held_path_runs_no_optimizer_arithmetic_and_copies_no_state(inner, dtype):
    tx = optax_accum.conditional_accumulator(INNERS[inner](), num_required=4)
    params = make_params(dtype)
    state = tx.init(params)
    compiled = jax.jit(held_update(tx), donate_argnums=0).lower(state, params, params).compile()
    entry, comps = computations(compiled.as_text())
    every_call = [op for op in map(full_size, run_every_call(entry, comps)) if op]

    arithmetic = sorted({opcode for opcode, _ in every_call} & OPTIMIZER_OPS)
    assert not arithmetic, f"held path runs optimizer arithmetic: {arithmetic}"
    assert any("while(" in line for line in comps[entry]), "no 0-or-1-trip loop"

    # Copy insertion adds a `copy` where a buffer cannot be updated in place: a state
    # leaf passed through a branch, or one zero broadcast shared by all update leaves.
    copied = [operands.split(")")[0] for opcode, operands in every_call if opcode == "copy"]
    assert not copied, f"arrays copied on every call: {copied}"

    array_state = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim)
    assert compiled.memory_analysis().alias_size_in_bytes >= array_state


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
    assert tree_bytes(state.accumulator) == one_accumulator


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_train_step_temporaries_are_at_most_the_updates(dtype):
    """A donated train step holds one updates tree in flight, nothing more: no copy of
    the state, the accumulator or the params (optax.MultiSteps needs three trees)."""
    tx = optax_accum.conditional_accumulator(INNERS["adam"](), num_required=4)
    params = make_params(dtype)

    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = (
        jax.jit(train_step, donate_argnums=(0, 1)).lower(params, tx.init(params), params).compile()
    )
    slack = 4096  # scalars, tuples and the loop flag
    assert compiled.memory_analysis().temp_size_in_bytes <= tree_bytes(params) + slack


def test_fresh_state_and_params_can_be_donated():
    """`init` gives every leaf its own buffer: donating a fresh state (and params) to
    a train step works as it comes, with no defensive copy."""
    tx = optax_accum.conditional_accumulator(INNERS["adam"](), num_required=2)
    params = make_params(jnp.float32)
    grads = jax.tree.map(jnp.ones_like, params)

    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(train_step, donate_argnums=(0, 1))
    state = tx.init(params)
    for _ in range(2):
        params, state = step(params, state, grads)
    assert int(optax_accum.global_step(state)) == 1
