"""The accumulators' `communication_dtype`: the release's one reduction sent narrow.

- The values: the release equals `_wire.reduced` of the window's sums, bit for bit,
  for `conditional_accumulator` and the sparse accumulator's dense leaves, under
  `jax.vmap` (tests/test_wire.py checks `_wire` against its float64 model).
- Under `jax.shard_map` with `axis_name` (8 devices, XLA:CPU and the TPU lowering) and
  under `jax.jit` with params typed reduced (8 devices; and the TPU compiler on a v5e
  slice): the held step runs the same collectives as without the option (none
  gradient-sized), the release one all-to-all and one all-gather, at most 1/3.9 of
  float32's bytes for int8 and float8, half for bfloat16; the reduced params' values
  within the stated error of the exact float64 sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _wire
from optax_accum.demo import tpu

N = 8
NARROW = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "float8": jnp.float8_e4m3fn}
SHAPES = {"w": (64, 64), "v": (128, 32)}  # 16 blocks each: 32 blocks, 4 per replica


def _all_dense(params: dict) -> dict:
    return jax.tree.map(lambda _: False, params)


def _ring_bytes(found: list) -> int:
    """Bytes a device sends over a ring: an all-reduce its result twice, an all-to-all
    and an all-gather once (tests/test_wire.py)."""
    return sum((2 if c.opcode == "all-reduce" else 1) * c.nbytes for c in found)


def _check_ratio(name: str, narrow: list, plain: list) -> None:
    """The release's values go as one all-to-all and one all-gather (the scales in
    small collectives of their own: the TPU compiler turns an all-gather of a few
    hundred bytes into an all-reduce), at most 1/3.9 of float32's bytes."""
    assert {c.opcode for c in plain} == {"all-reduce"}, plain
    total = _ring_bytes(narrow)
    big = sorted(c.opcode for c in narrow if c.nbytes > total / 16)
    assert big == ["all-gather", "all-to-all"], narrow
    ratio = total / _ring_bytes(plain)
    if name == "bfloat16":
        assert len(narrow) == 2 and ratio == 0.5, narrow
    else:  # 1 byte a value and 4 a block of 256: (1 + 4/256) / 4 = 1/3.94
        assert (1 + 4 / 256) / 4 <= ratio <= 1 / 3.9, (ratio, narrow)


# --------------------------------------------------------------------------- values


def test_the_release_is_the_wire_sum_of_the_window_bit_for_bit():
    """Two gradients a replica, then the release: the accumulators' output is
    `_wire.reduced` of each replica's window sum (the sparse accumulator's dense leaves
    divided by their row counts, 2 * N each), for every narrow type; one program."""
    rng = np.random.default_rng(1)
    shapes = {"w": (8, 32), "v": (4, 256)}  # in blocks of 256; row by row
    grads = {k: rng.normal(size=(2, 4, *s)).astype(np.float32) for k, s in shapes.items()}

    def run(grads: dict) -> dict:
        out = {}
        for name, dtype in NARROW.items():
            dense = optax_accum.conditional_accumulator(
                optax.identity(), 2 * 4, reduction="sum", axis_name="i", communication_dtype=dtype
            )
            rows = optax_accum.sparse_conditional_accumulator(
                optax.identity(),
                2 * 4,
                capacity=1,
                axis_name="i",
                communication_dtype=dtype,
                sparse=_all_dense,
            )
            params = jax.tree.map(lambda g: jnp.zeros_like(g[0]), grads)
            for key, tx in (("dense", dense), ("rows", rows)):
                state = tx.init(params)
                _, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
                out[name, key], _ = tx.update(jax.tree.map(lambda g: g[1], grads), state)
            window = jax.tree.map(lambda g: g[0] + g[1], grads)
            out[name, "wire"] = _wire.reduced(window, "i", communication_dtype=dtype)
        return out

    batched = jax.tree.map(lambda g: jnp.moveaxis(g, 1, 0), grads)  # replicas first
    got = jax.jit(jax.vmap(run, axis_name="i"))(batched)
    for name in NARROW:
        for k in shapes:
            wire = np.asarray(got[name, "wire"][k])
            np.testing.assert_array_equal(got[name, "dense"][k], wire)
            np.testing.assert_array_equal(got[name, "rows"][k], wire / np.float32(2 * 4))
            exact = grads[k].astype(np.float64).sum(axis=(0, 1))
            assert np.abs(wire[0] - exact).max() < 0.1 * np.abs(exact).max()


