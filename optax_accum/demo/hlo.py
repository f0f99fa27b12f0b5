"""Reading compiled XLA programs: their computations, and the collectives they run.

The demo's all-reduce column (data_parallel.py) comes from here, and so do the
figures of `benchmarks/collectives.py` (checked by tests/test_cross_shard.py) and the
tests' structural guards (tests/_hlo.py). Reads the HLO text that
`jax.jit(f).lower(...).as_text(dialect="hlo")` or `.compile().as_text()` returns;
nothing here depends on JAX internals.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
# An async pair (`all-reduce-start` / `all-reduce-done`) is read from its done, whose
# result is the collective's (a start's is a tuple that holds the operand too).
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(_OPS) + r")(?P<phase>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(pred|[su]8|[su]16|[su]32|[su]64|bf16|f16|f32|f64)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_GATED = re.compile(
    r"(?:branch_computations=\{(?P<branches>[^}]*)\}"
    r"|true_computation=%?(?P<true>[\w.\-]+), false_computation=%?(?P<false>[\w.\-]+)"
    r"|body=%?(?P<body>[\w.\-]+))"
)
_CALLS = re.compile(r"\b(?:calls|to_apply|condition)=(\{[^}]*\}|%?[\w.\-]+)")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}


def _bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def computations(hlo: str) -> tuple[str, dict[str, list[str]]]:
    """The name of the ENTRY computation, and each computation's instruction lines."""
    comps: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group("name")
            comps[current] = []
            if header.group("entry"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, comps


def called(line: str) -> list[str]:
    """Computations an instruction runs whenever it runs: fusions, calls, reductions
    and a loop's condition, not the bodies of loops nor the branches of conditionals."""
    return [name for group in _CALLS.findall(line) for name in re.findall(r"[\w.-]+", group)]


def _gated(line: str) -> list[str]:
    """The computations an instruction may run or not: a loop's body, or the branches
    of a conditional (one list each, alternatives for a conditional)."""
    gate = _GATED.search(line)
    if gate is None:
        return []
    if gate["body"]:
        return [gate["body"]]
    if gate["true"]:
        return [gate["true"], gate["false"]]
    return [n.strip().lstrip("%") for n in gate["branches"].split(",")]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program.

    Attributes:
      opcode: "all-reduce", "reduce-scatter", "all-gather", "all-to-all" or
        "collective-permute" (an async start/done pair is one collective).
      nbytes: bytes of its result on each device.
      every_step: True when it runs on every call of the program (in the ENTRY
        computation or what that calls unconditionally); False when it sits inside a
        loop body or a conditional branch.
      groups: its replica groups (`replica_groups`), each a tuple of device numbers;
        () where the program writes none (the collective spans every device). Not
        compared: two collectives are equal by their opcode, bytes and place.
    """

    opcode: str
    nbytes: int
    every_step: bool
    groups: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), compare=False)

    def crosses(self, part: Callable[[int], object]) -> bool:
        """Whether it moves data between parts of the mesh: a replica group holds
        devices of different parts (`part(number)`, for a device's number in the
        program: its position in the mesh's device list; e.g. `lambda d: d // 4`, the
        row of a (2, 4) mesh), or no group is written (it spans every device)."""
        return not self.groups or any(len({part(d) for d in g}) > 1 for g in self.groups)


_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_NAMED = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?)\))?"
    r"\s*\{([^}]*)\}"
)


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[shape]<=[dims]T(perm)`: arange over `dims`, transposed by
    `perm`, reshaped to `shape`."""
    ids = np.arange(int(np.prod([int(d) for d in dims.split(",")])))
    ids = ids.reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(d) for d in perm.split(",")])
    return ids.reshape([int(d) for d in shape.split(",")])


def replica_groups(line: str) -> tuple[tuple[int, ...], ...]:
    """The replica groups of a collective's HLO line, each a tuple of device numbers,
    as XLA writes them: a list (`{{0,4},{1,5}}`), an iota (`[2,4]<=[8]`, with a
    transpose `T(1,0)`), or over named mesh axes (`mesh['a'=2,'b'=4] {'b'}`, the mesh
    laid over the devices in order or in the order `device_ids=([2,4]T(1,0))` gives,
    grouped along the named axes); () where none are written."""
    listed = _LISTED.search(line)
    if listed:
        groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
        return tuple(tuple(int(i) for i in g.split(",") if i) for g in groups)
    iota = _IOTA_GROUPS.search(line)
    if iota:
        return tuple(tuple(int(i) for i in row) for row in _iota(*iota.groups()))
    named = _NAMED.search(line)
    if named is None:
        return ()
    axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = np.arange(int(np.prod(sizes)))
    if named.group(2):  # the devices in the mesh's order: an iota, maybe transposed
        shape, dims, perm = named.group(3, 4, 5)
        ids = _iota(str(ids.size), dims or shape, perm)
    grouped = re.findall(r"'(\w+)'", named.group(6))
    order = [a for a in names if a not in grouped] + grouped
    ids = ids.reshape(sizes).transpose([names.index(a) for a in order])
    size = int(np.prod([sizes[names.index(a)] for a in grouped]))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))


def _walk(
    comps: dict[str, list[str]],
    name: str,
    every_step: bool,
    branches: Callable[[list[list[Collective]]], list[Collective]],
) -> list[Collective]:
    found: list[Collective] = []
    starts: dict[str, str] = {}  # an async start's line, by its name: its groups
    for line in comps.get(name, []):
        match = _INSTRUCTION.search(line)
        if match and match["phase"] == "-start":
            starts[line.split("=", 1)[0].strip().removeprefix("ROOT ").strip()] = line
        if match and match["phase"] != "-start":
            operand = re.search(r"-done\((?:\S+\s)?(%[\w.\-]+)", line)
            source = starts.get(operand.group(1), line) if operand else line
            collective = Collective(match["op"], _bytes(match["shape"]), every_step)
            found.append(dataclasses.replace(collective, groups=replica_groups(source)))
        for callee in called(line):
            found += _walk(comps, callee, every_step, branches)
        regions = [_walk(comps, n, False, branches) for n in _gated(line)]
        if regions:
            found += branches(regions)
    return found


def collectives(hlo: str) -> list[Collective]:
    """Every collective in a compiled module's HLO text, in program order, each with
    the bytes it produces and whether it runs on every call."""
    entry, comps = computations(hlo)
    return _walk(comps, entry, True, lambda regions: [c for r in regions for c in r])


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
    entry, comps = computations(hlo)

    def largest(regions: list[list[Collective]]) -> list[Collective]:
        return max(regions, key=lambda r: (sum(c.nbytes for c in r), len(r)))

    counts: dict[str, dict[str, int]] = {"every_step": {}, "when_taken": {}}
    for c in _walk(comps, entry, True, largest):
        into = counts["every_step" if c.every_step else "when_taken"]
        into[c.opcode] = into.get(c.opcode, 0) + 1
        into[f"{c.opcode} bytes"] = into.get(f"{c.opcode} bytes", 0) + c.nbytes
    return counts


def format_bytes(n: int) -> str:
    """Bytes as "12 B" or "19.2 kB"."""
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB"
