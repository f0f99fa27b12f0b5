"""What a TPU pod runs: train steps compiled for TPU topologies, on this machine.

No TPU is needed: `optax_accum.demo.tpu` describes a TPU slice (or two) with
`jax.experimental.topologies`, and the TPU compiler itself compiles each step for a
mesh of its devices from `jax.ShapeDtypeStruct`s (nothing is allocated, nothing
runs). For each topology, each transform and each way users write the step
(canonical, `apply_gradients`, Flax linen `TrainState`, NNX), beside `optax.MultiSteps`
in the same step, it reads from the compiled program:

- temporaries (`memory_analysis()`);
- the HBM bytes that the ops on every step read and write, over the floor `acc + g`
  (3 params-sized trees: read the sum and the gradient, write the sum);
- the collectives of a held step and of a release, and on two slices the transfers
  between them (send/recv handed to `xla_megascale_runtime`).

Layouts (8 float32 leaves, Adam inside, 8 gradients per window):

- `data`: a data-parallel mesh of one slice's 4 chips, params typed reduced over it
  (`optax_accum.as_reduced`), the step given unreduced gradients (what `jax.grad` gives
  for such params, before any all-reduce); MultiSteps gets plain params and the
  gradients `jax.grad` all-reduces on every step. `replicated` is the same mesh with
  plain params and gradients given: the optimizer step alone.
- `two_slices`: two slices, a `(slice, data)` mesh whose rows are the slices, a
  two-layer model's params FSDP-sharded over `data` and typed reduced over `slice`,
  the whole train step (`optax_accum.unreduced_grad` over `slice`): the sum across
  slices is deferred to the release. MultiSteps: plain params, `jax.grad`.
- `agn`: local SGD under `jax.shard_map`, each of the 4 chips its own params.

`tests/test_tpu_compiled.py` checks these same programs against the issue's
figures; this module is where they are built. Run from the repository root:
`python -m benchmarks --only tpu_compiled --out DIR` (the one-command report), or
`python -m benchmarks.tpu_compiled` for the tables alone.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import tpu

LEAVES = 8
EVERY = 8  # gradients per window
SIZES = {"64K": (128, 64), "268M": (4096, 8192)}  # one leaf; 8 leaves
FORMS = ("canonical", "apply_gradients", "TrainState", "NNX")
TRANSFORMS = ("conditional_accumulator", "sparse_conditional_accumulator", "drop_stale", "nest")
# The two-layer model of `two_slices`: x @ w + b -> tanh -> @ v.
MODEL = {"w": (256, 512), "b": (512,), "v": (512, 128)}
BATCH = 64


def _lenient(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` traced under standard dtype promotion: optax's Adam computes
    `decay ** count` (float ** int32), which strict promotion (the tests') rejects."""
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"):
            return inner.init(params)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _adam() -> optax.GradientTransformationExtraArgs:
    return _lenient(optax.adam(1e-3))


