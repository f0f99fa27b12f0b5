"""Programs compiled for TPU on a machine without one, and what they do on every step.

With `libtpu` installed (`pip install "jax[tpu]"`, which pins the `libtpu` of the
installed jax), `jax.experimental.topologies` describes a TPU slice (or several)
without a TPU, and `jax.jit(...).lower(...).compile()` for a mesh of its devices runs
the TPU compiler itself: fusion, buffer assignment, where each collective runs, what
crosses the slower network between slices. `compiled.as_text()` is the program a TPU
would run and `compiled.memory_analysis()` its buffers. The runtime stays on the CPU
(`JAX_PLATFORMS=cpu`, or the CPU first): nothing is allocated and nothing runs.

`read(compiled)` reads such a program into a `Program`: its collectives (bytes,
replica groups, and whether they run on every call or only inside a conditional's
branch or a loop's body), the transfers between slices (the send/recv pairs handed to
`xla_megascale_runtime`), the HBM bytes that the ops on every call read and write, its
temporaries and how many conditionals it runs on every call. The tests' TPU checks
(tests/test_tpu_compiled.py) and `benchmarks/tpu_compiled.py` read programs with it.

What a compiled program cannot show: how long anything takes, and how the network
behaves. Bytes are a program's own accounting, not measured traffic.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# The topologies the checks compile for: one chip generation each, 4 chips a slice.
TOPOLOGIES = {"v5e": "v5e:2x2", "v4": "v4:2x2x1", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_ARRAY = re.compile(r"\b(pred|[su]8|[su]16|[su]32|[su]64|bf16|f16|f32|f64)\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply)=(\{[^}]*\}|%[\w.\-]+)")
_BRANCHES = re.compile(
    r"branch_computations=\{(?P<list>[^}]*)\}"
    r"|true_computation=%(?P<true>[\w.\-]+), false_computation=%(?P<false>[\w.\-]+)"
)
_BODY = re.compile(r"\bbody=%(?P<body>[\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%(?P<condition>[\w.\-]+)")

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# Ops that move no data: a name for a buffer, or control around other ops (whose own
# ops are counted where they run).
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "conditional",
    "while",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "send-done",
}
# Ops that read only the part of their first operand they index (the rest of a large
# buffer, such as an embedding table's row map, is not touched), and ops that update
# their first operand in place, writing only the part they index.
_READS_PART = {"gather", "dynamic-slice", "slice"}
_ASYNC_MOVES = {"copy-start", "slice-start"}
_ASYNC_MOVED = {"copy-done", "slice-done"}
_WRITES_PART = {"scatter", "dynamic-update-slice"}


# --------------------------------------------------------------------------- topologies


def unavailable() -> str | None:
    """Why TPU programs cannot be compiled here, or None when they can."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return (
            "libtpu is not installed: the README's test command installs it "
            '(jax[tpu], matched to the installed jax: pip install "jax[tpu]==<jax version>")'
        )
    try:
        from jax.experimental import topologies  # noqa: F401
    except ImportError as e:  # pragma: no cover - every jax this project supports has it
        return f"this jax cannot describe a TPU topology: {e}"
    return None


