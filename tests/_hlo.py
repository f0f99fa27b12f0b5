"""Reading compiled XLA:CPU HLO text, for the structural guards (no clocks involved).

Only the instruction grammar is relied on (`%name = type[dims] opcode(operands)`),
which reads the same from jax 0.8 to 0.12; opcodes are compared as parsed names,
never as substrings of a line.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*")
_ARRAY = re.compile(r"\w+\[([^\]]*)\]\S*")
_OPCODE = re.compile(r"\s*([\w-]+)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s")
_CALLS = re.compile(r"\b(?:calls|to_apply)=\{?(%[\w.,\s%-]+)\}?")


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction: its result's number of elements (0 for a tuple) and opcode."""

    name: str
    size: int
    opcode: str
    operands: str


def _instruction(line: str) -> tuple[str, int, str, str] | None:
    """(name, number of elements or 0 for a tuple, opcode, operands and attributes)."""
    assign = _ASSIGN.match(line)
    if assign is None:
        return None
    rest, size = line[assign.end() :], 0
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
    return None if op is None else (assign.group(1), size, op.group(1), op.group(2))


def _computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
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


def _called(line: str) -> list[str]:
    """Computations an instruction calls on every run of it: fusions and reductions,
    not the bodies of loops nor the branches of conditionals."""
    return [name for group in _CALLS.findall(line) for name in re.findall(r"%([\w.-]+)", group)]


def every_call(hlo: str) -> list[Op]:
    """The instructions that run on every call of a compiled program.

    ENTRY and what it calls (fusions, calls, reductions), leaving out the bodies of
    loops and the branches of conditionals: on a held step of a holding transform,
    the release lives in those.
    """
    entry, comps = _computations(hlo)
    seen, todo, ops = set(), [entry], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            instruction = _instruction(line)
            if instruction is not None:
                ops.append(Op(*instruction))
                todo += _called(line)
    return ops


def full_size_counts(ops: list[Op]) -> collections.Counter:
    """How many instructions of each opcode have a result of more than one element."""
    return collections.Counter(op.opcode for op in ops if op.size > 1)