def transform(name: str) -> optax.GradientTransformation:
    """The transform `name`, releasing Adam once every `EVERY` gradients (agn: syncing
    once every `EVERY` steps over the axis "data")."""
    if name == "conditional_accumulator":
        return optax_accum.conditional_accumulator(_adam(), EVERY)
    if name == "summing_accumulator":  # conditional_accumulator releasing the sum
        return optax_accum.conditional_accumulator(_adam(), EVERY, reduction="sum")
    if name == "sparse_conditional_accumulator":  # dense leaves (the layouts' params)
        return optax_accum.sparse_conditional_accumulator(
            _adam(), EVERY, capacity=8, sparse=lambda p: jax.tree.map(lambda _: False, p)
        )
    if name == "drop_stale":
        return optax_accum.drop_stale_gradients(
            optax_accum.conditional_accumulator(_adam(), EVERY), 1
        )
    if name == "nest":
        inner = optax_accum.conditional_accumulator(_adam(), 2)
        return optax_accum.conditional_accumulator(inner, EVERY // 2)
    if name == "agn":
        return optax_accum.agn(_adam(), EVERY, axis_name="data")
    if name == "MultiSteps":
        return optax.MultiSteps(_adam(), EVERY)
    raise ValueError(f"unknown transform {name!r}")


# --------------------------------------------------------------------------- step forms


def _canonical(tx: Any, params: Any, state: Any, grads: Any, apply: Callable) -> tuple:
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state


def _apply_gradients(tx: Any, params: Any, state: Any, grads: Any, apply: Callable) -> tuple:
    if isinstance(tx, optax.MultiSteps):  # MultiSteps' own step is the canonical one
        return _canonical(tx, params, state, grads, apply)
    return optax_accum.apply_gradients(tx, grads, state, params)


def _train_state(tx: Any, params: Any, state: Any, grads: Any, apply: Callable) -> tuple:
    """Flax linen: `optax_accum.TrainState` (Flax's own for MultiSteps), rebuilt around
    the step's arrays."""
    from flax.training import train_state

    cls = train_state.TrainState if isinstance(tx, optax.MultiSteps) else optax_accum.TrainState
    ts = cls(step=jnp.zeros((), jnp.int32), apply_fn=None, params=params, tx=tx, opt_state=state)
    ts = ts.apply_gradients(grads=grads)
    return ts.params, ts.opt_state


def _nnx(tx: Any, params: Any, state: Any, grads: Any, apply: Callable) -> tuple:
    """NNX: `optax_accum.NNXOptimizer` (`nnx.Optimizer` for MultiSteps) on a model
    holding the params, its state replaced by the step's input, as `nnx.merge` of a
    split optimizer gives."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, tree: dict) -> None:
            for name, value in tree.items():
                setattr(self, name, nnx.Param(value))

    model = Model(params)
    cls = nnx.Optimizer if isinstance(tx, optax.MultiSteps) else optax_accum.NNXOptimizer
    optimizer = cls(model, tx, wrt=nnx.Param)
    nnx.update(optimizer.opt_state, nnx.state(state))
    optimizer.update(model, Model(grads))
    new_state = jax.tree.leaves(nnx.as_pure(optimizer.opt_state))
    new_params = {name: getattr(model, name)[...] for name in params}
    return new_params, jax.tree.structure(state).unflatten(new_state)


STEPS = {
    "canonical": _canonical,
    "apply_gradients": _apply_gradients,
    "TrainState": _train_state,
    "NNX": _nnx,
}


# --------------------------------------------------------------------------- layouts


def devices(topology: str, num_slices: int = 1) -> int:
    """How many devices `num_slices` slices of `topology` have (v4 and v5p: a device
    per TensorCore, two a chip)."""
    return len(tpu.topology(tpu.TOPOLOGIES[topology], num_slices).devices)


def _struct(shape: tuple, mesh: Any, spec: P, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def leaves(size: str, mesh: Any, spec: P, count: int = LEAVES) -> dict:
    """`count` float32 leaves of the size's shape, each laid out as `spec`."""
    return {f"layer{i}": _struct(SIZES[size], mesh, spec) for i in range(count)}


def _promotion(name: str) -> Any:
    # MultiSteps mixes int32 and float32 in its own code.
    return (
        jax.numpy_dtype_promotion("standard") if name == "MultiSteps" else contextlib.nullcontext()
    )


def _compile(
    fn: Callable, mesh: Any, args: tuple, donate: tuple, name: str, scheduler: str | None = None
) -> tpu.Program:
    """`fn` compiled for `mesh`'s TPU devices and read; `scheduler`: the TPU compiler's
    memory scheduler (its `xla_memory_scheduler` option, e.g. "dfs"; None: its default)."""
    options = {} if scheduler is None else {"xla_memory_scheduler": scheduler}
    with jax.set_mesh(mesh), _promotion(name):
        compiled = jax.jit(fn, donate_argnums=donate, compiler_options=options)
        compiled = compiled.lower(*args).compile()
    return tpu.read(compiled)


@functools.cache
def optimizer_step(
    name: str,
    form: str,
    topology: str,
    size: str,
    reduced: bool,
    count: int = LEAVES,
    scheduler: str | None = None,
) -> tpu.Program:
    """The step of `form` for transform `name`, gradients given, on one slice of
    `topology` (4 chips, a data-parallel mesh). With `reduced`, params typed reduced
    over the data axis and gradients unreduced (the `data` layout; MultiSteps gets
    plain params and all-reduces the gradients itself, as `jax.grad` does for plain
    params); otherwise both plain and replicated (`replicated`). `count` leaves of the
    size's shape (the tests read the collectives of programs of 2 small leaves, which
    compile in half the time). `scheduler`: the TPU memory scheduler (`_compile`)."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("data",))
    tx = transform(name)
    ours = name != "MultiSteps"
    params = leaves(size, mesh, P(None, None, reduced={"data"}) if reduced and ours else P(), count)
    grads = leaves(size, mesh, P(None, None, unreduced={"data"}) if reduced else P(), count)
    with jax.set_mesh(mesh), _promotion(name):
        state = jax.eval_shape(tx.init, params)

    def step(params: Any, state: Any, grads: Any) -> tuple:
        if reduced and not ours:  # the all-reduce `jax.grad` runs for plain params
            grads = jax.tree.map(lambda g: jax.reshard(g, P()), grads)
        return STEPS[form](tx, params, state, grads, optax.apply_updates)

    return _compile(step, mesh, (params, state, grads), (0, 1), name, scheduler)


def floor(topology: str, size: str) -> tpu.Program:
    """`acc + g` into the donated sum: the least a step that accumulates can do."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("data",))
    trees = (leaves(size, mesh, P()), leaves(size, mesh, P()))
    return _compile(lambda acc, g: jax.tree.map(jnp.add, acc, g), mesh, trees, (0,), "floor")


def tree_bytes(size: str, count: int = LEAVES) -> int:
    """Bytes of one params-sized tree."""
    rows, cols = SIZES[size]
    return count * rows * cols * 4


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean((h @ params["v"] - y) ** 2)


def model_shard_bytes() -> int:
    """Bytes of one device's shard of the model of `two_slices` (its matrices split 4
    ways over `data`, its bias whole)."""
    return sum(4 * int(np.prod(shape)) // (4 if len(shape) == 2 else 1) for shape in MODEL.values())


@functools.cache
def two_slices(name: str, form: str, topology: str = "v5e") -> tpu.Program:
    """The whole train step of `form` on two slices of `topology`: the model's matrices
    FSDP-sharded over `data`, the batch over both axes. Ours: params typed reduced over
    `slice`, gradients from `optax_accum.unreduced_grad` (summed within a slice only);
    MultiSteps: plain params and `jax.grad`."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("slice", "data"), num_slices=2)
    ours = name != "MultiSteps"
    red = {"slice"} if ours else set()
    params = {
        k: _struct(
            shape, mesh, P("data", None, reduced=red) if len(shape) == 2 else P(None, reduced=red)
        )
        for k, shape in MODEL.items()
    }
    x = _struct((BATCH, MODEL["w"][0]), mesh, P(("slice", "data")))
    y = _struct((BATCH, MODEL["v"][1]), mesh, P(("slice", "data")))
    tx = transform(name)
    grad_fn = optax_accum.unreduced_grad(_loss, "slice") if ours else jax.grad(_loss)
    with jax.set_mesh(mesh), _promotion(name):
        state = jax.eval_shape(tx.init, params)

    def step(params: dict, state: Any, x: jax.Array, y: jax.Array) -> tuple:
        return STEPS[form](tx, params, state, grad_fn(params, x, y), optax.apply_updates)

    return _compile(step, mesh, (params, state, x, y), (0, 1), name)


@functools.cache
def agn_step(form: str, topology: str = "v5e", num_slices: int = 1) -> tpu.Program:
    """`agn` under `jax.shard_map`: each chip steps its own params with its own
    gradients (given), and every `EVERY` steps the chips average (axis "data", every
    chip of every slice)."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("data",), explicit=False, num_slices=num_slices)
    n = mesh.devices.size
    tx = transform("agn")
    stacked = {
        k: jax.ShapeDtypeStruct((n, *SIZES["64K"]), jnp.float32) for k in ("layer0", "layer1")
    }
    state = jax.eval_shape(jax.vmap(tx.init), stacked)

    def body(params: dict, state: Any, grads: dict) -> tuple:
        one = functools.partial(jax.tree.map, lambda x: x[0])
        params, state = STEPS[form](tx, one(params), one(state), one(grads), optax.apply_updates)
        return jax.tree.map(lambda x: x[None], (params, state))

    spec = P("data")
    specs = (jax.tree.map(lambda _: spec, stacked), jax.tree.map(lambda _: spec, state), spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[:2])
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, spec), (stacked, state, stacked))
    args = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        (stacked, state, stacked),
        shardings,
    )
    return _compile(mapped, mesh, args, (0, 1), "agn")


