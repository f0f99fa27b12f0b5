"""Every transform under `jax.jit` on a (data=2, fsdp=4) mesh with FSDP-sharded params.

Pods train with `jax.jit` over a device mesh, each parameter split over a mesh axis and
the batch over another. Both sharding modes are run: explicit (the default of
`jax.make_mesh` from jax 0.10: sharding is part of each array's type) and auto (classic
GSPMD). For every transform and every way users write the step, 8 steps on the mesh
must equal the same 8 steps on one device in float64 (the canonical step there, which
every step shape must match), with:

- each state leaf that mirrors a parameter laid out like that parameter (its shard, and
  no more, on every device), per-row state like the rows, counters replicated;
- no collective added to those of the same step with the bare inner optimizer;
- on the CPU, no full-size copy on a held step (tests/test_regression_guard.py's guard).

Transform x step shape x mode is run pairwise (tests/_matrix.py): every transform in
both step shapes and both modes, every step shape in both modes, 12 compiles on the
mesh instead of 24; each step is compiled once and the compiled program runs it.

Params: a weight sharded over `fsdp`, one sharded in 2-D (`P("fsdp", "data")`) and a
replicated bias; the sparse case an embedding table sharded over its rows, with
`IndexedSlices` gradients.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import lenient
from _hlo import collectives, every_call, full_size_counts, instructions
from _matrix import pairwise
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

STEPS = 8
LAGS = (0, 0, 1, 0, 3, 0, 0, 2)  # how stale each step's gradient is
MODES = ("explicit", "auto")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
DENSE_SPECS = {"w": P("fsdp", None), "v": P("fsdp", "data"), "b": P()}
SPARSE_SPECS = {"emb": P("fsdp", None), "b": P()}


@pytest.fixture(autouse=True)
def _x64():
    with _compat.enable_x64():
        yield


def _mesh(mode: str) -> jax.sharding.Mesh:
    kind = jax.sharding.AxisType.Explicit if mode == "explicit" else jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(kind, kind))


def _adam():
    return lenient(optax.adam(0.05))


# Each case: (transform, params kind, whether it takes `local_step`, bare inner).
CASES = {
    "conditional_accumulator": (
        lambda: optax_accum.conditional_accumulator(_adam(), 2), "dense", True, _adam,
    ),
    "sparse_accumulator_dense_leaves": (
        lambda: optax_accum.sparse_conditional_accumulator(
            _adam(), 2, capacity=4, sparse={"w": False, "v": False, "b": False}
        ),
        "dense", True, _adam,
    ),
    "sparse_accumulator_rows": (
        lambda: optax_accum.sparse_conditional_accumulator(
            optax_accum.sparse_sgd(0.5), 2, capacity=12
        ),
        "sparse", True, lambda: optax_accum.sparse_sgd(0.5),
    ),
    "drop_stale_gradients": (
        lambda: optax_accum.drop_stale_gradients(_adam(), 1), "dense", True, _adam,
    ),
    "drop_stale_accumulator": (
        lambda: optax_accum.drop_stale_gradients(
            optax_accum.conditional_accumulator(_adam(), 2), 1
        ),
        "dense", True, _adam,
    ),
    "agn": (lambda: optax_accum.agn(_adam(), 2), "dense", False, _adam),
}  # fmt: skip


# --------------------------------------------------------------------------- the model


def _gather(mode: str | None):
    """FSDP's all-gather of a weight before use: explicit sharding asks for it by name;
    auto sharding and one device leave it to the compiler."""
    if mode == "explicit":
        return lambda w: jax.sharding.reshard(w, P())
    return lambda w: w


def _dense_loss(params, batch, gather):
    x, y, _ = batch
    h = jnp.tanh(x @ gather(params["w"]))
    return jnp.mean((h @ gather(params["v"]) + params["b"] - y) ** 2)


def _dense_grads(params, batch, gather):
    return jax.grad(_dense_loss)(params, batch, gather)


def _sparse_grads(params, batch, gather):
    """Row-sparse gradients of an embedding lookup: differentiate the gathered rows."""
    _, y, ids = batch
    rows = gather(params["emb"])[ids]

    def loss(rows, b):
        return jnp.mean((jnp.tanh(rows) + b - y) ** 2)

    g_rows, g_b = jax.grad(loss, argnums=(0, 1))(rows, params["b"])
    emb = optax_accum.IndexedSlices(ids, g_rows, params["emb"].shape)
    return {"emb": emb, "b": g_b}


def _params(kind: str) -> dict:
    rng = np.random.default_rng(0)
    if kind == "sparse":
        return {"emb": rng.normal(size=(32, 4)), "b": rng.normal(size=(4,))}
    return {
        "w": rng.normal(size=(16, 8)) / 4,
        "v": rng.normal(size=(8, 4)) / 3,
        "b": rng.normal(size=(4,)),
    }


def _batches() -> list:
    rng = np.random.default_rng(1)
    return [
        (rng.normal(size=(8, 16)), rng.normal(size=(8, 4)), rng.integers(0, 32, size=8))
        for _ in range(STEPS)
    ]


# --------------------------------------------------------------------------- the steps


def _extra(takes_local_step: bool, opt_state, lag) -> dict:
    if not takes_local_step:
        return {}
    return {"local_step": optax_accum.global_step(opt_state) - lag}


def _canonical(tx, grads_fn, takes_tag, params, opt_state, batch, lag):
    grads = grads_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **_extra(takes_tag, opt_state, lag))
    return optax_accum.apply_updates(params, updates), opt_state


def _fused(tx, grads_fn, takes_tag, params, opt_state, batch, lag):
    grads = grads_fn(params, batch)
    extra = _extra(takes_tag, opt_state, lag)
    return optax_accum.apply_gradients(tx, grads, opt_state, params, **extra)


PATTERNS = {"canonical": _canonical, "apply_gradients": _fused}


def _placed(tree, specs, mesh):
    if mesh is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _init(tx, params, mode):
    """The state as the guide says to make it: under auto sharding with the shardings
    `state_shardings` derives; under explicit sharding `init` gives them itself."""
    if mode == "auto":
        return jax.jit(tx.init, out_shardings=optax_accum.state_shardings(tx, params))(params)
    return jax.jit(tx.init)(params)


def _batch_on(batch, mesh):
    x, y, ids = batch
    if mesh is None:
        return jnp.asarray(x), jnp.asarray(y), jnp.asarray(ids, jnp.int32)
    data = NamedSharding(mesh, P("data"))
    return (
        jax.device_put(x, data),
        jax.device_put(y, data),
        jax.device_put(np.asarray(ids, np.int32), NamedSharding(mesh, P())),
    )


def _train(case: str, pattern: str, mode: str | None, bare: bool = False):
    """8 steps of the case's transform; returns the params, the state and the compiled
    step. `bare`: the case's bare inner optimizer, compiled only (its collectives are
    all that is read of it), with None for the params and the state."""
    make, kind, takes_tag, make_bare = CASES[case]
    tx = make_bare() if bare else make()
    takes_tag = takes_tag and not bare
    mesh = None if mode is None else _mesh(mode)
    grads_fn = _sparse_grads if kind == "sparse" else _dense_grads
    grads_fn = functools.partial(grads_fn, gather=_gather(mode))
    specs = SPARSE_SPECS if kind == "sparse" else DENSE_SPECS
    context = contextlib.nullcontext() if mesh is None else _compat.mesh_context(mesh)
    with context:
        params = _placed(_params(kind), specs, mesh)
        state = _init(tx, params, mode)
        step = jax.jit(
            functools.partial(PATTERNS[pattern], tx, grads_fn, takes_tag), donate_argnums=(0, 1)
        )
        compiled = None
        for batch, lag in zip(_batches(), LAGS, strict=True):
            args = (params, state, _batch_on(batch, mesh), jnp.asarray(lag, jnp.int32))
            if compiled is None:
                first = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args
                )
                compiled = step.lower(*first).compile()
                if bare:
                    return None, None, compiled
            # The compiled step itself: one compile a run (calling `step` would compile
            # again where the arguments' shardings differ from `first`'s, as on one device).
            params, state = compiled(*args)
    return params, state, compiled


@functools.cache
def _one_device(case: str):
    """The reference: the canonical step on one device. `apply_gradients` must give the
    same numbers (to the 1e-9 of the comparison), so both step shapes compare with it."""
    with _compat.enable_x64():
        params, state, _ = _train(case, "canonical", None)
        return jax.tree.map(np.asarray, (params, state))


# --------------------------------------------------------------------------- checks


def _assert_close(got, want):
    got = jax.tree.map(np.asarray, got)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


def _assert_laid_out_like_params(state, params):
    """Param-shaped state leaves hold their param's shard on every device, per-row
    counts of a dense leaf its rows' shard; scalars and the row buffers (looked up by
    any row id) are replicated."""
    by_shape = {p.shape: p for p in jax.tree.leaves(params)}
    rows = {p.shape[:1]: p for p in jax.tree.leaves(params) if p.ndim >= 2}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        if leaf.ndim == 0:
            assert leaf.sharding.is_fully_replicated, where
            continue
        if leaf.shape in by_shape:
            param = by_shape[leaf.shape]
            assert leaf.sharding.devices_indices_map(leaf.shape) == (
                param.sharding.devices_indices_map(param.shape)
            ), (where, leaf.sharding, param.sharding)
            shard = leaf.addressable_shards[0].data
            assert shard.size == param.addressable_shards[0].data.size, where
        elif leaf.shape in rows and not where.endswith(".slot_of"):
            param = rows[leaf.shape]
            want = param.addressable_shards[0].data.shape[0]
            assert leaf.addressable_shards[0].data.shape[0] == want, (where, leaf.sharding)
        else:
            assert leaf.sharding.is_fully_replicated, (where, leaf.sharding)


def _collectives(compiled) -> collections.Counter:
    ops = instructions(compiled.as_text())
    counts = collections.Counter()
    for op in ops:
        for kind in COLLECTIVES:
            if op.opcode in (kind, f"{kind}-start"):
                counts[kind] += 1
    return counts


def _bare_collectives(case: str, pattern: str, mode: str) -> collections.Counter:
    _, kind, _, make_bare = CASES[case]
    return _bare_collectives_of(make_bare, kind, pattern, mode)


@functools.cache
def _bare_collectives_of(make_bare, kind: str, pattern: str, mode: str) -> collections.Counter:
    """The collectives of the bare inner optimizer's step: one compile for the cases
    that share a bare optimizer and params (all the dense ones share `_adam`)."""
    case = next(c for c in sorted(CASES) if CASES[c][1] == kind and CASES[c][3] is make_bare)
    with _compat.enable_x64():
        *_, compiled = _train(case, pattern, mode, bare=True)
        return _collectives(compiled)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("case", "pattern", "mode"), pairwise(sorted(CASES), sorted(PATTERNS), list(MODES))
)
def test_sharded_training_equals_one_device(case, pattern, mode):
    """Pairwise (tests/_matrix.py), not the full product: every case runs in both step
    shapes and both sharding modes, and every step shape in both modes (12 of the 24
    combinations, each a compile on the mesh and one on one device). Among them the
    sparse rows case under auto sharding, whose extra all-gather is named below."""
    params, state, compiled = _train(case, pattern, mode)
    want_params, want_state = _one_device(case)
    _assert_close(params, want_params)
    _assert_close(state, want_state)
    _assert_laid_out_like_params(state, params)
    added = _collectives(compiled) - _bare_collectives(case, pattern, mode)
    if case == "sparse_accumulator_rows" and mode == "auto":
        # GSPMD computes the gradient's rows split over `data`; the replicated row
        # buffer takes them whole: one all-gather of k rows, where the bare optimizer
        # all-reduces its scattered update instead.
        added -= collections.Counter({"all-gather": 1})
    assert not added, f"collectives the bare inner optimizer does not run: {dict(added)}"


def _update_step(tx, pattern, params, opt_state, grads):
    if pattern == "apply_gradients":
        return optax_accum.apply_gradients(tx, grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_sharded_held_step_copies_nothing_full_size(pattern, mode):
    """tests/test_regression_guard.py's guard on the sharded step: the held step updates
    every donated buffer in place."""
    tx = CASES["conditional_accumulator"][0]()
    mesh = _mesh(mode)
    with _compat.mesh_context(mesh):
        params = _placed(_params("dense"), DENSE_SPECS, mesh)
        state = _init(tx, params, mode)
        step = jax.jit(functools.partial(_update_step, tx, pattern), donate_argnums=(0, 1))
        compiled = step.lower(params, state, params).compile()
    ops = every_call(compiled.as_text())
    counts = full_size_counts(ops)
    copies = [op for op in ops if op.opcode == "copy" and op.size > 1]
    assert not copies, f"arrays copied on every call: {copies}"
    assert not set(counts) & set(COLLECTIVES), f"a held step communicates: {dict(counts)}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_sharded_init_never_holds_the_whole_state_on_one_device(case):
    """Under auto sharding, `jax.jit(tx.init)` alone returns replicated state; with the
    `out_shardings` that `state_shardings` derives, each device allocates its shards."""
    make, kind, _, _ = CASES[case]
    tx = make()
    mesh = _mesh("auto")
    with _compat.mesh_context(mesh):
        params = _placed(_params(kind), SPARSE_SPECS if kind == "sparse" else DENSE_SPECS, mesh)
        shardings = optax_accum.state_shardings(tx, params)
        sharded = jax.jit(tx.init, out_shardings=shardings).lower(params).compile()
        replicated = jax.jit(tx.init).lower(params).compile()
        state = sharded(params)
    leaves = jax.tree.leaves(state)
    whole = sum(x.nbytes for x in leaves)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    _assert_laid_out_like_params(state, params)
    out = sharded.memory_analysis().output_size_in_bytes
    assert out <= per_device + 64 * len(leaves)  # scalars may be padded
    assert sharded.memory_analysis().temp_size_in_bytes <= max(whole - per_device, 1024)
    if case != "sparse_accumulator_rows":  # its state mirrors no sharded param
        assert per_device < whole / 2
        assert replicated.memory_analysis().output_size_in_bytes > 2 * out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make",
    [
        lambda: optax_accum.cross_shard_optimizer(_adam(), "data"),
        lambda: optax.chain(optax_accum.cross_shard("data"), _adam()),
        lambda: optax_accum.conditional_accumulator(_adam(), 2, axis_name="data"),
        lambda: optax_accum.agn(_adam(), 2, axis_name="fsdp"),
    ],
    ids=["cross_shard_optimizer", "cross_shard", "conditional_accumulator", "agn"],
)
def test_a_mesh_axis_name_under_plain_jit_says_what_to_do(make, mode):
    """`axis_name` has no meaning under plain jit: the error names the argument and
    points to jax.shard_map, never a deep JAX trace."""
    tx = make()
    mesh = _mesh(mode)
    with _compat.mesh_context(mesh):
        params = _placed(_params("dense"), DENSE_SPECS, mesh)
        state = tx.init(params)
        step = jax.jit(functools.partial(_update_step, tx, "canonical"))
        # One failing call (each retraces): both parts of the message read from its error.
        with pytest.raises(
            ValueError, match=r"axis_name='\w+' names an axis of the current mesh"
        ) as e:
            step(params, state, params)
    assert re.search(r"jax\.shard_map", str(e.value)), e.value


# --------------------------------------------------------------------------- sparse rows


def _explicit_mesh() -> jax.sharding.Mesh:
    return _mesh("explicit")


def _split_rows_steps() -> list:
    """8 steps of row-sparse gradients of a 32-row table: 8 ids a step (a duplicate, a
    padding id), with a dense bias's gradient."""
    rng = np.random.default_rng(2)
    steps = []
    for _ in range(STEPS):
        ids = rng.integers(0, 32, size=8).astype(np.int32)
        ids[5], ids[7] = ids[1], 32
        steps.append((ids, rng.normal(size=(8, 4)), rng.normal(size=(4,))))
    return steps


