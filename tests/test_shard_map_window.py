"""One reduction per window under `jax.shard_map`, counted in the compiled programs.

The guide's data-parallel step (gradients with respect to the replica's own copy of
the params, state specs from `state_partition_specs`) over 8 devices, for every
accumulating transform with `axis_name` and the step shapes users write (each
transform in one of them: `MAIN` and `FLAX` say which, and why). Checked:

- XLA:CPU (the 0/1-trip loop form): no gradient-sized collective runs on every step,
  and the release reduces each dense leaf once (XLA may pack them into one);
- TPU and GPU lowerings (the `lax.cond` form): the same, the reductions inside the
  conditional's branch;
- the values: 8 steps with a release, a stale gradient and weights equal, in float64
  to 1e-9, the same program under `jax.vmap` on one device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam
from _hlo import Collective, collectives
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

N = 8  # replicas
STEPS = 8
ROWS = 64  # rows of the embedding table of the sparse cases
WIDTH = 16


@pytest.fixture(autouse=True)
def _x64():
    with _compat.enable_x64():
        yield


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _dense_params() -> dict:
    return {
        "w": jnp.asarray(np.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)),
        "b": jnp.zeros(WIDTH),
    }


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _dense_grads(mine: dict, data: dict) -> dict:
    return jax.grad(_loss)({"w": mine["w"], "b": mine["b"]}, data["x"], data["y"])


def _sparse_grads(mine: dict, data: dict) -> dict:
    rows = optax_accum.IndexedSlices(data["ids"], data["rows"], (ROWS, 4))
    return {**_dense_grads(mine, data), "e": rows}


def _data() -> dict:
    """Each step's per-replica inputs, stacked: (STEPS, N, ...)."""
    rng = np.random.default_rng(0)
    lag = np.zeros((STEPS, N), np.int32)
    lag[3, 5] = lag[6, 1] = 1  # stale: tagged one step behind the global step
    weight = rng.uniform(0.5, 2.0, size=(STEPS, N))
    weight[2, 4] = 0.0
    return {
        "x": rng.normal(size=(STEPS, N, 2, 4)),
        "y": rng.normal(size=(STEPS, N, 2, WIDTH)),
        "ids": rng.integers(0, ROWS, size=(STEPS, N, 2)).astype(np.int32),
        "rows": rng.normal(size=(STEPS, N, 2, 4)),
        "lag": lag,
        "weight": weight,
    }


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], optax.GradientTransformation]
    sparse: bool = False  # a sparse accumulator; params hold a table "e" (64 x 4)
    tagged: bool = True  # takes local_step and weight


def _ca(inner: Any, k: int = 2 * N) -> Any:
    return optax_accum.conditional_accumulator(inner, k, axis_name="data")


def _sparse(sparse: dict) -> Any:
    inner = optax_accum.sparse_sgd(0.1)
    return optax_accum.sparse_conditional_accumulator(
        inner, 2 * N, capacity=4 * N, sparse=sparse, axis_name="data"
    )


CASES = [
    Case("conditional_accumulator", lambda: _ca(adam(0.1))),
    Case("sparse_dense_leaves", lambda: _sparse({"w": False, "b": False, "e": False}), True),
    Case("sparse_row_leaves", lambda: _sparse({"w": False, "b": False, "e": True}), True),
    Case(
        "drop_stale",
        lambda: optax_accum.drop_stale_gradients(_ca(adam(0.1)), 0, axis_name="data"),
    ),
    Case("nest", lambda: _ca(optax_accum.conditional_accumulator(adam(0.1), 2), N)),
    Case("agn", lambda: optax_accum.agn(adam(0.1), 4, axis_name="data"), tagged=False),
]


def _params(case: Case) -> dict:
    params = _dense_params()
    if case.sparse:
        params["e"] = jnp.asarray(np.linspace(0.0, 1.0, ROWS * 4).reshape(ROWS, 4))
    return params


def _grads_of(case: Case) -> Callable:
    return _sparse_grads if case.sparse else _dense_grads


def _apply(case: Case) -> Callable:
    return optax_accum.apply_updates if case.sparse else optax.apply_updates


# --------------------------------------------------------------------------- steps
#
# `step(tx, case, params, state, data, vary)`: `vary` types the params as this replica's
# own (the guide's `pcast`) under shard_map, and is the identity under vmap.


def _extra(case: Case, data: dict) -> dict:
    return {"local_step": data["tag"], "weight": data["weight"]} if case.tagged else {}


def _canonical(tx, case, params, state, data, vary):
    mine = vary(params)
    grads = _grads_of(case)(mine, data)
    updates, state = tx.update(grads, state, mine, **_extra(case, data))
    return _apply(case)(params, updates), state


