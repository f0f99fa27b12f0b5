"""record_global_norm and recorded_global_norm: the window's gradient norm, recorded at
the release and read from any state, on every layout.

Inside `conditional_accumulator(optax.chain(record_global_norm(), ...), 2)`, the norm
recorded after a release is the L2 norm of the window's mean gradient (checked against
NumPy in float64), and it stays through the held steps. On each layout (one device,
`jax.make_mesh`'s explicit axes, auto axes, params typed reduced with gradients typed
unreduced) and call form (jit, eager), over a tree of mixed leaves (a float16 kernel
sharded on its second axis, a float32 bias sharded over the mesh, a replicated
matrix): `init` works on `jax.ShapeDtypeStruct` params, every state leaf keeps its
`jax.typeof` after init and after each of three updates (one releases), eager gives
jit's types and values, and the norm is NumPy's. On params typed reduced, a held step
moves nothing and the release moves the window's one all-reduce and the norm's
scalars, nothing else. The state checkpoints (Flax's msgpack and Orbax), reads through
Flax's TrainState and NNX's optimizer, and an `IndexedSlices` counts as its dense
tensor (duplicate ids added, padding left out).

Cost: one compile per jit cell, eager cells share JAX's op-by-op kernels.
"""

from __future__ import annotations

import contextlib
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
from optax_accum import _compat

AXES = ("data", "model")
SPECS = {"kernel": P(None, "model"), "bias": P("model"), "replicated": P()}
LAYOUTS = ("one_device", "explicit", "auto", "reduced")
STEPS = 3  # the second update releases


def _tx() -> optax.GradientTransformationExtraArgs:
    inner = optax.chain(optax_accum.record_global_norm(), optax.sgd(0.5))
    return optax_accum.conditional_accumulator(inner, 2)


def _mesh(layout: str) -> jax.sharding.Mesh:
    kind = jax.sharding.AxisType.Auto if layout == "auto" else jax.sharding.AxisType.Explicit
    return jax.make_mesh((2, 4), AXES, axis_types=(kind, kind))


def _dyadic(rng, shape, dtype) -> np.ndarray:
    """Multiples of 1/8: sums and halves exact in float16."""
    return (rng.integers(-8, 9, size=shape) / 8).astype(dtype)


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "kernel": _dyadic(rng, (4, 8), np.float16),
        "bias": _dyadic(rng, (8,), np.float32),
        "replicated": _dyadic(rng, (4, 4), np.float32),
    }


def _partials(i: int) -> tuple[dict, dict]:
    """Step i's gradient as two partial sums, one per replica of the `data` axis."""
    rng = np.random.default_rng(100 + i)
    return tuple({k: _dyadic(rng, v.shape, v.dtype) for k, v in _params().items()} for _ in "ab")


@functools.cache
def _to_unreduced():
    """Two stacked partial sums, split over `data`, to a gradient typed unreduced over
    it (each device holds its replica's partial sum), as `jax.grad` gives for params
    typed reduced."""
    mapped = jax.shard_map(
        lambda tree: jax.tree.map(lambda x: x[0], tree),
        mesh=_mesh("reduced"),
        in_specs=({k: P("data", *s) for k, s in SPECS.items()},),
        out_specs={k: P(*s, unreduced={"data"}) for k, s in SPECS.items()},
    )
    return jax.jit(mapped)


def _placed_params(layout: str) -> dict:
    params = _params()
    if layout == "one_device":
        return jax.tree.map(jnp.asarray, params)
    mesh = _mesh(layout)
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    return optax_accum.as_reduced(placed, "data") if layout == "reduced" else placed


def _placed_grads(i: int, layout: str) -> dict:
    a, b = _partials(i)
    if layout == "one_device":
        return {k: jnp.asarray(a[k] + b[k]) for k in a}
    mesh = _mesh(layout)
    if layout == "reduced":
        stacked = {
            k: jax.device_put(np.stack([a[k], b[k]]), NamedSharding(mesh, P("data", *SPECS[k])))
            for k in a
        }
        return _to_unreduced()(stacked)
    return {k: jax.device_put(a[k] + b[k], NamedSharding(mesh, SPECS[k])) for k in a}


