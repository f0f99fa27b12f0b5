"""One reduction per window under `jax.jit`: params typed reduced, sums unreduced.

Under explicit sharding, a param typed reduced over the batch's mesh axes
(`P(..., reduced=axes)`) gets gradients typed unreduced over them from `jax.grad`:
no all-reduce has run. Every accumulating transform keeps their running sum
unreduced, so a held step moves nothing across those axes, and the release reduces
the window's sum once, inside its branch. For each transform, step shape, layout and
model (`MATRIX` says which combinations, and why those), 8 steps (a release every 2
accepted gradients, stale gradients, weights) must:

- equal the same 8 steps on one device, in float64, to 1e-9 (the canonical step
  there, which every step shape must match: one reference run per transform);
- run no collective on every step beyond those the forward and backward pass run
  alone (none at all on a data-parallel mesh), and none across the reduced axes;
- reduce each leaf's shard once in the release: the release's all-reduces carry the
  bytes of one shard of every param, no more;
- keep the params' types (a donated step's outputs match its inputs) and the sums
  unreduced.

Layouts: `data` (8-way data parallel, replicated params), `fsdp` (a (data=2, fsdp=4)
mesh, params sharded over `fsdp`, batch over `data`), `two_level` (a (slice=2,
data=4) mesh, batch over both, params sharded FSDP-style over `data`: the slice axis
is crossed once a window).
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import lenient
from _hlo import collectives
from _matrix import pairwise
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

STEPS = 8
LAGS = (0, 0, 1, 0, 3, 0, 0, 2)  # how stale each step's gradient is
WEIGHTS = (1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 0.0, 2.0)

# name: (mesh shape, axis names, batch spec, param layout axis, reduced axes)
LAYOUTS = {
    "data": ((8,), ("data",), P("data"), None, frozenset({"data"})),
    "fsdp": ((2, 4), ("data", "fsdp"), P("data"), "fsdp", frozenset({"data"})),
    "two_level": ((2, 4), ("slice", "data"), P(("slice", "data")), "data", frozenset({"slice"})),
}


@pytest.fixture(autouse=True)
def _x64():
    with _compat.enable_x64():
        yield


def _adam():
    return lenient(optax.adam(0.05))


CASES = {
    "conditional_accumulator": lambda: optax_accum.conditional_accumulator(_adam(), 2),
    "sparse_accumulator_dense_leaves": lambda: optax_accum.sparse_conditional_accumulator(
        _adam(), 2, capacity=4, sparse=lambda p: jax.tree.map(lambda _: False, p)
    ),
    "drop_stale_accumulator": lambda: optax_accum.drop_stale_gradients(
        optax_accum.conditional_accumulator(_adam(), 2), 1
    ),
    "nested_accumulators": lambda: optax_accum.conditional_accumulator(
        optax_accum.conditional_accumulator(_adam(), 2), 1, reduction="sum"
    ),
    "skip_nonfinite": lambda: optax_accum.conditional_accumulator(_adam(), 2, skip_nonfinite=True),
}
NAN_AT = 5  # the step whose batch holds a NaN, for "skip_nonfinite"


# --------------------------------------------------------------------------- the model


def _gathered(w, layout: str | None):
    """A weight as the model uses it: whole, and typed reduced over the axes its
    gradient must stay unreduced over (FSDP's all-gather when it is sharded; the
    gathered copy is reduced over the sharded axis too, whose sum the backward pass
    scatters back to the shards within a slice)."""
    if layout is None:
        return w
    _, _, _, sharded, reduced = LAYOUTS[layout]
    axes = reduced | ({sharded} if sharded and layout == "two_level" else set())
    return jax.reshard(w, P(None, None, reduced=axes))


def _loss(params, batch, layout):
    """A two-layer MLP whose params meet the batch only inside dots (on jax 0.10 a
    reduced param may not meet a batch-sharded value elsewhere: see
    `optax_accum.unreduced_grad` for any model)."""
    x, y = batch
    h = jnp.tanh(x @ _gathered(params["w"], layout))
    return jnp.mean((h @ _gathered(params["v"], layout) - y) ** 2)


def _any_loss(params, batch):
    """A model with a bias and a layer norm, written for one device's whole params
    (`optax_accum.unreduced_grad` gathers them and differentiates each batch shard)."""
    x, y = batch
    h = x @ params["w"] + params["b"]
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * params["scale"] + params["offset"]
    return jnp.mean((jnp.tanh(h) @ params["v"] - y) ** 2)


def _grads(model: str, layout: str | None, params, batch):
    if model == "dots":
        return jax.grad(_loss)(params, batch, layout)
    if layout is None:
        return jax.grad(_any_loss)(params, batch)
    return optax_accum.unreduced_grad(_any_loss, LAYOUTS[layout][4])(params, batch)


def _params(model: str) -> dict:
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 8)) / 4, "v": rng.normal(size=(8, 4)) / 3}
    if model == "any":
        params.update(b=rng.normal(size=8), scale=1 + rng.normal(size=8) / 4, offset=np.zeros(8))
    return params


def _batches(case: str | None = None) -> list:
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(16, 16)), rng.normal(size=(16, 4))) for _ in range(STEPS)]
    if case == "skip_nonfinite":
        batches[NAN_AT][0][3, 2] = np.nan  # one example, on one device
    return batches


def _place_params(params: dict, layout: str | None) -> dict:
    """Each param on the layout's mesh (matrices sharded FSDP-style where the layout
    says), typed reduced over its batch axes (`optax_accum.as_reduced`)."""
    if layout is None:
        return jax.tree.map(jnp.asarray, params)
    _, _, _, sharded, reduced = LAYOUTS[layout]
    mesh = _mesh(layout)  # placed from the host: no eager reshard to compile
    placed = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(sharded if x.ndim == 2 else None))),
        params,
    )
    return optax_accum.as_reduced(placed, tuple(reduced))


def _place_batch(batch, layout: str | None):
    if layout is None:
        return tuple(jnp.asarray(x) for x in batch)
    sharding = NamedSharding(_mesh(layout), LAYOUTS[layout][2])
    return tuple(jax.device_put(x, sharding) for x in batch)


# --------------------------------------------------------------------------- the steps


def _extra(opt_state, lag, weight) -> dict:
    return {"local_step": optax_accum.global_step(opt_state) - lag, "weight": weight}


def _canonical(tx, model, layout, params, opt_state, batch, lag, weight):
    grads = _grads(model, layout, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **_extra(opt_state, lag, weight))
    return optax.apply_updates(params, updates), opt_state


def _apply_gradients(tx, model, layout, params, opt_state, batch, lag, weight):
    grads = _grads(model, layout, params, batch)
    extra = _extra(opt_state, lag, weight)
    return optax_accum.apply_gradients(tx, grads, opt_state, params, **extra)


def _train_state(tx, model, layout, params, opt_state, batch, lag, weight):
    """Flax linen's TrainState (optax_accum's), rebuilt around the step's arrays."""
    pytest.importorskip("flax")
    from optax_accum.flax_train_state import TrainState

    state = TrainState(step=0, apply_fn=None, params=params, tx=tx, opt_state=opt_state)
    grads = _grads(model, layout, params, batch)
    state = state.apply_gradients(grads=grads, **_extra(opt_state, lag, weight))
    return state.params, state.opt_state