# --------------------------------------------------------------------------- shard_map


@functools.cache
def _shard_map_step(name: str) -> tuple:
    """`apply_gradients` of a `conditional_accumulator` (SGD, 2 N gradients a window)
    under `jax.shard_map` with `axis_name`, each replica differentiating its own copy:
    (XLA:CPU collectives, TPU-lowered collectives)."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    dtype = None if name == "none" else NARROW[name]
    tx = optax_accum.conditional_accumulator(
        optax.sgd(0.1), 2 * N, axis_name="data", communication_dtype=dtype
    )
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    specs = optax_accum.state_partition_specs(tx, params, mesh)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.eval_shape(init, params)  # each replica's sums stacked on dim 0
    batch = jax.ShapeDtypeStruct((N, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    def loss(p: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ p["w"]) @ p["v"][:64] ** 2)

    def body(params: dict, state, x: jax.Array) -> tuple:
        grads = jax.grad(loss)(jax.lax.pcast(params, "data", to="varying"), x)
        return optax_accum.apply_gradients(tx, grads, state, params)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
    )
    placed = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        (params, state),
        (jax.tree.map(lambda _: P(), params), specs),
    )
    traced = jax.jit(mapped, donate_argnums=(1,)).trace(*placed, batch)
    lowered = traced.lower(lowering_platforms=("tpu",)).as_text(dialect="hlo")
    return collectives(traced.lower().compile()), collectives(lowered)


@pytest.mark.parametrize("name", list(NARROW))
def test_shard_map_release_sends_narrow_and_the_held_step_is_unchanged(name):
    for plain, narrow in zip(_shard_map_step("none"), _shard_map_step(name), strict=True):
        assert [c for c in narrow if c.every_step] == [c for c in plain if c.every_step]
        assert all(c.nbytes <= 64 for c in narrow if c.every_step)  # the counts alone
        _check_ratio(
            name, [c for c in narrow if not c.every_step], [c for c in plain if not c.every_step]
        )


# --------------------------------------------------------------------------- reduced params


def _reduced_case(mesh: jax.sharding.Mesh, dtype, sparse: bool = False) -> tuple:
    """The canonical step of an accumulator (identity inside, SUM, one gradient a
    window: every step releases) on params typed reduced over `data`, given the
    unreduced gradients: (the jitted step, its abstract arguments)."""
    if sparse:
        tx = optax_accum.sparse_conditional_accumulator(
            optax.identity(),
            1,
            capacity=1,
            reduction="sum",
            communication_dtype=dtype,
            sparse=_all_dense,
        )
    else:
        tx = optax_accum.conditional_accumulator(
            optax.identity(), 1, reduction="sum", communication_dtype=dtype
        )

    def struct(spec: P) -> dict:
        return {
            k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
            for k, s in SHAPES.items()
        }

    params = struct(P(None, None, reduced={"data"}))
    grads = struct(P(None, None, unreduced={"data"}))
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return updates, state

    return jax.jit(step, donate_argnums=(1,)), (params, state, grads), tx


@functools.cache
def _cpu_reduced(name: str, sparse: bool = False) -> tuple:
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    fn, args, tx = _reduced_case(mesh, None if name == "none" else NARROW[name], sparse)
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile()
    return compiled, mesh, tx


def _partials(mesh: jax.sharding.Mesh) -> tuple[dict, dict]:
    """Gradients typed unreduced over `data` whose device d holds `d + 1` times a
    random leaf (a partial sum of its own), and the exact total in float64."""
    rng = np.random.default_rng(3)
    base = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    stacked = {k: np.stack([(d + 1) * v for d in range(N)]) for k, v in base.items()}

    def each(tree: dict) -> dict:  # a device's partial sums, typed unreduced
        return jax.tree.map(lambda x: jax.lax.pcast(x[0], "data", to="unreduced"), tree)

    with jax.set_mesh(mesh):
        placed = jax.device_put(stacked, NamedSharding(mesh, P("data")))
        out = jax.tree.map(lambda _: P(None, None, unreduced={"data"}), base)
        grads = jax.jit(jax.shard_map(each, in_specs=P("data"), out_specs=out))(placed)
    exact = {k: v.astype(np.float64).sum(0) for k, v in stacked.items()}
    return grads, exact


@pytest.mark.parametrize("name", ["int8", "float8"])
def test_reduced_params_release_sends_narrow_holds_nothing_and_is_within_the_bound(name):
    plain, mesh, _ = _cpu_reduced("none")
    compiled, _, tx = _cpu_reduced(name)
    found, base = collectives(compiled), collectives(plain)
    assert not [c for c in found if c.every_step] and not [c for c in base if c.every_step]
    _check_ratio(name, [c for c in found if not c.every_step], base)
    grads, exact = _partials(mesh)
    with jax.set_mesh(mesh):
        params = jax.device_put(
            {k: np.zeros(s, np.float32) for k, s in SHAPES.items()},
            NamedSharding(mesh, P(None, None)),
        )
        params = optax_accum.as_reduced(params, "data")
        state = jax.jit(tx.init)(params)
        updates, _ = compiled(params, state, grads)
    for k in SHAPES:
        err, top = np.abs(np.asarray(updates[k], np.float64) - exact[k]), np.abs(exact[k]).max()
        # Device d's block is d + 1 times the same leaf's: its rounding moves a value by
        # at most (d + 1) max|block| / 254 / 2 (int8), or by (d + 1) / 16 of it (float8);
        # over the devices that is the total's max / 254 (|total| / 16), and the last
        # rounding as much again. `top` bounds every block's max.
        int8 = 2 * top / 254
        bound = int8 if name == "int8" else np.abs(exact[k]) / 8 + 2 * top / (448 * 1024)
        assert np.all(err <= bound * (1 + 1e-4) + 1e-4), np.max(err / bound)
        assert err.max() > 1e-3  # it did travel narrow


def test_sparse_dense_leaves_on_reduced_params_send_narrow():
    found = collectives(_cpu_reduced("int8", sparse=True)[0])
    base = collectives(_cpu_reduced("none", sparse=True)[0])
    assert not [c for c in found if c.every_step]
    narrow = [c for c in found if not c.every_step]
    values = [c for c in narrow if c.opcode != "all-reduce"]
    counts = [c for c in narrow if c.opcode == "all-reduce"]  # the rows' weights, exact
    assert counts == [c for c in base if c.opcode == "all-reduce" and c.nbytes < 4096]
    _check_ratio("int8", values, [c for c in base if c.nbytes >= 4096])


@pytest.mark.skipif(bool(tpu.unavailable()), reason=str(tpu.unavailable()))
def test_the_tpu_compiler_keeps_the_held_step_and_sends_int8_in_the_release():
    """A v5e slice (4 chips), params typed reduced: the held step's collectives (none)
    and conditionals are those of the step without the option; the release sends 1/3.94
    of float32's bytes. (The HBM bytes of the ops on every step are equal too from
    leaves of 8 MB on; at these 32 kB leaves the compiler stages them through the
    vector memory as each program's branch leaves room: docs/guide.md, "Quantized
    releases", has the figures.)"""
    mesh = tpu.mesh(tpu.TOPOLOGIES["v5e"], ("data",))
    programs = {}
    for name in ("none", "int8"):
        fn, args, _ = _reduced_case(mesh, None if name == "none" else jnp.int8)
        with jax.set_mesh(mesh):
            programs[name] = tpu.read(fn.lower(*args).compile())
    plain, narrow = programs["none"], programs["int8"]
    assert narrow.held() == plain.held() == []
    assert narrow.conditionals == plain.conditionals == 1 and narrow.loops == 0
    _check_ratio("int8", narrow.released(), plain.released())