@functools.cache
def topology(name: str, num_slices: int = 1) -> Any:
    """The TPU topology `name` (e.g. "v5e:2x2"), `num_slices` slices of it, described
    without a TPU. Loads libtpu in this process; any number of processes may do so at
    once (`ALLOW_MULTIPLE_LIBTPU_LOAD`), and it writes no log files (`TPU_LOG_DIR`)."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=name, num_slices=num_slices)


def _slice_then_id(device: Any) -> tuple[int, int]:
    return getattr(device, "slice_index", 0), device.id


def mesh(
    name: str,
    axis_names: Sequence[str],
    *,
    num_slices: int = 1,
    shape: Sequence[int] | None = None,
    explicit: bool = True,
) -> Any:
    """A mesh of the devices of `num_slices` slices of topology `name`.

    The devices are ordered by slice, then by id, so with several slices the first
    axis runs over the slices and each row of the mesh is one slice
    (`topologies.make_mesh` does not promise that). `shape` defaults to
    `(num_slices, devices per slice)` for two axis names and to all devices on one
    axis for one. Axes are `Explicit` unless `explicit` is False (`Auto`).
    """
    import jax

    devices = sorted(topology(name, num_slices).devices, key=_slice_then_id)
    if shape is None:
        per_slice = len(devices) // num_slices
        shape = (len(devices),) if len(axis_names) == 1 else (num_slices, per_slice)
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(
        np.array(devices, dtype=object).reshape(tuple(shape)),
        tuple(axis_names),
        axis_types=(kind,) * len(axis_names),
    )


# --------------------------------------------------------------------------- the reader


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction: its name, opcode, result type (as written), operand names, the
    text between its parentheses, and the rest of its line."""

    name: str
    opcode: str
    result: str
    operands: tuple[str, ...]
    arguments: str
    attributes: str


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program.

    Attributes:
      opcode: "all-reduce", "all-gather", "reduce-scatter", "collective-permute" or
        "all-to-all" (an async start/done pair is one collective).
      nbytes: bytes of its result on each device.
      groups: the replica groups, each a tuple of device numbers (positions in the
        mesh's device list, as the program numbers them); () where none are written.
      where: the control ops around it, outermost first: "conditional" (a branch, runs
        only when taken) and "while" (a loop body); () on every call.
    """

    opcode: str
    nbytes: int
    groups: tuple[tuple[int, ...], ...]
    where: tuple[str, ...]

    @property
    def every_step(self) -> bool:
        """Whether it runs on every call (in no conditional's branch)."""
        return "conditional" not in self.where


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One send or recv handed to a host-transfer handler: between TPU slices, the
    data-center network (`xla_megascale_runtime`)."""

    kind: str  # "send" or "recv"
    nbytes: int
    handler: str
    operation: str  # what the handler does with it, e.g. "ALL_REDUCE"
    where: tuple[str, ...]

    @property
    def every_step(self) -> bool:
        return "conditional" not in self.where


@dataclasses.dataclass(frozen=True)
class Program:
    """What a compiled TPU program does (see `read`).

    Attributes:
      collectives: every collective, in program order.
      transfers: every send and recv to another slice, in program order.
      every_step_bytes: the HBM bytes read and written by the ops that run on every
        call (each op's result plus its operands; ops inside a conditional's branch or
        a loop's body are left out).
      every_step_ops: those ops, with the bytes each reads and writes.
      conditionals: the conditionals that run on every call.
      loops: the while loops that run on every call.
      temp_bytes: the program's temporaries (`memory_analysis().temp_size_in_bytes`),
        or -1 when it was read from text alone.
    """

    collectives: tuple[Collective, ...]
    transfers: tuple[Transfer, ...]
    every_step_bytes: int
    every_step_ops: tuple[tuple[Op, int], ...]
    conditionals: int
    loops: int
    temp_bytes: int

    def held(self, min_bytes: int = 0) -> list[Collective]:
        """The collectives that run on every call, of at least `min_bytes` each."""
        return [c for c in self.collectives if c.every_step and c.nbytes >= min_bytes]

    def released(self) -> list[Collective]:
        """The collectives inside a conditional's branch (a release, or a sync)."""
        return [c for c in self.collectives if not c.every_step]


def array_bytes(type_text: str, *, hbm_only: bool = False) -> int:
    """Bytes of every array in an HLO type (a tuple's too). With `hbm_only`, arrays
    laid out in another memory space than HBM (`S(n)` in their layout: the TPU's
    vector or scalar memory) are left out."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        if hbm_only and re.search(r"S\([1-9]\d*\)", layout or ""):
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _ITEMSIZE.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """A result type (an array, or a tuple in parentheses) and what follows it."""
    if not rest.startswith("("):
        array = re.match(r"[\w]+\[[^\]]*\](\{[^}]*\})?", rest)
        if array is None:
            return "", rest
        return array.group(0), rest[array.end() :]
    depth = 0
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def _arguments(text: str) -> tuple[str, str]:
    """The text from just after an opcode's parenthesis up to its closing one, and the
    attributes after it."""
    depth = 1
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[:i], text[i + 1 :]
    return text, ""


def instruction(line: str) -> Op | None:
    """The instruction on a line of HLO text, or None."""
    assign = _ASSIGN.match(line)
    if assign is None:
        return None
    result, rest = _split_type(line[assign.end() :])
    opcode = _OPCODE.match(rest)
    if not result or opcode is None:
        return None
    arguments, attributes = _arguments(rest[opcode.end() :])
    operands = tuple(re.findall(r"%([\w.\-]+)", arguments))
    return Op(assign["name"], opcode["opcode"], result, operands, arguments, attributes)


def computations(hlo: str) -> tuple[str, dict[str, list[Op]]]:
    """The name of the ENTRY computation, and each computation's instructions."""
    comps: dict[str, list[Op]] = {}
    entry = current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header["name"]
            comps[current] = []
            entry = current if header["entry"] else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            op = instruction(line)
            if op is not None:
                comps[current].append(op)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, comps


def _names(group: str) -> list[str]:
    return re.findall(r"[\w.\-]+", group)


def _called(op: Op) -> list[str]:
    """Computations an op runs whenever it runs (fusions, calls, reductions)."""
    return [n for group in _CALLED.findall(op.attributes) for n in _names(group)]


def _gated(op: Op) -> tuple[str, list[str]]:
    """("conditional", its branches), ("while", [its body]), or ("", [])."""
    branches = _BRANCHES.search(op.attributes)
    if op.opcode == "conditional" and branches:
        if branches["list"] is not None:
            return "conditional", _names(branches["list"])
        return "conditional", [branches["true"], branches["false"]]
    body = _BODY.search(op.attributes)
    if op.opcode == "while" and body:
        condition = _CONDITION.search(op.attributes)
        return "while", [body["body"], *([condition["condition"]] if condition else [])]
    return "", []


def _walk(
    comps: dict[str, list[Op]], name: str, where: tuple[str, ...], seen: frozenset = frozenset()
) -> Iterator[tuple[Op, tuple[str, ...], str]]:
    """Every op reachable from computation `name`: (op, control around it, the
    computation it is in), fusions' insides included."""
    if name in seen:
        return
    seen = seen | {name}
    for op in comps.get(name, []):
        yield op, where, name
        for callee in _called(op):
            yield from _walk(comps, callee, where, seen)
        kind, regions = _gated(op)
        for region in regions:
            yield from _walk(comps, region, (*where, kind), seen)


def _listed_groups(attributes: str) -> tuple | None:
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if listed is None:
        return None
    groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
    return tuple(tuple(int(i) for i in g.split(",") if i) for g in groups)


def _iota_groups(attributes: str) -> tuple | None:
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if iota is None:
        return None
    shape = [int(d) for d in iota.group(1).split(",")]
    dims = [int(d) for d in iota.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(3):
        ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))


def _named_groups(attributes: str) -> tuple | None:
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if named is None:
        return None
    axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    grouped = re.findall(r"'(\w+)'", named.group(2))
    order = [a for a in names if a not in grouped] + grouped
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose([names.index(a) for a in order])
    size = int(np.prod([sizes[names.index(a)] for a in grouped]))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))