PATTERNS = {
    "canonical": _canonical,
    "apply_gradients": _apply_gradients,
    "train_state": _train_state,
}


def _mesh(layout: str):
    shape, names, *_ = LAYOUTS[layout]
    return jax.make_mesh(shape, names)  # explicit axes: jax.make_mesh's default


def _train(case: str, pattern: str, layout: str | None, model: str = "dots"):
    """8 steps; returns the params, the state and the compiled step."""
    tx = CASES[case]()
    context = contextlib.nullcontext() if layout is None else jax.set_mesh(_mesh(layout))
    with context:
        params = _place_params(_params(model), layout)
        state = tx.init(params)
        step = jax.jit(
            functools.partial(PATTERNS[pattern], tx, model, layout), donate_argnums=(0, 1)
        )
        compiled = None
        for batch, lag, weight in zip(_batches(case), LAGS, WEIGHTS, strict=True):
            args = (params, state, _place_batch(batch, layout), jnp.int32(lag), jnp.float64(weight))
            compiled = compiled or step.lower(*args).compile()
            params, state = compiled(*args)
    return params, state, compiled


@functools.cache
def _one_device(case: str, model: str):
    """The reference: the canonical step on one device. `apply_gradients` and
    TrainState must give the same numbers (to the 1e-9 of the comparison), so every
    step shape compares with this one run."""
    with _compat.enable_x64():
        params, state, _ = _train(case, "canonical", None, model)
        return _meaning((params, state))