def _split_rows_run(mesh):
    """8 jitted steps of the sparse accumulator on a table sharded over `fsdp`, with the
    gradient's ids and rows split over `data` (as the rows of a batch split over `data`
    come from `jax.grad`); one device when `mesh` is None. Returns the params and the
    compiled step."""
    tx = optax_accum.sparse_conditional_accumulator(optax_accum.sparse_sgd(0.5), 2, capacity=16)

    def step(params, opt_state, ids, rows, bias):
        grads = {"emb": optax_accum.IndexedSlices(ids, rows, (32, 4)), "b": bias}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax_accum.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(3)
    start = {"emb": rng.normal(size=(32, 4)), "b": rng.normal(size=(4,))}
    context = contextlib.nullcontext() if mesh is None else _compat.mesh_context(mesh)
    with context:
        params = _placed(start, SPARSE_SPECS, mesh)
        opt_state = jax.jit(tx.init)(params)  # one compile, not one per operation
        compiled = None
        for ids, rows, bias in _split_rows_steps():
            batch = _placed((ids, rows, bias), (P("data"), P("data", None), P()), mesh)
            args = (params, opt_state, *batch)
            compiled = compiled or jax.jit(step).lower(*args).compile()
            params, opt_state = compiled(*args)
    return params, compiled