def _pairs(attributes: str) -> tuple | None:
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    if pairs is None:
        return None
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))


def replica_groups(attributes: str) -> tuple[tuple[int, ...], ...]:
    """A collective's replica groups, written as a list (`{{0,1},{2,3}}`), as an iota
    (`[2,2]<=[4]`, `[2,2]<=[2,2]T(1,0)`) or over named mesh axes
    (`mesh['x'=2,'y'=2] {'y'}`: devices numbered in the mesh's order, grouped along the
    named axes); for a permute, its source-target pairs; () where none are written."""
    for form in (_listed_groups, _iota_groups, _named_groups, _pairs):
        groups = form(attributes)
        if groups is not None:
            return groups
    return ()


def _collective(op: Op, where: tuple[str, ...], ops: dict[str, Op]) -> Collective | None:
    """The collective `op` is, if any: an async pair is read from its done (whose
    result is the collective's), its replica groups from its start (`ops` by name)."""
    base = op.opcode.removesuffix("-start").removesuffix("-done")
    if base not in COLLECTIVES or op.opcode.endswith("-start"):
        return None
    attributes = op.attributes
    if op.opcode.endswith("-done") and op.operands and op.operands[0] in ops:
        attributes = ops[op.operands[0]].attributes
    return Collective(base, array_bytes(op.result), replica_groups(attributes), where)


def _transfer(op: Op, where: tuple[str, ...]) -> Transfer | None:
    if op.opcode not in ("send", "recv") or "is_host_transfer=true" not in op.attributes:
        return None
    handler = re.search(r'_xla_host_transfer_handler_name="([^"]*)"', op.attributes)
    operation = re.search(r'_xla_megascale_transfer_type="([^"]*)"', op.attributes)
    # A send's and a recv's result is a tuple: (the data, a context, a token).
    data = _ARRAY.search(op.result)
    return Transfer(
        op.opcode,
        array_bytes(data.group(0) if data else ""),
        handler.group(1) if handler else "",
        operation.group(1) if operation else "",
        where,
    )