# --------------------------------------------------------------------------- checks


def _is_accumulator_state(node) -> bool:
    return hasattr(node, "_fields") and {"emitted", "storage"} <= set(node._fields)


def _meaning(tree):
    """`tree` as NumPy arrays: each unreduced sum reduced (read as its true value), and
    an accumulator a release spent read as zeros (its buffers then hold whatever the
    release left there, which differs between the forms)."""

    def visit(node):
        if _is_accumulator_state(node):
            node = node._replace(inner_state=_meaning(node.inner_state))
            spent = bool(np.asarray(node.emitted))
            read = jax.tree.map(_read, node.storage)
            return node._replace(
                storage=jax.tree.map(np.zeros_like, read) if spent else read,
                **{
                    f: _read(getattr(node, f))
                    for f in node._fields
                    if f not in ("storage", "inner_state")
                },
            )
        return _read(node)

    return jax.tree.map(visit, tree, is_leaf=_is_accumulator_state)


def _read(x):
    if isinstance(x, jax.Array) and _compat.sum_types(x)[1]:
        x = _compat.retyped(x, reduced=_compat.sum_types(x)[0])  # the all-reduce
    return np.asarray(x)


def _assert_close(got, want):
    got = _meaning(got)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


def _shard_bytes(params) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))


@functools.cache
def _grad_only_collectives(model: str, layout: str) -> tuple:
    """The collectives of the forward and backward pass alone (the gradients returned
    unreduced, as the model makes them): the same program for every transform and step
    shape, so compiled once per model and layout."""
    with _compat.enable_x64(), jax.set_mesh(_mesh(layout)):
        params = _place_params(_params(model), layout)
        batch = _place_batch(_batches()[0], layout)
        grads = jax.jit(functools.partial(_grads, model, layout))
        return tuple(collectives(grads.lower(params, batch).compile()))


def _groups(line: str) -> list[list[int]]:
    """The replica groups of a collective's HLO line, written as a list (`{{0,4},{1,5}}`,
    jax 0.10) or over named mesh axes (`mesh['slice'=2,'data'=4] {'data'}`, jax 0.11:
    the devices of the mesh numbered in order, grouped along the named axes)."""
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if listed:
        groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
        return [[int(i) for i in g.split(",") if i] for g in groups]
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    assert named, f"replica groups written in an unknown form: {line.strip()[:200]}"
    axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    grouped = re.findall(r"'(\w+)'", named.group(2))
    order = [a for a in names if a not in grouped] + grouped
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose([names.index(a) for a in order])
    return ids.reshape(-1, int(np.prod([sizes[names.index(a)] for a in grouped]))).tolist()


def _assert_one_reduction_per_window(model: str, layout: str, params, compiled):
    found = collectives(compiled)
    # Scalars may cross every step (skip_nonfinite's check: one per leaf at most).
    scalars = 8 * len(jax.tree.leaves(params))
    every = sorted((c.opcode, c.nbytes) for c in found if c.every_step and c.nbytes > scalars)
    alone = sorted((c.opcode, c.nbytes) for c in _grad_only_collectives(model, layout))
    assert every == alone, f"a held step moves more than forward and backward: {every} vs {alone}"
    if layout == "data":
        assert not every, f"a held step communicates: {every}"
    release = [c for c in found if not c.every_step]
    assert {c.opcode for c in release} == {"all-reduce"}, release
    assert sum(c.nbytes for c in release) == _shard_bytes(params), (release, _shard_bytes(params))
    assert len(release) <= len(jax.tree.leaves(params))
    # Exactly the release's all-reduces (and scalar ones) cross the reduced axes (for
    # two levels, the slices: device i of one slice with device i of the other).
    mesh = _mesh(layout)
    reduced = sorted(LAYOUTS[layout][4])
    kept = [a for a in mesh.axis_names if a not in reduced]
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    across = ids.transpose([mesh.axis_names.index(a) for a in (*kept, *reduced)])
    want = sorted(across.reshape(-1, int(np.prod([mesh.shape[a] for a in reduced]))).tolist())
    lines = compiled.as_text().splitlines()
    groups = [_groups(line) for line in lines if re.search(r"\ball-reduce(-start)?\(", line)]
    crossing = [
        c for c in found if c.opcode == "all-reduce" and not (c.every_step and c.nbytes > scalars)
    ]
    assert sum(sorted(map(sorted, g)) == want for g in groups) == len(crossing), (want, groups)


