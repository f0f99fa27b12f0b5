"""Counting the collectives in a compiled XLA program, and the bytes they carry.

The demo's all-reduce column (data_parallel.py) comes from here, and so do the
figures of `benchmarks/collectives.py` (checked by tests/test_cross_shard.py). Reads
the HLO text that `jax.jit(f).lower(...).as_text(dialect="hlo")` or
`.compile().as_text()` returns; nothing here depends on JAX internals.
"""

from __future__ import annotations

import re

import numpy as np

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_INSTRUCTION = re.compile(r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[su]8|[su]16|[su]32|[su]64|bf16|f16|f32|f64)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_GATED = re.compile(r"(?:branch_computations=\{(?P<branches>[^}]*)\}|body=%?(?P<body>[\w.\-]+))")
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?(?P<callee>[\w.\-]+)")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def count_collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collective ops in a compiled module's HLO text, and the bytes they produce.

    Returns `{"every_step": {...}, "when_taken": {...}}`, each mapping an op name
    (e.g. "all-reduce") to its count and `"<op> bytes"` to the summed size of its
    outputs (the payload per device: an all-reduce's reduced array, a permute's
    received array). "every_step" counts ops outside any `conditional` branch or
    `while` body; "when_taken" counts those inside (for a `conditional`, its largest
    branch): the extra collectives of a step that takes the branch (e.g. a release or
    sync step).
    """
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group("name")
            comps[current] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[current]
        elif current is not None:
            comps[current].append(line)

    def walk(name: str) -> tuple[dict, dict]:
        always: dict[str, int] = {}
        gated: dict[str, int] = {}

        def add(into: dict, other: dict) -> None:
            for k, v in other.items():
                into[k] = into.get(k, 0) + v

        for line in comps.get(name, []):
            match = _INSTRUCTION.search(line)
            if match:
                add(always, {match["op"]: 1, f"{match['op']} bytes": _bytes(match["shape"])})
            for callee in _CALLS.findall(line):
                a, g = walk(callee)
                add(always, a)
                add(gated, g)
            gate = _GATED.search(line)
            if gate:
                names = gate["branches"] or gate["body"]
                regions = [walk(n.strip().lstrip("%")) for n in names.split(",")]
                totals = []
                for a, g in regions:
                    both = dict(a)
                    add(both, g)
                    totals.append(both)
                add(gated, max(totals, key=lambda t: sum(t.values())))
        return always, gated

    always, gated = walk("__entry__")
    return {"every_step": always, "when_taken": gated}


def format_bytes(n: int) -> str:
    """Bytes as "12 B" or "19.2 kB"."""
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB"