def _apply_gradients(tx, case, params, state, data, vary):
    grads = _grads_of(case)(vary(params), data)
    return optax_accum.apply_gradients(tx, grads, state, params, **_extra(case, data))


def _train_state(tx, case, params, state, data, vary):
    """`optax_accum.TrainState.apply_gradients`, on a state made of the step's inputs."""
    grads = _grads_of(case)(vary(params), data)
    ts = optax_accum.TrainState(
        step=jnp.zeros((), jnp.int32), apply_fn=None, params=params, tx=tx, opt_state=state
    )
    ts = ts.apply_gradients(grads=grads, **_extra(case, data))
    return ts.params, ts.opt_state


def _nnx_optimizer(tx, case, params, state, data, vary):
    """`optax_accum.NNXOptimizer.update` on a model holding the params, its state
    replaced by the step's input (as `nnx.merge` of a split optimizer would give)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, tree: dict):
            self.w, self.b = nnx.Param(tree["w"]), nnx.Param(tree["b"])

    model = Model(params)
    optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)
    nnx.update(optimizer.opt_state, nnx.state(state))
    optimizer.update(model, Model(_grads_of(case)(vary(params), data)), **_extra(case, data))
    # The optimizer holds the params' dicts as nnx States: the input's structure again.
    new_state = jax.tree.leaves(nnx.as_pure(optimizer.opt_state))
    return {"w": model.w[...], "b": model.b[...]}, jax.tree.structure(state).unflatten(new_state)


STEP_SHAPES = {"canonical": _canonical, "apply_gradients": _apply_gradients}
FLAX_SHAPES = {"train_state": _train_state, "nnx_optimizer": _nnx_optimizer}


def _local(tree: Any) -> Any:
    """A replica's slice of the stacked per-replica inputs, without its leading axis."""
    return jax.tree.map(lambda a: a[0], tree)


def _example(case: Case) -> dict:
    """One replica's inputs, to trace the gradients' shapes with."""
    data = {k: v[0, 0] for k, v in _data().items() if k not in ("lag",)}
    data["tag"] = np.int32(0)
    return jax.tree.map(jnp.asarray, data)


def _sharded(case: Case, step: Callable) -> tuple[Callable, Any]:
    """The guide's step under shard_map, jitted with the state donated, and the state."""
    tx, mesh, params = case.make(), _mesh(), _params(case)
    per_worker = case.name == "agn"  # each worker steps its own params
    grads = jax.eval_shape(_grads_of(case), params, _example(case))
    extra = {"local_step": 0, "weight": 1.0} if case.tagged else {}
    axes = ("data",) if per_worker else ()
    specs = optax_accum.state_partition_specs(
        tx, params, mesh, grads=grads, param_axes=axes, **extra
    )
    param_spec = P("data") if per_worker else P()
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.jit(init)(params)

    def body(params, state, data):
        if per_worker:
            params = _local(params)
        vary = (
            (lambda p: p)
            if per_worker
            else functools.partial(_compat.pcast_varying, axis_name="data")
        )
        params, state = step(tx, case, params, state, _local(data), vary)
        return (jax.tree.map(lambda p: p[None], params) if per_worker else params), state

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(param_spec, specs, P("data")), out_specs=(param_spec, specs)
    )
    return jax.jit(mapped, donate_argnums=(1,)), state


@functools.cache
def _one_device(name: str, tags: bytes) -> dict:
    """The params after the same program under `jax.vmap` on one device, every input
    stacked per replica, in the canonical step (`apply_gradients` must give the same
    numbers, so both step shapes compare with one run). `tags`: each step's local_step
    tags, as the sharded run saw them."""
    case = next(c for c in CASES if c.name == name)
    tx, data = case.make(), _data()
    tags = np.frombuffer(tags, np.int32).reshape(STEPS, N)
    stacked = jax.tree.map(lambda p: jnp.stack([p] * N), _params(case))
    state = jax.jit(jax.vmap(tx.init))(stacked)  # one compile, not one per operation
    body = functools.partial(_canonical, tx, case, vary=lambda p: p)
    fn = jax.jit(jax.vmap(body, axis_name="data"))
    for t in range(STEPS):
        inputs = _inputs(lambda: 0)(t, data)
        stacked, state = fn(stacked, state, {**inputs, "tag": jnp.asarray(tags[t])})
    return stacked


def _inputs(state_step: Callable[[], int]) -> Callable[[int, dict], dict]:
    """Step t's per-replica inputs; tags lag the global step where `_data` says."""

    def at(t: int, data: dict) -> dict:
        out = {k: v[t] for k, v in data.items() if k in ("x", "y", "ids", "rows", "weight")}
        out["tag"] = (state_step() - data["lag"][t]).astype(np.int32)
        return jax.tree.map(jnp.asarray, out)

    return at