_CONSTRAINT = re.compile(r"(%[\w#]+) = sdy\.sharding_constraint (%[\w#]+) <([^>]*)>")
_CALL = re.compile(r"call @([\w.]+)\(([^)]*)\)")
_ARG = re.compile(r"(%arg\d+): tensor<[^>]*>\s*\{sdy\.sharding = #sdy\.sharding<([^>]*)>")


def _lowered_reductions(text: str) -> tuple[int, int]:
    """In a lowered (StableHLO) module under explicit sharding, where the unreduced
    values are reduced: `(outside, inside)`, the reshards of an unreduced value to a
    reduced one in `main` outside any `stablehlo.case`, and those inside a function
    called from within a `stablehlo.case` branch (the release). The partitioner turns
    each into an all-reduce where it stands."""
    funcs, name = {}, None
    for line in text.splitlines():
        header = re.match(r"\s*func\.func \w+ @([\w.]+)\(", line)
        if header:
            name = header.group(1)
            funcs[name] = [line]
        elif name is not None:
            funcs[name].append(line)
    unreduced = {a for a, sharding in _ARG.findall(funcs["main"][0]) if "unreduced" in sharding}
    outside, called, cases = 0, [], []
    for line in funcs["main"][1:]:
        indent = len(line) - len(line.lstrip())
        if cases and indent == cases[-1] and line.lstrip().startswith("})"):
            cases.pop()
        if '"stablehlo.case"' in line:
            cases.append(indent)
        constraint = _CONSTRAINT.search(line)
        if constraint:
            out, operand, sharding = constraint.groups()
            if "unreduced" in sharding:
                unreduced.add(out)
            elif operand in unreduced and not cases:
                outside += 1
        call = _CALL.search(line)
        if call and cases:
            operands = [o.strip() for o in call.group(2).split(",")]
            called.append(
                (call.group(1), {f"%arg{i}" for i, o in enumerate(operands) if o in unreduced})
            )
    inside = 0
    for callee, args in called:
        held = set(args)  # the unreduced values, through constraints that keep them so
        for line in funcs[callee][1:]:
            constraint = _CONSTRAINT.search(line)
            if constraint and constraint.group(2) in held:
                if "unreduced" in constraint.group(3):
                    held.add(constraint.group(1))  # jax 0.11 restates an argument's type
                else:
                    inside += 1
    return outside, inside


def _assert_types_kept(params, state, layout):
    """The params keep their reduced type; the outermost sums are unreduced (a nested
    accumulator sums the reduced, plain values its outer one releases)."""
    reduced = LAYOUTS[layout][4]
    for p in jax.tree.leaves(params):
        assert _compat.sum_types(p) == (reduced, frozenset()), jax.typeof(p)
    outer = next(
        x for x in jax.tree.leaves(state, is_leaf=_is_accumulator_state) if _is_accumulator_state(x)
    )
    shapes = {p.shape for p in jax.tree.leaves(params)}
    sums = [x for x in jax.tree.leaves(outer.storage) if x.shape in shapes]
    assert sums, outer.storage
    for x in sums:
        assert _compat.sum_types(x) == (frozenset(), reduced), jax.typeof(x)


# --------------------------------------------------------------------------- tests


# The rows. Each transform runs on the data-parallel mesh; conditional_accumulator (the
# anchor) in both step shapes there, each other transform in one of them (the step
# shape reaches the release through the same sink or the same `tx.update` for every
# transform; tests/test_shard_map_window.py runs the sparse accumulator, drop_stale and
# the nest in the other shape, under shard_map). The layouts and models run
# conditional_accumulator pairwise over step shape x layout x model (tests/_matrix.py),
# so every step shape meets every layout and every model, and every layout every
# model; TrainState (a wrapper of apply_gradients) runs once, on two levels.
MATRIX = (
    [
        ("conditional_accumulator", "apply_gradients", "data", "dots"),
        ("conditional_accumulator", "canonical", "data", "dots"),
        ("sparse_accumulator_dense_leaves", "apply_gradients", "data", "dots"),
        ("drop_stale_accumulator", "apply_gradients", "data", "dots"),
        ("nested_accumulators", "canonical", "data", "dots"),
        ("skip_nonfinite", "canonical", "data", "dots"),
    ]
    + [
        ("conditional_accumulator", pattern, layout, model)
        for pattern, layout, model in pairwise(
            ["apply_gradients", "canonical"], ["data", "fsdp", "two_level"], ["dots", "any"]
        )
        if (pattern, layout, model) != ("apply_gradients", "data", "dots")  # above
    ]
    + [("conditional_accumulator", "train_state", "two_level", "dots")]
)