def _numpy_norm(i: int, j: int) -> float:
    """The L2 norm of the mean of steps i's and j's gradients, in float64."""
    grads = [{k: x.astype(np.float64) + y for k, (x, y) in _zip(_partials(s))} for s in (i, j)]
    return float(np.sqrt(sum(np.sum(((grads[0][k] + grads[1][k]) / 2) ** 2) for k in grads[0])))


def _zip(parts: tuple[dict, dict]):
    a, b = parts
    return ((k, (a[k], b[k])) for k in a)


def _type(x) -> str:
    """`jax.typeof(x)` as printed (its layout and reduced or unreduced axes under
    explicit sharding), for an array or a `jax.ShapeDtypeStruct` alike (`jax.eval_shape`
    leaves a replicated value's sharding out)."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return str(jax.typeof(x))
    sharding = {} if x.sharding is None else {"sharding": x.sharding}
    return str(jax.core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type, **sharding))


def _types(tree) -> list[str]:
    return [_type(x) for x in jax.tree.leaves(tree)]


def _abstract(params: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
    )


def _context(layout: str):
    """The layout's mesh, set; eager steps on placed arrays run outside `jax.set_mesh`
    (their meshes come from the arrays)."""
    return contextlib.nullcontext() if layout == "one_device" else jax.set_mesh(_mesh(layout))


@functools.cache
def _accumulated(layout: str) -> tuple:
    """Three jitted updates of the accumulator (the second releases); returns the
    recorded norm and the state's types after init and after each update, the types
    `init` gives for abstract params, the compiled update and the last state."""
    tx = _tx()
    with _context(layout):
        params = _placed_params(layout)
        state = tx.init(params)
        types = [_types(state)]
        abstract = _types(jax.eval_shape(tx.init, _abstract(params)))
        compiled = jax.jit(tx.update).lower(_placed_grads(0, layout), state, params).compile()
        norms = []
        for i in range(STEPS):
            _, state = compiled(_placed_grads(i, layout), state, params)
            types.append(_types(state))
            norms.append(float(optax_accum.recorded_global_norm(state)))
    return norms, types, abstract, compiled, state


@pytest.mark.parametrize("layout", LAYOUTS)
def test_records_the_windows_norm_and_keeps_every_type_under_jit(layout):
    norms, types, abstract, compiled, _ = _accumulated(layout)
    want = _numpy_norm(0, 1)
    np.testing.assert_allclose(norms, [0.0, want, want], rtol=1e-6)
    assert all(t == types[0] for t in types), types
    assert abstract == types[0]
    if layout == "reduced":
        # A held step moves nothing; the release moves the window's all-reduce of one
        # shard of each leaf, and the norm's scalar sums over the sharded leaves.
        found = collectives(compiled)
        assert not [c for c in found if c.every_step], found
        shard_bytes = sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(_placed_params(layout))
        )
        scalars = 8 * len(SPECS)  # at most a few bytes a leaf (XLA may merge them in)
        assert {c.opcode for c in found} == {"all-reduce"}, found
        assert shard_bytes <= sum(c.nbytes for c in found) <= shard_bytes + scalars, found


@pytest.mark.parametrize("layout", ["one_device", "explicit", "auto"])
def test_eager_gives_jits_types_and_numpys_norm(layout):
    """The transform alone, called eagerly on each step's gradient (outside
    `jax.set_mesh`: the arrays carry their meshes): each step's norm is NumPy's, every
    type stays, and jit's types (`jax.eval_shape` of the jitted update: nothing
    compiles) are eager's."""
    tx = optax_accum.record_global_norm()
    params = _placed_params(layout)
    state = tx.init(params)
    types = _types(state)
    for i in range(STEPS):
        grads = _placed_grads(i, layout)
        with _context(layout):
            jitted = jax.eval_shape(jax.jit(tx.update), grads, state, params)
        _, state = tx.update(grads, state, params)
        assert _types(state) == types
        assert _types(jitted[1]) == types
        a, b = _partials(i)
        want = np.sqrt(sum(np.sum((a[k].astype(np.float64) + b[k]) ** 2) for k in a))
        np.testing.assert_allclose(float(optax_accum.recorded_global_norm(state)), want, rtol=1e-6)