# --------------------------------------------------------------------------- the tests


def _released_nbytes(case: Case, params: dict) -> int:
    """What a release reduces: each dense leaf once, and for `DenseRows` (the sparse
    accumulator's dense leaves) its int32 count of gradients per row."""
    dense = {k: p for k, p in params.items() if not (case.name == "sparse_row_leaves" and k == "e")}
    rows = sum(p.shape[0] for p in dense.values()) if case.sparse else 0
    return sum(p.nbytes for p in dense.values()) + 4 * rows


def _gradient_sized(c: Collective, case: Case) -> bool:
    """A collective of at least the smallest leaf's bytes. The sparse accumulator's
    gathers of each replica's rows on every step are by design; they must stay smaller
    than the table."""
    if c.opcode == "all-gather" and case.sparse:
        return c.nbytes >= ROWS * 4 * 8
    return c.nbytes >= min(p.nbytes for p in _dense_params().values())


def _check_window(found: list[Collective], case: Case) -> None:
    every = [c for c in found if c.every_step and _gradient_sized(c, case)]
    assert not every, f"gradient-sized collectives on every step: {every}"
    released = [c for c in found if not c.every_step]
    assert {c.opcode for c in released} == {"all-reduce"}, released
    # Each dense leaf is reduced once in the release (XLA may pack them into one).
    expected = _released_nbytes(case, _params(case))
    assert sum(c.nbytes for c in released) == expected, (released, expected)


# Each transform in one step shape (every transform and every step shape covered, not
# every pair: the step shape reaches the release through `tx.update` or through
# apply_gradients' fused sink, the same code whatever the transform; agn never fuses,
# so its apply_gradients is its canonical step). Sparse accumulators: one canonical
# (dense leaves), one fused (row leaves); drop_stale and the nest the other way round
# from tests/test_unreduced.py, which runs them under jax.jit with explicit sharding.
# conditional_accumulator's fused step runs below, as TrainState's.
MAIN = [
    ("conditional_accumulator", "canonical"),
    ("sparse_dense_leaves", "canonical"),
    ("sparse_row_leaves", "apply_gradients"),
    ("drop_stale", "canonical"),
    ("nest", "apply_gradients"),
    ("agn", "apply_gradients"),
]
# Each Flax step shape once, each with one of the transforms above.
FLAX = [("conditional_accumulator", "train_state"), ("drop_stale", "nnx_optimizer")]
_BY_NAME = {c.name: c for c in CASES}


@pytest.mark.parametrize(
    ("case", "shape"),
    [(_BY_NAME[name], shape) for name, shape in MAIN],
    ids=[f"{name}-{shape}" for name, shape in MAIN],
)
def test_one_reduction_per_window_and_the_values_of_one_device(case, shape):
    _check_step(case, STEP_SHAPES[shape])


@pytest.mark.flax
@pytest.mark.parametrize(
    ("case", "shape"),
    [(_BY_NAME[name], shape) for name, shape in FLAX],
    ids=[f"{name}-{shape}" for name, shape in FLAX],
)
def test_flax_steps_reduce_once_per_window(case, shape):
    _check_step(case, FLAX_SHAPES[shape])


def _check_step(case: Case, step: Callable) -> None:
    fn, state = _sharded(case, step)
    params, data = _params(case), _data()
    if case.name == "agn":
        params = jax.tree.map(lambda p: jnp.stack([p] * N), params)
    args = (params, state, _inputs(lambda: 0)(0, data))
    traced = fn.trace(*args)  # one trace, lowered for each platform
    compiled = traced.lower().compile()
    _check_window(collectives(compiled), case)
    for platform in ("tpu", "cuda"):
        lowered = traced.lower(lowering_platforms=(platform,)).as_text(dialect="hlo")
        _check_window(collectives(lowered), case)

    at, steps = _inputs(lambda: int(optax_accum.global_step(state))), []
    for t in range(STEPS):
        steps.append(at(t, data))
        # The program checked above runs the steps: calling `fn` would compile it again
        # (the first call's params are not yet placed on the mesh).
        params, state = compiled(params, state, steps[-1])
    assert int(optax_accum.global_step(state)) >= 2, "the data must exercise the release"
    if case.tagged:  # the stale gradients were offered and dropped
        assert int(state.num_dropped) > 0
    tags = np.stack([np.asarray(inputs["tag"]) for inputs in steps])
    expected = _one_device(case.name, tags.astype(np.int32).tobytes())
    got = params if case.name == "agn" else jax.tree.map(lambda p: jnp.stack([p] * N), params)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=1e-12, err_msg=name)