@pytest.mark.parametrize(("case", "pattern", "layout", "model"), MATRIX)
def test_one_reduction_per_window_under_jit(case, pattern, layout, model):
    params, state, compiled = _train(case, pattern, layout, model)
    want_params, want_state = _one_device(case, model)
    _assert_close(params, want_params)
    _assert_close(state, want_state)
    _assert_types_kept(params, state, layout)
    _assert_one_reduction_per_window(model, layout, params, compiled)
    if case == "skip_nonfinite":
        assert int(state.num_nonfinite) == 1


@functools.cache
def _one_device_grads():
    """`jax.grad` of the "any" model on one device, on the first batch (jitted: one
    compile, where the eager gradient compiles each of its operations)."""
    with _compat.enable_x64():
        params, batch = _place_params(_params("any"), None), _place_batch(_batches()[0], None)
        return jax.tree.map(np.asarray, jax.jit(jax.grad(_any_loss))(params, batch))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_unreduced_grad_is_jax_grad_left_unreduced(layout):
    """Any model (a bias, a layer norm): the gradients' true values are those of
    `jax.grad` on one device; they come back unreduced over the batch axes, each with
    its param's layout, and nothing crosses those axes to make them."""
    params, batch = _params("any"), _batches()[0]
    want = _one_device_grads()
    with jax.set_mesh(_mesh(layout)):
        placed, placed_batch = _place_params(params, layout), _place_batch(batch, layout)
        grad_fn = jax.jit(optax_accum.unreduced_grad(_any_loss, tuple(LAYOUTS[layout][4])))
        compiled = grad_fn.lower(placed, placed_batch).compile()  # one compile, read and run
        grads = compiled(placed, placed_batch)
    reduced = LAYOUTS[layout][4]
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(placed), strict=True):
        assert _compat.sum_types(g) == (frozenset(), reduced), jax.typeof(g)
        assert g.sharding.spec.partitions == p.sharding.spec.partitions
    _assert_close(grads, jax.tree.map(np.asarray, want))
    found = collectives(compiled)
    assert (
        "all-reduce" not in {c.opcode for c in found if c.opcode != "all-gather"}
        or layout == "two_level"
    ), found
    if layout == "data":
        assert not found, found


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_tpu_lowering_reduces_inside_the_release_branch(pattern):
    """Lowered for TPU, the reshards that become the all-reduces stand inside the
    release's `case` branch, one per leaf, and none outside it."""
    tx = CASES["conditional_accumulator"]()
    with jax.set_mesh(_mesh("data")):
        params = _place_params(_params("dots"), "data")
        state = tx.init(params)
        batch = _place_batch(_batches()[0], "data")
        step = jax.jit(functools.partial(PATTERNS[pattern], tx, "dots", "data"))
        lowered = step.trace(params, state, batch, jnp.int32(0), jnp.float64(1.0)).lower(
            lowering_platforms=("tpu",)
        )
    outside, inside = _lowered_reductions(lowered.as_text())
    assert (outside, inside) == (0, len(jax.tree.leaves(params)))


def test_a_skip_rule_that_reads_unreduced_gradients_says_what_to_do():
    tx = optax_accum.conditional_accumulator(
        _adam(), 2, should_skip_update_fn=optax.skip_not_finite
    )
    with jax.set_mesh(_mesh("data")):
        params = _place_params(_params("dots"), "data")
        state = tx.init(params)
        batch = _place_batch(_batches()[0], "data")
        step = jax.jit(functools.partial(_canonical, tx, "dots", "data"))
        with pytest.raises(TypeError, match="skip_nonfinite=True"):
            step(params, state, batch, jnp.int32(0), jnp.float64(1.0))