def test_sparse_rows_split_over_the_batch_axis():
    """`IndexedSlices` whose ids and rows are split over the batch axis under explicit
    sharding: the row buffer (replicated) gathers the step's ids and rows, one
    all-gather of a few hundred bytes and never the table; 8 steps equal one device."""
    params, compiled = _split_rows_run(_explicit_mesh())
    want, _ = _split_rows_run(None)
    _assert_close(params, jax.tree.map(np.asarray, want))
    # Beside scalars (the count of ids out of range, summed over the split ids).
    moved = [(c.opcode, c.nbytes) for c in collectives(compiled) if c.every_step and c.nbytes > 8]
    assert {op for op, _ in moved} <= {"all-gather"}, moved
    assert sum(n for _, n in moved) <= 8 * 4 + 8 * 4 * 8, moved  # the ids and the rows


def test_densify_builds_the_dense_gradient_sharded_like_the_table():
    """`densify()` on an 8-way sharded table builds each device's shard, not the whole
    table: the densified gradient is typed like the table, and the sparse accumulator's
    releasing step (densify, then SGD) holds under 4 shards of temporaries per device
    (16 shards, 4 MiB, when densify built the table replicated)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with _compat.mesh_context(mesh), _compat.enable_x64(False):
        table = jax.device_put(jnp.zeros((8192, 64)), NamedSharding(mesh, P("x")))
        grads = optax_accum.IndexedSlices(jnp.arange(32), jnp.ones((32, 64)), table.shape)
        dense, _ = optax_accum.densify().update(grads, optax.EmptyState(), table)
        assert jax.typeof(dense) == jax.typeof(table)
        np.testing.assert_array_equal(np.asarray(dense), np.asarray(grads.to_dense()))

        inner = optax.chain(optax_accum.densify(), optax.sgd(0.1))
        tx = optax_accum.sparse_conditional_accumulator(inner, 1, capacity=64)
        params = {"emb": table}
        state = tx.init(params)

        def step(params, state, grads):
            updates, state = tx.update({"emb": grads}, state, params)
            return optax_accum.apply_updates(params, updates), state

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    shard = table.addressable_shards[0].data.nbytes  # 256 KiB
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries < 4 * shard, (temporaries, shard)


def test_sparse_init_outside_set_mesh():
    """`init` on params placed by hand on an explicit mesh, with no mesh set: each
    dense leaf's per-row counts are laid out like its rows, and the state is typed as
    `init` under `jax.set_mesh` types it."""
    mesh = _explicit_mesh()
    specs = {"emb": P("fsdp", None), "w": P("fsdp", "data"), "b": P()}
    rng = np.random.default_rng(4)
    start = {"emb": rng.normal(size=(32, 4)), "w": rng.normal(size=(8, 4)), "b": np.zeros(4)}
    params = _placed(start, specs, mesh)
    tx = optax_accum.sparse_conditional_accumulator(optax_accum.sparse_sgd(0.5), 2, capacity=16)
    state = tx.init(params)
    with _compat.mesh_context(mesh):
        want = tx.init(params)
    # As jax prints the types: a replicated scalar's has no mesh to name.
    assert jax.tree.map(lambda x: str(jax.typeof(x)), state) == jax.tree.map(
        lambda x: str(jax.typeof(x)), want
    )
    assert state.storage["w"].touches.sharding.spec == P("fsdp")
    _assert_laid_out_like_params(state, params)