def _partial_reads(fused: list[Op]) -> dict[int, int]:
    """For a fusion's computation: the parameters it reads only in part (number ->
    bytes read): what a gather or slice takes of them, 0 for the buffer a scatter or
    dynamic-update-slice updates in place."""
    params = {op.name: int(op.arguments) for op in fused if op.opcode == "parameter"}
    uses: dict[str, list[tuple[Op, int]]] = {name: [] for name in params}
    for op in fused:
        for position, operand in enumerate(op.operands):
            if operand in uses:
                uses[operand].append((op, position))
    partial = {}
    for name, used in uses.items():
        if not used or any(position for _, position in used):
            continue
        if all(op.opcode in _READS_PART for op, _ in used):
            partial[params[name]] = sum(array_bytes(op.result) for op, _ in used)
        elif all(op.opcode in _WRITES_PART for op, _ in used):
            partial[params[name]] = 0
    return partial


def _root_writes(fused: list[Op]) -> int | None:
    """The bytes a fusion's root writes when it updates a buffer in place (a scatter's
    or a dynamic-update-slice's updates), else None. The root is printed last."""
    root = fused[-1] if fused else None
    if root is None or root.opcode not in _WRITES_PART:
        return None
    by_name = {op.name: op for op in fused}
    updates = root.operands[2:] if root.opcode == "scatter" else root.operands[1:2]
    return sum(array_bytes(by_name[u].result) for u in updates if u in by_name)


def _fused_ops(comps: dict[str, list[Op]], fusion: Op) -> list[Op]:
    called = _called(fusion)
    return comps.get(called[0], []) if called else []


def _moved(result: str) -> int:
    """Bytes an async copy or slice moves: the smallest array of its start's result
    (the source, the destination and a u32 context; a slice's destination is the
    part it takes)."""
    sizes = [
        array_bytes(m.group(0))
        for m in _ARRAY.finditer(result)
        if not (m.group(1) == "u32" and not m.group(2))
    ]
    return min(sizes, default=0)


def _op_bytes(op: Op, types: dict[str, str], comps: dict[str, list[Op]]) -> int:
    """HBM bytes an op reads and writes: its result plus its operands (looked up by
    name), where an op that indexes a buffer counts only the part it indexes. An async
    copy (between HBM and the TPU's vector memory) counts once, at its start."""
    if op.opcode in _ASYNC_MOVES:
        return _moved(op.result)
    if op.opcode in _ASYNC_MOVED:
        return 0
    if op.opcode.endswith("-done"):  # an async pair: the start reads, the done writes
        return array_bytes(op.result, hbm_only=True)
    reads = [array_bytes(types.get(o, ""), hbm_only=True) for o in op.operands]
    written = 0 if op.opcode.endswith("-start") else array_bytes(op.result, hbm_only=True)
    if op.opcode in _READS_PART and reads:
        reads[0] = array_bytes(op.result, hbm_only=True)
    elif op.opcode in _WRITES_PART and reads:
        updates = reads[2:] if op.opcode == "scatter" else reads[1:2]
        reads[0], written = 0, sum(updates)
    elif op.opcode == "fusion":
        fused = _fused_ops(comps, op)
        root_writes = _root_writes(fused)
        for number, nbytes in _partial_reads(fused).items():
            if 0 <= number < len(reads):
                reads[number] = min(reads[number], nbytes)
        if root_writes is not None:
            written = min(written, root_writes)
    return sum(reads) + written


def read_text(hlo: str, temp_bytes: int = -1) -> Program:
    """A `Program` from a compiled module's HLO text (`compiled.as_text()`)."""
    entry, comps = computations(hlo)
    collectives, transfers = [], []
    conditionals = loops = 0
    by_name = {name: {op.name: op for op in ops} for name, ops in comps.items()}
    for op, where, name in _walk(comps, entry, ()):
        found = _collective(op, where, by_name[name])
        if found:
            collectives.append(found)
        moved = _transfer(op, where)
        if moved:
            transfers.append(moved)
        if not where:
            conditionals += op.opcode == "conditional"
            loops += op.opcode == "while"
    every_step = []
    # The ops on every call: ENTRY's, and those of what it calls unconditionally other
    # than a fusion's inside (the fusion itself reads and writes for them).
    todo, seen = [entry], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        types = {op.name: op.result for op in comps.get(name, [])}
        for op in comps.get(name, []):
            if op.opcode == "call":
                todo += _called(op)
            if op.opcode in _NO_TRAFFIC:
                continue
            every_step.append((op, _op_bytes(op, types, comps)))
    return Program(
        collectives=tuple(collectives),
        transfers=tuple(transfers),
        every_step_bytes=sum(n for _, n in every_step),
        every_step_ops=tuple(every_step),
        conditionals=conditionals,
        loops=loops,
        temp_bytes=temp_bytes,
    )


def read(compiled: Any) -> Program:
    """A `Program` from a compiled step (`jax.jit(f).lower(...).compile()`)."""
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes) if memory is not None else -1
    return read_text(compiled.as_text(), temp)
