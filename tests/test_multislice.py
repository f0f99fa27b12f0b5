"""Two-level meshes (multi-slice pods): average over the fast axis on every step, over
the slow one once per window.

Across TPU slices the network is far slower than within one. On a (slice=2, data=4)
mesh, `optax.chain(cross_shard("data"), conditional_accumulator(inner, k,
axis_name="slice"))` averages the gradient within each slice on every step and sums the
accumulated windows across slices only when it releases. The program says so: the
gradient all-reduce over `data` runs on every step, the one over `slice` only inside
the release branch (on every step `slice` carries one int32 scalar, the count of
accepted gradients). And it trains as one device does on the global batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

K = 2  # micro-steps per window
SLICES = 2  # each step, every slice offers one gradient (its slice's mean)
STEPS = 6


def _mesh():
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 4), ("slice", "data"), axis_types=(auto, auto))


def _tx():
    return optax.chain(
        optax_accum.cross_shard("data"),
        optax_accum.conditional_accumulator(optax.sgd(0.3), K * SLICES, axis_name="slice"),
    )


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(5, 3))), "b": jnp.zeros(3)}


def _data():
    rng = np.random.default_rng(1)
    return [(rng.normal(size=(16, 5)), rng.normal(size=(16, 3))) for _ in range(STEPS)]


def _sharded(tx, params):
    """The train step under `jax.shard_map`, and the init that makes its state: each
    slice keeps its own window sum (`state_partition_specs` says which leaves differ)."""
    mesh = _mesh()
    specs = optax_accum.state_partition_specs(tx, params, mesh)

    def step(params, state, x, y):
        # This replica's own gradient, on its 2 examples.
        grads = jax.grad(_loss)(_compat.pcast_varying(params, ("slice", "data")), x, y)
        return optax_accum.apply_gradients(tx, grads, state, params)

    rep, batch = P(), P(("slice", "data"))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=rep, out_specs=specs))
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(rep, specs, batch, batch), out_specs=(rep, specs))
    )
    return step, init


def _sub_jaxprs(params: dict):
    """The jaxprs an equation holds (branches, loop bodies, a shard_map's body)."""
    for value in params.values():
        for x in value if isinstance(value, tuple | list) else (value,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _psums(jaxpr, inside: bool = False, found=None) -> list:
    """(axes, abstract value, whether inside a branch or loop) of every psum."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("psum", "psum_invariant"):  # jax 0.8, jax >= 0.9
            axes = tuple(eqn.params["axes"])
            found.extend((axes, v.aval, inside) for v in eqn.invars)
        branchy = eqn.primitive.name in ("cond", "while")
        for sub in _sub_jaxprs(eqn.params):
            _psums(sub, inside or branchy, found)
    return found


def test_fast_axis_every_step_slow_axis_only_on_release():
    tx = _tx()
    params = _params()
    step, init = _sharded(tx, params)
    state = jax.eval_shape(init, params)  # only traced: nothing to compile or run
    x, y = (jnp.asarray(a) for a in _data()[0])
    jaxpr = jax.make_jaxpr(step)(params, state, x, y).jaxpr
    psums = _psums(jaxpr)
    assert psums, "no psum found: has jax renamed the primitive?"
    every_step = [(axes, aval) for axes, aval, inside in psums if not inside]
    on_release = [(axes, aval) for axes, aval, inside in psums if inside]
    leaf_shapes = sorted(p.shape for p in jax.tree.leaves(params))
    # On every step: the gradient's mean within the slice, leaf by leaf...
    fast = sorted(a.shape for axes, a in every_step if axes == ("data",))
    assert fast == leaf_shapes, every_step
    # ...and across slices only the integer counts of accepted gradients.
    slow = [a for axes, a in every_step if "slice" in axes]
    assert slow and all(jnp.issubdtype(a.dtype, jnp.integer) for a in slow), every_step
    # On release only (in each backend's form of the branch): the windows' sum across
    # slices, leaf by leaf.
    released = {a.shape for axes, a in on_release if axes == ("slice",)}
    assert sorted(released) == leaf_shapes, on_release
    assert not any("data" in axes for axes, _ in on_release), on_release


@pytest.mark.parametrize("dtype", [jnp.float64])
def test_two_level_mesh_trains_as_one_device_on_the_global_batch(dtype):
    with _compat.enable_x64():
        tx = _tx()
        params = jax.tree.map(lambda p: p.astype(dtype), _params())
        step, init = _sharded(tx, params)
        state = init(params)
        want = jax.tree.map(np.asarray, params)
        grad = jax.jit(jax.grad(_loss))  # the reference's gradient: one compile
        window = []
        for i, (x, y) in enumerate(_data()):
            params, state = step(params, state, jnp.asarray(x), jnp.asarray(y))
            window.append(grad(jax.tree.map(jnp.asarray, want), x, y))
            if (i + 1) % K == 0:  # SGD on the mean gradient of the window's global batches
                mean = jax.tree.map(lambda *g: sum(g) / K, *window)
                want = jax.tree.map(lambda p, g: p - 0.3 * np.asarray(g), want, mean)
                window = []
        for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-9, atol=1e-12)
        assert int(optax_accum.global_step(state)) == STEPS // K


def test_the_window_sum_over_slices_is_a_conditional_in_the_tpu_program():
    """What a TPU gets: the slow all-reduce sits in a `stablehlo.case` branch."""
    tx = _tx()
    params = _params()
    step, init = _sharded(tx, params)
    state = jax.eval_shape(init, params)  # only traced: nothing to compile or run
    x, y = (jnp.asarray(a) for a in _data()[0])
    traced = step.trace(params, state, x, y)
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "stablehlo.case" in text
    assert "stablehlo.while" not in text
    top, depth = [], 0
    for line in text.splitlines():
        if "stablehlo.all_reduce" in line and depth == 0:
            top.append(line)
        if "stablehlo.case" in line:
            depth += 1
        elif depth and line.strip().startswith("})"):
            depth -= 1
    assert top, "the fast all-reduces run outside any branch"
