"""Does Streaming DiLoCo's sync overlap the step's compute on TPU? Read from the program
the TPU compiler makes of a whole train step (deviceless, `optax_accum.demo.tpu`).

The step: each worker (a chip, under `jax.shard_map`) runs the forward and backward
passes of a stack of tanh layers on its batch, then `agn` with one fragment per layer
and a fragment on every step (`communication_period == fragments`). With `delay` >= 1
the fragment's pseudo-gradient is known when the step starts, so its reduction depends
on nothing the forward and backward passes compute. What the compiler does with it
depends on the options (`compiler_options`, the same flags pod users pass in
`LIBTPU_INIT_ARGS`) and on the network the reduction crosses:

- one v5e slice (the workers' all-reduce over ICI), default options: synchronous;
- the same with the async collective options MaxText's pod configs pass
  (`ASYNC_COLLECTIVE_FUSION`): still synchronous;
- those and `--xla_enable_async_all_reduce=true` (`ASYNC_ALL_REDUCE`): an async
  collective fusion: a start, steps fused into the compute fusions that follow, a
  done; the scheduler overlaps as much compute as its cost model says the transfer
  takes, counted back from the reduction's first reader;
- two v5e slices (the workers one per chip, the reduction crossing the data-center
  network between the slices: send/recv to `xla_megascale_runtime`), default options:
  the transfer is asynchronous by itself.

`overlap(program)` reads the program's ENTRY computation in order: each fusion that
holds a dot ("f" forward, "b" backward: a transposed dot), and where the reduction
starts and completes. Run: `python -m benchmarks.agn_tpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import tpu

# The async collective options of MaxText's pod configs (and the measurement).
ASYNC_COLLECTIVE_FUSION = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
}
# ... and the one that makes the all-reduce itself asynchronous.
ASYNC_ALL_REDUCE = {**ASYNC_COLLECTIVE_FUSION, "xla_enable_async_all_reduce": "true"}
OPTIONS = {
    "default": {},
    "async fusion": ASYNC_COLLECTIVE_FUSION,
    "+ async all-reduce": ASYNC_ALL_REDUCE,
}

_TRANSFERS = ("send", "recv", "send-done", "recv-done")
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|all-to-all|reduce-scatter)(-start|-done)?$")


@dataclasses.dataclass(frozen=True)
class Model:
    """The toy model: `layers` tanh layers of `width` x `width`, `batch` rows a worker."""

    width: int = 256
    batch: int = 64
    layers: int = 2


def _loss(weights: list, x: jax.Array) -> jax.Array:
    h = x
    for w in weights:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


@functools.cache
def program(
    *,
    slices: int = 1,
    delay: int = 2,
    period: int | None = None,
    options: str = "default",
    model: Model = Model(),
    communication_dtype: Any = None,
) -> str:
    """The TPU program of one train step (compiled for `slices` v5e 2x2 slices, one
    worker a chip), as text. `period` defaults to the number of layers (a fragment
    every step)."""
    mesh = tpu.mesh(tpu.TOPOLOGIES["v5e"], ("w",), explicit=False, num_slices=slices)
    n, layers = mesh.devices.size, model.layers
    tx = optax_accum.agn(
        optax.sgd(0.1),
        period or layers,
        axis_name="w",
        commit="delta",
        outer=optax.sgd(0.7 * (period or layers), momentum=0.9, nesterov=True),
        fragments=layers,
        delay=delay,
        communication_dtype=communication_dtype,
    )
    square = jax.ShapeDtypeStruct((n, model.width, model.width), jnp.float32)
    stacked = [square] * layers
    state = jax.eval_shape(jax.vmap(tx.init), stacked)

    def step(weights: list, state: Any, x: jax.Array) -> tuple:
        weights, state, x = jax.tree.map(lambda a: a[0], (weights, state, x))
        grads = jax.grad(_loss)(weights, x)
        updates, state = tx.update(grads, state, weights)
        return jax.tree.map(lambda a: a[None], (optax.apply_updates(weights, updates), state))

    rows = P("w")
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(rows, rows, rows), out_specs=(rows, rows))
    batch = jax.ShapeDtypeStruct((n, model.batch, model.width), jnp.float32)
    args = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, rows)),
        (stacked, state, batch),
    )
    lowered = jax.jit(mapped, donate_argnums=(0, 1)).lower(*args)
    return lowered.compile(compiler_options=OPTIONS[options]).as_text()


@dataclasses.dataclass(frozen=True)
class Overlap:
    """The ENTRY computation of a step, in order, one letter per op that computes a dot
    or moves data: "f" a fusion holding a forward dot, "b" a backward (transposed) dot,
    "R" a synchronous collective, "C" a conditional whose branch holds a collective
    (it runs to completion inside the branch), "<" the start of an asynchronous one (an
    async collective's start, a send or recv to another slice) and ">" its done. A dot
    fused with a step of an async collective sits between its "<" and ">"."""

    sequence: str

    @property
    def overlapped(self) -> str:
        """The dot fusions that run while an asynchronous reduction is in flight: those
        between the first start and the last done."""
        start, done = self.sequence.find("<"), self.sequence.rfind(">")
        return "".join(c for c in self.sequence[start:done] if c in "fb") if start >= 0 else ""


_CALLS = re.compile(
    r"\b(?:calls|to_apply|branch_computations|true_computation|false_computation|body|condition)"
    r"=(\{[^}]*\}|%[\w.\-]+)"
)


def _callees(op: Any) -> set[str]:
    return {c for group in _CALLS.findall(op.attributes) for c in re.findall(r"%([\w.\-]+)", group)}


def _inside(comps: dict, op: Any, seen: frozenset = frozenset()) -> tuple[str, bool]:
    """The dots ("f"/"b") `op` computes, its called computations included, and whether
    it holds a collective or a transfer to another slice."""
    dots, moves = "", bool(_COLLECTIVE.match(op.opcode)) or op.opcode in _TRANSFERS
    if op.opcode in ("dot", "convolution"):
        dots = "b" if re.search(r'op_name="[^"]*transpose\(', op.attributes) else "f"
    for callee in _callees(op) - seen:
        for inner in comps.get(callee, []):
            d, m = _inside(comps, inner, seen | {callee})
            dots, moves = dots + d, moves or m
    return dots, moves


def _letter(op: Any, dots: str, moves: bool) -> str:
    if not moves:
        return dots
    if op.opcode == "conditional":
        return "C"
    if op.opcode in ("send", "recv") or op.opcode.endswith("-start"):
        return "<"
    if op.opcode in ("send-done", "recv-done") or op.opcode.endswith("-done"):
        return ">"
    if op.name.startswith("async-collective-start"):
        return "<" + dots
    if op.name.startswith("async-collective-done"):
        return dots + ">"
    if op.opcode == "fusion" and dots:  # a step of an async collective, fused with compute
        return dots
    return "R" + dots


def overlap(text: str) -> Overlap:
    """The order of a step's dot fusions and its reduction (see `Overlap`)."""
    entry, comps = tpu.computations(text)
    return Overlap("".join(_letter(op, *_inside(comps, op)) for op in comps[entry]))


BIG = Model(width=1024, batch=256, layers=5)
# (what, program's arguments): the report's rows.
CASES = (
    ("1 slice, default options, delay 2", {}),
    ("1 slice, async collective fusion options, delay 2", {"options": "async fusion"}),
    ("1 slice, + async all-reduce, delay 1", {"delay": 1, "options": "+ async all-reduce"}),
    ("1 slice, + async all-reduce, delay 2", {"options": "+ async all-reduce"}),
    ("2 slices, default options, delay 1", {"slices": 2, "delay": 1}),
    ("2 slices, default options, delay 2", {"slices": 2}),
    ("2 slices, a sync every other step (in a branch)", {"slices": 2, "period": 4}),
    ("2 slices, int8 on the wire, delay 2", {"slices": 2, "communication_dtype": "int8"}),
    ("5 layers of 1024, 1 slice, + async all-reduce, delay 1",
     {"delay": 1, "options": "+ async all-reduce", "model": BIG}),
    ("5 layers of 1024, 1 slice, + async all-reduce, delay 2",
     {"options": "+ async all-reduce", "model": BIG}),
    ("5 layers of 1024, 2 slices, default options, delay 2", {"slices": 2, "model": BIG}),
)  # fmt: skip


def measure(quick: bool = False) -> list[dict]:
    """Each case's ENTRY sequence and the dot fusions the reduction overlaps (`quick`:
    the two-layer model only)."""
    rows = []
    for what, kwargs in CASES:
        if quick and "model" in kwargs:
            continue
        found = overlap(program(**kwargs))
        dots = "".join(c for c in found.sequence if c in "fb")
        rows.append(
            {
                "case": what,
                "sequence": found.sequence,
                "overlapped": found.overlapped,
                "dot_fusions": len(dots),
            }
        )
    return rows


def main() -> None:
    print(__doc__.split("\n\n")[0], "\n")
    print("f/b: a forward/backward dot fusion; R: a synchronous collective; C: a conditional")
    print("holding one; < >: an asynchronous one's start and done.\n")
    for row in measure():
        share = f"{len(row['overlapped'])}/{row['dot_fusions']}"
        print(f"  {row['case']:55s} {row['sequence']:24s} overlapped {share}")


if __name__ == "__main__":
    main()