def test_gradients_typed_otherwise_than_the_state_name_the_leaf():
    """A state made from plain params meets unreduced gradients: the error names the
    leaf and says to make the state from the params differentiated."""
    tx = optax_accum.conditional_accumulator(_adam(), 2)
    with jax.set_mesh(_mesh("data")):
        params = _place_params(_params("dots"), "data")
        state = tx.init(jax.tree.map(lambda p: _compat.retyped(p), params))
        batch = _place_batch(_batches()[0], "data")
        step = jax.jit(functools.partial(_canonical, tx, "dots", "data"))
        with pytest.raises(TypeError, match=r"updates\['v'\] must be typed unreduced over \[\]"):
            step(params, state, batch, jnp.int32(0), jnp.float64(1.0))


def test_nnx_optimizer_keeps_the_params_reduced_and_reduces_once_a_window():
    """`optax_accum.NNXOptimizer` on an NNX model whose params are typed reduced: 8
    steps equal the one-device `apply_gradients` run, a held step moves nothing."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, params):
            self.w, self.v = nnx.Param(params["w"]), nnx.Param(params["v"])

    def loss(model, batch):
        return _loss({"w": model.w[...], "v": model.v[...]}, batch, "data")

    tx = CASES["conditional_accumulator"]()
    with jax.set_mesh(_mesh("data")):
        model = Model(_place_params(_params("dots"), "data"))
        optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, batch, lag, weight):
            model, optimizer = nnx.merge(graphdef, state)
            grads = nnx.grad(loss)(model, batch)
            extra = _extra(nnx.as_pure(optimizer.opt_state), lag, weight)
            optimizer.update(model, grads, **extra)
            return nnx.state((model, optimizer))

        compiled = None
        for batch, lag, weight in zip(_batches(), LAGS, WEIGHTS, strict=True):
            args = (state, _place_batch(batch, "data"), jnp.int32(lag), jnp.float64(weight))
            compiled = compiled or step.lower(*args).compile()
            state = compiled(*args)
        model, _ = nnx.merge(graphdef, state)
    params = {"w": model.w[...], "v": model.v[...]}
    want_params, _ = _one_device("conditional_accumulator", "dots")
    _assert_close(params, want_params)
    _assert_types_kept(params, nnx.as_pure(nnx.merge(graphdef, state)[1].opt_state), "data")
    found = collectives(compiled)
    assert not [c for c in found if c.every_step], found
    assert sum(c.nbytes for c in found) == _shard_bytes(params), found


def test_state_shardings_types_the_sums_unreduced():
    """`state_shardings` on params placed typed reduced: the sums unreduced, the inner
    optimizer's moments plain, each laid out like its param."""
    mesh = _mesh("fsdp")
    spec = P("fsdp", None, reduced={"data"})
    params = {"w": jax.device_put(jnp.ones((16, 4)), jax.sharding.NamedSharding(mesh, spec))}
    tx = CASES["conditional_accumulator"]()
    shardings = optax_accum.state_shardings(tx, params)
    state = jax.jit(tx.init, out_shardings=shardings)(params)
    assert shardings.storage["w"].spec == P("fsdp", None, unreduced={"data"})
    assert jax.typeof(state.storage["w"]) == jax.typeof(tx.init(params).storage["w"])
    assert _compat.sum_types(state.inner_state[0].mu["w"]) == (frozenset(), frozenset())


def test_auto_sharding_has_no_reduced_type_on_this_jax():
    """Under auto sharding (GSPMD) jax 0.10 refuses reduced and unreduced axes, so there
    is no auto-sharded row: the compiler decides where the gradient is reduced. When a
    jax accepts them, this fails, and the auto row is to be added."""
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(auto,))
    with pytest.raises(
        ValueError, match="Reduced axes can only refer to mesh axes that is of type"
    ):
        jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P(None, reduced={"data"})))


def _rows_step(tx, params, opt_state, ids, x, y):
    """An embedding table's row-sparse gradient (differentiated at the gathered rows)
    beside a dense weight's."""

    def loss(rows, w):
        return jnp.mean((jnp.tanh(x @ w) + rows - y) ** 2)

    g_rows, g_w = jax.grad(loss, argnums=(0, 1))(params["emb"][ids], params["w"])
    grads = {"emb": optax_accum.IndexedSlices(ids, g_rows, params["emb"].shape), "w": g_w}
    return optax_accum.apply_gradients(tx, grads, opt_state, params)