@functools.cache
def sparse_step(rows: int, topology: str = "v5e", row_major: bool = True) -> tpu.Program:
    """`apply_gradients` of `sparse_conditional_accumulator` on a `rows` x 64 table
    (replicated on one slice) given 256 row ids a step, a 2,048-slot buffer.

    With `row_major`, the table's layout is pinned row-major, as a TPU user pins it
    (`jax.jit(..., in_shardings=Format(Layout(major_to_minor=(0, 1)), sharding))`): by
    default TPU lays a 64-wide float32 table out column-major, and every row scatter
    (optax_accum's `apply_updates` alone too, `table_scatter`) transposes it around."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("data",))
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(0.1), EVERY, capacity=2048
    )
    params = {"table": _struct((rows, 64), mesh, P())}
    ids = _struct((256,), mesh, P(), jnp.int32)
    values = _struct((256, 64), mesh, P())
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)

    def step(params: dict, state: Any, ids: jax.Array, values: jax.Array) -> tuple:
        grads = {"table": optax_accum.IndexedSlices(ids, values, (rows, 64))}
        return optax_accum.apply_gradients(tx, grads, state, params)

    args = (params, state, ids, values)
    if not row_major:
        return _compile(step, mesh, args, (0, 1), "sparse")
    table = {"table": _row_major(mesh)}
    with jax.set_mesh(mesh):
        jitted = jax.jit(
            step,
            donate_argnums=(0, 1),
            in_shardings=(table, None, None, None),
            out_shardings=(table, None),
        )
        return tpu.read(jitted.lower(*args).compile())


def _row_major(mesh: Any) -> Any:
    from jax.experimental.layout import Format, Layout  # the benchmarks' newest jax

    return Format(Layout(major_to_minor=(0, 1)), NamedSharding(mesh, P()))


@functools.cache
def table_scatter(rows: int, topology: str = "v5e") -> tpu.Program:
    """`optax_accum.apply_updates` of 256 rows into a `rows` x 64 table, alone (no
    accumulator), in TPU's default layout for the table."""
    mesh = tpu.mesh(tpu.TOPOLOGIES[topology], ("data",))
    table = _struct((rows, 64), mesh, P())
    ids = _struct((256,), mesh, P(), jnp.int32)
    values = _struct((256, 64), mesh, P())

    def scatter(table: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
        return optax_accum.apply_updates(table, optax_accum.IndexedSlices(ids, values, (rows, 64)))

    return _compile(scatter, mesh, (table, ids, values), (0,), "scatter")


# --------------------------------------------------------------------------- the report

# What the report compiles: (layout, transform, form) per topology. At 268M params: on
# every generation `conditional_accumulator` in each step form on the data-parallel
# mesh; on v5e also every transform in each form with params replicated (the
# optimizer step alone), the two-slice train steps and the sparse table at two sizes.
GENERATIONS = ("v5e", "v4", "v5p", "v6e")
_NOT_NNX = {"sparse_conditional_accumulator"}  # nnx.Optimizer cannot hold its state


def _cases(topology: str, quick: bool) -> list[tuple[str, str, str]]:
    if quick:
        return [
            ("data", "conditional_accumulator", "apply_gradients"),
            ("data", "MultiSteps", "canonical"),
        ]
    cases = [("data", "conditional_accumulator", form) for form in FORMS]
    if topology == "v5e":  # every transform on params `as_reduced`, and the sum
        for name in (*TRANSFORMS[1:], "summing_accumulator"):
            cases += [("data", name, f) for f in FORMS if not (name in _NOT_NNX and f == "NNX")]
    cases += [("data", "MultiSteps", form) for form in ("canonical", "NNX")]
    if topology == "v5e":
        for name in TRANSFORMS:
            cases += [
                ("replicated", name, f) for f in FORMS if not (name in _NOT_NNX and f == "NNX")
            ]
        cases += [("replicated", "MultiSteps", form) for form in ("canonical", "NNX")]
    return cases


def _figures(program: tpu.Program, base: tpu.Program, size: str) -> dict[str, Any]:
    tree = tree_bytes(size)
    held, released = program.held(), program.released()
    return {
        "temp_bytes": program.temp_bytes,
        "temp_vs_multisteps": program.temp_bytes / max(base.temp_bytes, 1),
        "bytes_vs_floor": program.every_step_bytes / (3 * tree),
        "held_collectives": len(held),
        "held_collective_bytes": sum(c.nbytes for c in held),
        "release_collectives": len(released),
        "release_collective_bytes": sum(c.nbytes for c in released),
        "conditionals": program.conditionals,
    }


def _slice_figures(program: tpu.Program) -> dict[str, Any]:
    sends = [t for t in program.transfers if t.kind == "send"]
    return {
        "held_sends": len([t for t in sends if t.every_step]),
        "held_send_bytes": sum(t.nbytes for t in sends if t.every_step),
        "release_sends": len([t for t in sends if not t.every_step]),
        "release_send_bytes": sum(t.nbytes for t in sends if not t.every_step),
        "temp_bytes": program.temp_bytes,
    }


def measure(quick: bool = False, progress: Any = None) -> dict[str, Any]:
    """Every figure of the report, by topology."""
    size = "64K" if quick else "268M"
    progress = progress or (lambda x, **_: x)
    results: dict[str, Any] = {"size": size, "topologies": {}}
    for topology in progress(("v5e",) if quick else GENERATIONS, desc="tpu_compiled"):
        per: dict[str, Any] = {}
        for layout, name, form in _cases(topology, quick):
            program = optimizer_step(name, form, topology, size, layout == "data")
            base_form = "NNX" if form == "NNX" else "canonical"
            base = optimizer_step("MultiSteps", base_form, topology, size, layout == "data")
            per[f"{layout} {name} {form}"] = _figures(program, base, size)
        results["topologies"][tpu.TOPOLOGIES[topology]] = per
    slices: dict[str, Any] = {}
    pairs = (
        [("conditional_accumulator", "canonical")]
        if quick
        else [(n, f) for n in TRANSFORMS for f in FORMS if not (n in _NOT_NNX and f == "NNX")]
    )
    for name, form in [*pairs, ("MultiSteps", "canonical")]:
        slices[f"{name} {form}"] = _slice_figures(two_slices(name, form))
    results["topologies"][f"{tpu.TOPOLOGIES['v5e']} x 2 slices"] = slices
    if not quick:
        results["sparse_table_every_step_bytes"] = {
            f"{rows:,} x 64": sparse_step(rows).every_step_bytes for rows in (1_000_000, 10_000_000)
        }
    return results


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB" if n else "0"


def tables(results: dict[str, Any]) -> str:
    """One markdown table per topology."""
    lines = [
        f"Compiled for TPU, not run: {results['size']} float32 params (8 leaves), Adam, "
        "8 gradients a window. Bytes over the floor: HBM bytes read and written by the ops "
        "on every step over `acc + g`'s (3 trees). Collectives: count (bytes a device) "
        "on every step and in the release's branch. `data`: params `as_reduced` over a "
        "data-parallel mesh of one slice, gradients given unreduced (MultiSteps: plain "
        "params, reducing them itself); `replicated`: plain params, gradients given.",
        "",
    ]
    for topology, per in results["topologies"].items():
        lines += [f"### {topology}", ""]
        if "slices" in topology:
            lines += [
                "Whole train step, FSDP over `data`, the sum across slices deferred "
                "(MultiSteps: `jax.grad` on plain params). Sends to the other slice "
                "(`xla_megascale_runtime`):",
                "",
                "| step | temporaries | sends on every step | sends in the release |",
                "|---|---|---|---|",
            ]
            for case, f in per.items():
                lines.append(
                    f"| {case} | {_mb(f['temp_bytes'])} | {f['held_sends']} "
                    f"({_mb(f['held_send_bytes'])}) | {f['release_sends']} "
                    f"({_mb(f['release_send_bytes'])}) |"
                )
            lines.append("")
            continue
        lines += [
            "| layout, step | temporaries (/ MultiSteps') | bytes over the floor "
            "| collectives every step | in the release | conditionals |",
            "|---|---|---|---|---|---|",
        ]
        for case, f in per.items():
            lines.append(
                f"| {case} | {_mb(f['temp_bytes'])} ({f['temp_vs_multisteps']:.3g}x) "
                f"| {f['bytes_vs_floor']:.3f} | {f['held_collectives']} "
                f"({_mb(f['held_collective_bytes'])}) | {f['release_collectives']} "
                f"({_mb(f['release_collective_bytes'])}) | {f['conditionals']} |"
            )
        lines.append("")
    if "sparse_table_every_step_bytes" in results:
        lines += [
            "Sparse accumulator, `apply_gradients`, held step's bytes (256 rows a step; the "
            "table's layout pinned row-major, as `sparse_step` says why):",
            "",
        ]
        for case, n in results["sparse_table_every_step_bytes"].items():
            lines.append(f"- {case} table: {_mb(n)}")
        lines.append("")
    return "\n".join(lines)


def report_rows(scale: Any) -> tuple[list, dict]:
    """The figures for `python -m benchmarks` (64K params, v5e only, with
    `scale.quick`); the tables per topology go to `tpu_compiled.md` beside the report.
    Without libtpu: no rows, and `details["skipped"]` says why."""
    import pathlib

    from benchmarks._report import Row

    reason = tpu.unavailable()
    if reason:  # no figure, and the report says why
        return [], {"skipped": reason}
    results = measure(scale.quick, scale.progress)
    rows = []
    for topology, per in results["topologies"].items():
        for case, f in per.items():
            if "MultiSteps" in case:
                continue
            label = f"{topology} {case}"
            if "slices" in topology:
                rows.append(
                    Row.checked(
                        "tpu_compiled", label, "bytes sent on every step", f["held_send_bytes"],
                        (0, "max"), unit="B",
                    )
                )  # fmt: skip
                continue
            limit = 2.1 if case.endswith("canonical") else 1.1
            rows += [
                Row.checked("tpu_compiled", label, "temporaries / MultiSteps'",
                            f["temp_vs_multisteps"], (1.0, "max")),
                Row.checked("tpu_compiled", label, "every-step bytes / floor",
                            f["bytes_vs_floor"], (limit, "max")),
                Row("tpu_compiled", label, "collective bytes on every step",
                    f["held_collective_bytes"], unit="B"),
            ]  # fmt: skip
    out = scale.options.get("out")
    if out is not None:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / "tpu_compiled.md").write_text(tables(results) + "\n")
    return rows, results


def main() -> int:
    reason = tpu.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    print(tables(measure("--quick" in sys.argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
