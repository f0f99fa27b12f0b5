"""Structural guards for the sparse accumulator's steps (no clocks involved).

A held step inserts the gradient's rows: it sorts the gradient's own ids (a few, never
the buffer's `capacity`) and binary-searches the buffer's rows, kept in order, so the
release sorts nothing either. XLA moves work between loops and branches unless it is
stopped, so these tests read what the steps compile to:

- on this CPU, the optimized HLO of a jitted, donated update (and train step) sorts
  no array of the buffer's size anywhere, and a held step sorts the gradient's ids;
- lowered for TPU and for GPU (`lowering_platforms`), no sort anywhere is of the
  buffer's size, and no loop is left (the searches are unrolled).

With an `axis_name`, each replica also sorts its own gradient's rows for the
fixed-order sum of duplicates; those sorts are over the gradient, never the buffer,
so the sizes below are chosen to tell them apart.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from _hlo import Op, every_call, instructions

import optax_accum
from optax_accum import IndexedSlices

ROWS, DIM = 1009, 3
CAPACITY = 24  # the buffer's size: no gradient array has it
NNZ = 5
REPLICAS = 2  # the unrolled insertion is the same code for 2 to 8 replicas


def _accumulator(axis_name=None):
    return optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(0.1),
        4,
        capacity=CAPACITY,
        sparse={"e": True, "b": False},
        axis_name=axis_name,
    )


def _params():
    return {"e": jnp.zeros((ROWS, DIM)), "b": jnp.zeros(DIM)}


def _grads():
    ids = jnp.arange(NNZ, dtype=jnp.int32) * 7
    return {"e": IndexedSlices(ids, jnp.ones((NNZ, DIM)), (ROWS, DIM)), "b": jnp.ones(DIM)}


def _programs(axis_name):
    """(name, jitted function, args): an update returning the state first (so the
    donated state lines up with the outputs) and a canonical train step."""
    tx = _accumulator(axis_name)
    params, grads = _params(), _grads()

    def update(state, grads, params):
        updates, state = tx.update(grads, state, params)
        return state, updates

    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax_accum.apply_updates(params, updates), state

    programs = [("update", update, (0,), (tx.init(params), grads, params))]
    programs.append(("train_step", train_step, (0, 1), (params, tx.init(params), grads)))
    if axis_name is None:
        return [(n, jax.jit(f, donate_argnums=d), a) for n, f, d, a in programs]

    def replicated(f):
        return jax.vmap(f, axis_name=axis_name)

    def stack(tree):
        return jax.tree.map(lambda x: jnp.stack([x] * REPLICAS), tree)

    return [(n, jax.jit(replicated(f), donate_argnums=d), stack(a)) for n, f, d, a in programs]


# --------------------------------------------------------------------------- CPU HLO


def _buffer_sorts(ops: list[Op]) -> list[str]:
    """Sorts of `CAPACITY` 32-bit keys alone (batched over replicas under vmap)."""
    buffer = re.compile(rf"[su]32\[(\d+,)?{CAPACITY}\]\S*")
    return [op.name for op in ops if op.opcode == "sort" and buffer.fullmatch(op.result)]


# --------------------------------------------------------------------------- TPU / GPU lowering


def _sorts(mlir: str, *, in_branches: bool = False) -> list[str]:
    """Result types of the sorts `main` runs outside every `case`/`if` region (with
    `in_branches`, inside them too), following calls to private functions (found by
    reading the region nesting of the text)."""
    funcs: dict[str, dict] = {}
    current, stack = None, []
    for raw in mlir.splitlines():
        line = raw.strip()
        header = re.match(r"func\.func (?:public |private )?@([\w.$-]+)\(", line)
        if header:
            current, stack = header.group(1), []
            funcs[current] = {"sorts": [], "calls": []}
            continue
        if current is None:
            continue
        inside = any(kind in ("case", "if") for kind, _ in stack)
        call = re.search(r"call @([\w.$-]+)\(", line)
        if call and (in_branches or not inside):
            funcs[current]["calls"].append(call.group(1))
        popped = None
        if line.startswith("}"):
            if not stack:
                current = None
                continue
            popped = stack.pop()
            if popped[0] == "sort" and (in_branches or not popped[1]) and not line.endswith("{"):
                funcs[current]["sorts"].append(line.split("->")[-1].strip())
        if line.endswith("{"):
            if popped is not None:
                stack.append(popped)
            elif '"stablehlo.case"' in line or "stablehlo.if" in line:
                stack.append(("case", inside))
            elif '"stablehlo.sort"' in line:
                stack.append(("sort", inside))
            else:
                stack.append(("other", inside))

    def reached(name: str, seen: frozenset = frozenset()) -> list[str]:
        if name in seen or name not in funcs:
            return []
        found = list(funcs[name]["sorts"])
        for callee in funcs[name]["calls"]:
            found += reached(callee, seen | {name})
        return found

    return reached("main")


# --------------------------------------------------------------------------- the guards


@pytest.mark.parametrize("axis_name", [None, "r"], ids=["one device", "axis_name"])
def test_no_step_sorts_the_buffer_on_cpu_tpu_and_gpu(axis_name):
    """Each program is traced once, then compiled for this CPU and lowered for TPU and
    for GPU (one test per program set, so the tracing is not repeated per platform)."""
    gradient = re.compile(rf"[su]32\[(\d+,)?({NNZ}|{NNZ * REPLICAS})\]\S*")
    for name, fn, args in _programs(axis_name):
        traced = fn.trace(*args)
        hlo = traced.lower().compile().as_text()
        assert not _buffer_sorts(instructions(hlo)), f"{name}: a step sorts the buffer"
        held = [op for op in every_call(hlo) if op.opcode == "sort"]
        assert any(gradient.match(op.result.strip("()").split(", ")[0]) for op in held), (
            f"{name}: the held step's sort of the gradient's ids is missing: {held}"
        )
        for platform in ("tpu", "cuda"):
            mlir = traced.lower(lowering_platforms=(platform,)).as_text()
            assert "stablehlo.while" not in mlir, f"{name}: a loop on {platform}"
            every = _sorts(mlir, in_branches=True)
            assert _sorts(mlir), f"{name} on {platform}: the gradient's sort is missing"
            buffer = [t for t in every if re.search(rf"tensor<(\d+x)?{CAPACITY}xu?i32>", t)]
            assert not buffer, f"{name} on {platform}: a step sorts the buffer: {buffer}"


def test_the_guards_see_a_sort_outside_a_branch():
    """The readers above are not blind: a sort of the buffer's size run on every step
    is found, in the HLO and in both lowerings."""

    def always_sorts(x):
        return jnp.sort(x), jax.lax.cond(x[0] > 0, jnp.sort, lambda y: y, x)

    x = jnp.arange(CAPACITY, dtype=jnp.int32)
    hlo = jax.jit(always_sorts).lower(x).compile().as_text()
    assert len(_buffer_sorts(every_call(hlo))) == 1
    assert len(_buffer_sorts(instructions(hlo))) == 2
    for platform in ("tpu", "cuda"):
        mlir = jax.jit(always_sorts).trace(x).lower(lowering_platforms=(platform,)).as_text()
        assert len([t for t in _sorts(mlir) if f"{CAPACITY}xi32" in t]) == 1
        assert len([t for t in _sorts(mlir, in_branches=True) if f"{CAPACITY}xi32" in t]) == 2