def test_the_norm_is_a_replicated_scalar_typed_as_at_init():
    """Under explicit sharding the recorded norm lies on the params' mesh, replicated,
    plain (not reduced) even when the params are typed reduced."""
    _, types, *_ = _accumulated("reduced")
    with jax.set_mesh(_mesh("reduced")):
        state = _tx().init(_placed_params("reduced"))
    norm = state.inner_state[0].global_norm
    assert jax.typeof(norm).sharding.spec == P()
    assert _compat.sum_types(norm) == (frozenset(), frozenset())
    assert str(jax.typeof(norm)) in types[-1]


def test_unreduced_updates_outside_an_accumulator_say_where_to_put_it():
    tx = optax.chain(optax_accum.record_global_norm(), optax.sgd(0.5))
    with jax.set_mesh(_mesh("reduced")):
        params = _placed_params("reduced")
        state = tx.init(params)
        grads = _placed_grads(0, "reduced")
        with pytest.raises(TypeError, match=r"Put it inside an accumulator"):
            jax.jit(tx.update).trace(grads, state, params)


def test_a_row_sparse_update_counts_as_its_dense_tensor():
    """Duplicate ids are added before squaring; padding ids (out of range) are left out."""
    ids = np.array([3, 1, 3, 9, 0], np.int32)  # 9 is padding in a 6-row table
    rows = np.arange(10, dtype=np.float32).reshape(5, 2) - 4
    dense = np.zeros((6, 2))
    for i, r in zip(ids, rows, strict=True):
        if i < 6:
            dense[i] += r
    tx = optax_accum.record_global_norm()
    updates = {
        "emb": optax_accum.IndexedSlices(jnp.asarray(ids), jnp.asarray(rows), (6, 2)),
        "w": jnp.full((2,), 2.0, jnp.bfloat16),
    }
    state = tx.init({"emb": jnp.zeros((6, 2)), "w": jnp.zeros(2, jnp.bfloat16)})
    out, state = jax.jit(tx.update)(updates, state)
    want = np.sqrt(np.sum(dense**2) + 8.0)
    np.testing.assert_allclose(float(optax_accum.recorded_global_norm(state)), want, rtol=1e-6)
    assert out["emb"].indices is not None and state.global_norm.dtype == jnp.float32


def test_float64_params_record_a_float64_norm():
    with _compat.enable_x64():
        tx = optax_accum.record_global_norm()
        state = tx.init({"w": jnp.zeros(2, jnp.float64), "b": jnp.zeros(1, jnp.float32)})
        _, state = tx.update({"w": jnp.array([1e-9, 0.0]), "b": jnp.ones(1, jnp.float32)}, state)
        assert state.global_norm.dtype == jnp.float64
        assert float(state.global_norm) == np.sqrt(1.0 + 1e-18)


def test_the_state_checkpoints_and_reads_through_train_states(tmp_path):
    """After a release, on the explicit mesh: Flax's msgpack and Orbax restore the state
    (types and values); Flax's linen TrainState and NNX's optimizer hold it."""
    serialization = pytest.importorskip("flax.serialization")
    ocp = pytest.importorskip("orbax.checkpoint")
    nnx = pytest.importorskip("flax.nnx")
    from flax.training import train_state

    tx = _tx()
    *_, state = _accumulated("explicit")  # after the release and a held step
    with jax.set_mesh(_mesh("explicit")):
        fresh = tx.init(_placed_params("explicit"))
        restored = serialization.from_bytes(fresh, serialization.to_bytes(state))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh
        )
        from_orbax = checkpointer.restore(tmp_path / "state", target)
    want = _numpy_norm(0, 1)
    assert _types(from_orbax) == _types(state)
    for tree in (restored, from_orbax):  # msgpack restores NumPy arrays
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(tree)] == [
            (x.shape, x.dtype) for x in jax.tree.leaves(state)
        ]
        np.testing.assert_allclose(float(optax_accum.recorded_global_norm(tree)), want, rtol=1e-6)

    linen = train_state.TrainState.create(apply_fn=None, params=_params(), tx=_tx())
    assert float(optax_accum.recorded_global_norm(linen.opt_state)) == 0.0

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = optax_accum.NNXOptimizer(model, _tx(), wrt=nnx.Param)
    assert float(optax_accum.recorded_global_norm(nnx.as_pure(optimizer.opt_state))) == 0.0
