"""What TPU and GPU get: every transform lowered on this CPU for ("tpu",) and ("cuda",).

`jax.jit(f).trace(*args).lower(lowering_platforms=...)` builds the StableHLO module a
TPU or a GPU would compile, without one. For every case of tests/_cases.py, in the
canonical step and in `apply_gradients`, the module

- lowers;
- decides held or released with a `stablehlo.case` of two branches, one of which
  runs the inner optimizer (transforms that hold or drop);
- holds no `stablehlo.while` (the CPU's 0/1-trip loop) and no
  `stablehlo.optimization_barrier` (which would block fusion there).

On the CPU the same program takes the loop instead, which is checked too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import CASE_IDS, CASES, REPLICAS, Case, stack, step_inputs
from jax.sharding import PartitionSpec as P

import optax_accum

ACCELERATORS = [("tpu",), ("cuda",)]


def _step(case: Case, tx, fused: bool):
    def step(params, state, grads, extra):
        if fused:
            return optax_accum.apply_gradients(tx, grads, state, params, **extra)
        updates, state = tx.update(grads, state, params, **extra)
        return case.apply_updates(params, updates), state

    return step


def _per_replica(step):
    def body(params, state, grads, extra):
        row = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        out = step(row(params), row(state), row(grads), extra)
        return jax.tree.map(lambda x: x[None], out)

    return body


def lowered_text(case: Case, platforms: tuple[str, ...], *, fused: bool) -> str:
    tx = case.make("replicas" if case.needs_axis else None)
    params = case.params()
    step = _step(case, tx, fused)
    if case.needs_axis:
        # Replicas under jax.shard_map, each holding row r of the stacked inputs
        # (jax.vmap would turn every cond on a replicated predicate into a select).
        params = stack([params] * REPLICAS)
        state = jax.vmap(tx.init)(params)
        step = jax.shard_map(
            _per_replica(step),
            mesh=jax.sharding.Mesh(np.array(jax.devices()[:REPLICAS]), ("replicas",)),
            in_specs=(P("replicas"), P("replicas"), P("replicas"), P()),
            out_specs=P("replicas"),
            check_vma=False,
        )
    else:
        state = tx.init(params)
    args = (params, state, step_inputs(case, 0, frozenset()), case.extra_args(0))
    return jax.jit(step).trace(*args).lower(lowering_platforms=platforms).as_text()


def case_ops(text: str) -> list[list[str]]:
    """Each `stablehlo.case` op of the module, as the list of its branch regions' text."""
    lines = text.splitlines()
    found = []
    for start, line in enumerate(lines):
        if '"stablehlo.case"' not in line:
            continue
        depth, regions, current = 0, [], []
        for body in lines[start:]:
            if depth == 1 and body.strip().startswith("}, {"):
                regions.append("\n".join(current))
                current = []
                continue
            depth += body.count("{") - body.count("}")
            current.append(body)
            if depth <= 0:
                regions.append("\n".join(current))
                break
        found.append(regions)
    return found


def functions(text: str) -> dict[str, str]:
    """The module's functions by name, each as its text (a branch body is one, called
    from the case's region: see `_branch._Traced.of`)."""
    found, name, body = {}, None, []
    for line in text.splitlines():
        start = re.match(r"\s*func\.func (?:\w+ )?@([\w.$-]+)\(", line)
        if start:
            name, body = start.group(1), []
        if name is not None:
            body.append(line)
            if line.strip() == "}" and line.startswith("  }"):
                found[name], name = "\n".join(body), None
    return found


def _with_callees(region: str, funcs: dict[str, str], depth: int = 4) -> str:
    """`region` followed by the text of the functions it calls, `depth` calls deep."""
    if depth == 0:
        return region
    called = re.findall(r"call @([\w.$-]+)\(", region)
    return "\n".join(
        [region] + [_with_callees(funcs[c], funcs, depth - 1) for c in called if c in funcs]
    )


def is_decision(regions: list[str], funcs: dict[str, str]) -> bool:
    """A case of two or more branches, one of which computes on arrays (not just the
    constants of `lax.platform_dependent`'s own index), itself or in what it calls."""
    computes = [
        re.search(
            r"stablehlo\.(multiply|add|divide|subtract|sqrt|all_reduce)",
            _with_callees(r, funcs),
        )
        for r in regions
    ]
    return len(regions) >= 2 and any(computes)


HOLDS = {c.name for c in CASES if c.name.startswith(("conditional", "sparse", "drop_stale", "agn"))}


@pytest.mark.parametrize("fused", [False, True], ids=["canonical", "apply_gradients"])
@pytest.mark.parametrize("platforms", ACCELERATORS, ids=lambda p: p[0])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_accelerators_branch_with_a_case_and_no_loop_or_barrier(case, platforms, fused):
    text = lowered_text(case, platforms, fused=fused)
    assert "stablehlo.while" not in text
    assert "optimization_barrier" not in text
    if case.name in HOLDS:
        funcs = functions(text)
        assert any(is_decision(r, funcs) for r in case_ops(text)), "no held/release case"


@pytest.mark.parametrize("case", [c for c in CASES if c.name in HOLDS], ids=lambda c: c.name)
def test_the_cpu_takes_the_loop(case):
    text = lowered_text(case, ("cpu",), fused=False)
    assert "stablehlo.while" in text
    assert not any(is_decision(r, functions(text)) for r in case_ops(text))


# --------------------------------------------------------------------------- tracing cost


def _counting(inner, calls: list):
    """`inner`, counting how often its `update` is traced."""

    def update(updates, state, params=None, **extra_args):
        calls.append(1)
        return inner.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


NESTINGS = [
    lambda tx: optax_accum.conditional_accumulator(tx, 2),
    lambda tx: optax_accum.drop_stale_gradients(tx, 1),
    lambda tx: optax_accum.agn(tx, 2),
]


@pytest.mark.parametrize("fused", [False, True], ids=["canonical", "apply_gradients"])
@pytest.mark.parametrize("levels", [1, 2, 3])
def test_the_inner_update_is_traced_at_most_twice_per_level(levels, fused):
    """Nested optax_accum transforms trace the innermost optimizer at most 2**levels
    times (it was 3**levels): each branch body is traced once and reused by both the
    CPU and the accelerator forms."""
    calls: list = []
    tx = _counting(optax.sgd(0.1, momentum=0.9), calls)
    for wrap in NESTINGS[:levels]:
        tx = wrap(tx)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    step = _step(Case("nested", lambda axis: tx), tx, fused)
    jax.jit(step).trace(params, tx.init(params), params, {}).lower()
    assert 1 <= len(calls) <= 2**levels