def test_row_sparse_leaves_beside_reduced_dense_ones():
    """`sparse_conditional_accumulator` with a row-sparse table kept plain and a dense
    weight typed reduced: the table's rows are split over the batch, not partial sums,
    so the row buffer gathers the step's rows (never the table); the dense sum stays
    unreduced and is reduced once a window. (A reduced table cannot be indexed on jax
    0.10.2: `t[ids]` raises in JAX's own indexing.)"""
    rng = np.random.default_rng(0)
    start = {"emb": rng.normal(size=(32, 4)), "w": rng.normal(size=(16, 4)) / 4}
    steps = [
        (
            rng.integers(0, 32, size=16).astype(np.int32),
            rng.normal(size=(16, 16)),
            rng.normal(size=(16, 4)),
        )
        for _ in range(4)
    ]
    results = {}
    for layout in (None, "data"):
        tx = optax_accum.sparse_conditional_accumulator(optax_accum.sparse_sgd(0.5), 2, capacity=32)
        context = contextlib.nullcontext() if layout is None else jax.set_mesh(_mesh("data"))
        with context:
            params = jax.tree.map(jnp.asarray, start)
            if layout:
                params["w"] = optax_accum.as_reduced(params["w"], "data")
            state = tx.init(params)
            step = jax.jit(functools.partial(_rows_step, tx), donate_argnums=(0, 1))
            compiled = None
            for ids, x, y in steps:
                x, y = _place_batch((x, y), layout)
                args = (params, state, jnp.asarray(ids), x, y)
                compiled = compiled or step.lower(*args).compile()
                params, state = compiled(*args)
        results[layout] = params
    _assert_close(results["data"], jax.tree.map(np.asarray, results[None]))
    assert _compat.sum_types(results["data"]["w"]) == (frozenset({"data"}), frozenset())
    found = collectives(compiled)
    rows_bytes = 16 * 4 * 8  # the step's 16 gathered rows, float64
    assert [(c.opcode, c.nbytes) for c in found if c.every_step] == [("all-gather", rows_bytes)]
    assert [(c.opcode, c.nbytes) for c in found if not c.every_step] == [("all-reduce", 16 * 4 * 8)]


def test_accumulated_reads_an_unreduced_sum():
    """`optax_accum.accumulated` keeps the sum's type; reduced, it is the gradients' sum."""
    tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 3)
    with jax.set_mesh(_mesh("data")):
        params = _place_params(_params("dots"), "data")
        state = tx.init(params)
        batch = _place_batch(_batches()[0], "data")
        grads = jax.jit(functools.partial(_grads, "dots", "data"))(params, batch)
        _, state = jax.jit(tx.update)(grads, state, params)
        _, state = jax.jit(tx.update)(grads, state, params)
        total = optax_accum.accumulated(state)
    assert all(_compat.sum_types(x)[1] == {"data"} for x in jax.tree.leaves(total))
    want = jax.tree.map(lambda g: 2 * _read(g), grads)
    _assert_close(total, want)


def test_the_tpu_form_of_the_release_reduction_gives_the_same_totals():
    """`_unreduced.reduced_in_place` with `nest`, the form a release takes on TPU (the
    all-reduces in a conditional of their own, so that each writes into its sum's
    buffer), run here on 8 CPU devices: the same totals, bit for bit, and of the same
    types, as the all-reduces where they stand; what it leaves in the sums' buffers
    (typed as the sums) reads back as the totals."""
    from optax_accum import _unreduced

    with jax.set_mesh(_mesh("data")):
        params = _place_params(_params("dots"), "data")
        batch = _place_batch(_batches()[0], "data")
        sums = jax.tree.leaves(jax.jit(functools.partial(_grads, "dots", "data"))(params, batch))

        def both(sums, released):
            left, nested = _unreduced.reduced_in_place(sums, released, nest=True)
            kept, plain = _unreduced.reduced_in_place(sums, released, nest=False)
            return nested, plain, [_unreduced.out_of_sum_type(x) for x in left], kept

        nested, plain, left, kept = jax.jit(both)(sums, jnp.asarray(True))
    assert [jax.typeof(x) for x in nested] == [jax.typeof(x) for x in plain]
    assert [jax.typeof(x) for x in kept] == [jax.typeof(x) for x in sums]
    assert all(_compat.sum_types(x)[1] == {"data"} for x in sums)
    for a, b, c in zip(nested, plain, left, strict=True):
        np.testing.assert_array_equal(_read(a), _read(b))
        np.testing.assert_array_equal(_read(c), _read(b))
