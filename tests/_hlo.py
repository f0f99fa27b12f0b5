"""Reading compiled XLA:CPU HLO text, for the structural guards (no clocks involved).

The computations and collectives are read by `optax_accum.demo.hlo`, which the demo
and the benchmarks count with too; this module adds the instructions.

Only the instruction grammar is relied on (`%name = type[dims] opcode(operands)`),
which reads the same from jax 0.8 to 0.12; opcodes are compared as parsed names,
never as substrings of a line.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import numpy as np

from optax_accum.demo.hlo import Collective, called, computations
from optax_accum.demo.hlo import collectives as _collectives

# `lowered.compile(compiler_options=AS_USERS_COMPILE)`: XLA:CPU's code generation as
# users get it, for the tests that read how the compiler laid a program out (kernels,
# in-place updates). The suite turns XLA:CPU's fusion emitters off (conftest.py) for
# compile time; the older emitters leave a lone elementwise op outside any fusion and
# lower a scatter to a dynamic-update-slice.
AS_USERS_COMPILE = {"xla_cpu_use_fusion_emitters": True}

_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*")
_ARRAY = re.compile(r"\w+\[([^\]]*)\]\S*")
_OPCODE = re.compile(r"\s*([\w-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction: its result's type (as written) and number of elements (0 for a
    tuple), its opcode, and the rest of its line (operands and attributes)."""

    name: str
    result: str
    size: int
    opcode: str
    operands: str


def _instruction(line: str) -> Op | None:
    assign = _ASSIGN.match(line)
    if assign is None:
        return None
    start = rest = line[assign.end() :]
    size = 0
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rest = rest[i + 1 :]
                break
    else:
        array = _ARRAY.match(rest)
        if array is None:
            return None
        size = int(np.prod([int(d) for d in array.group(1).split(",") if d]))
        rest = rest[array.end() :]
    op = _OPCODE.match(rest)
    if op is None:
        return None
    result = start[: len(start) - len(rest)].strip()
    return Op(assign.group(1), result, size, op.group(1), op.group(2))


def every_call(hlo: str) -> list[Op]:
    """The instructions that run on every call of a compiled program.

    ENTRY and what it calls (fusions, calls, reductions), leaving out the bodies of
    loops and the branches of conditionals: on a held step of a holding transform,
    the release lives in those.
    """
    entry, comps = computations(hlo)
    seen, todo, ops = set(), [entry], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            op = _instruction(line)
            if op is not None:
                ops.append(op)
                todo += called(line)
    return ops


def instructions(hlo: str) -> list[Op]:
    """Every instruction of every computation, loop bodies and branches included."""
    return [op for op in map(_instruction, hlo.splitlines()) if op is not None]


def full_size_counts(ops: list[Op]) -> collections.Counter:
    """How many instructions of each opcode have a result of more than one element."""
    return collections.Counter(op.opcode for op in ops if op.size > 1)


def collectives(compiled_or_text: jax.stages.Compiled | str) -> list[Collective]:
    """Each collective of a compiled program (or its `as_text()`), in program order:
    its opcode, the bytes of its result, and whether it runs on every call (ENTRY and
    what ENTRY calls unconditionally) or only inside a loop body or a branch."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    return _collectives(text)
