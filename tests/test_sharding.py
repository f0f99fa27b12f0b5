"""replica_group_mesh and state_partition_specs: groups as a mesh axis, and state specs
that let shard_map training match the same program under vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import replica_group_mesh, state_partition_specs

AUTO = jax.sharding.AxisType.Auto


def _mesh(shape=(8,), names=("i",)) -> Mesh:
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape))


# --------------------------------------------------------------------------- replica_group_mesh


@pytest.mark.parametrize("groups", [[[0, 3, 5, 6], [1, 2, 4, 7]], [[6, 1], [0, 7], [5, 2], [3, 4]]])
def test_group_mesh_reduces_within_groups_with_plain_all_reduces(groups):
    mesh = replica_group_mesh(groups)
    assert dict(mesh.shape) == {"group": len(groups), "replica": len(groups[0])}
    devices = jax.devices()
    for gi, g in enumerate(groups):
        assert [d.id for d in mesh.devices[gi]] == [devices[r].id for r in g]

    tx = optax_accum.cross_shard("replica")
    spec = P(("group", "replica"))
    step = jax.jit(
        jax.shard_map(
            lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=spec, out_specs=spec
        )
    )
    grads = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    order = np.ravel(groups)
    out = np.asarray(step(jnp.asarray(grads[order])))[np.argsort(order)]
    for g in groups:
        np.testing.assert_allclose(
            out[g], np.broadcast_to(grads[g].mean(0), (len(g), 3)), rtol=1e-6
        )
    hlo = step.lower(jnp.asarray(grads)).compile().as_text()
    assert "all-reduce" in hlo and "collective-permute" not in hlo


@pytest.mark.parametrize(
    ("groups", "kwargs", "message"),
    [
        ([[0, 1], [2, 3]], {}, r"must be a permutation of range\(8\)"),
        ([], {}, "must be a non-empty list of list"),
        ([[0, 1, 2], [3]], {}, "size of each subgroup"),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], {"axis_names": ("a", "a")}, "axis_names must be two"),
    ],
)
def test_group_mesh_bad_input(groups, kwargs, message):
    with pytest.raises(ValueError, match=message):
        replica_group_mesh(groups, **kwargs)


def test_group_mesh_on_a_subset_of_devices():
    mesh = replica_group_mesh([[1, 0], [3, 2]], devices=jax.devices()[4:])
    assert [[d.id for d in row] for row in mesh.devices] == [
        [jax.devices()[5].id, jax.devices()[4].id],
        [jax.devices()[7].id, jax.devices()[6].id],
    ]


# --------------------------------------------------------------------------- state specs


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


def _grads(steps=5):
    rng = np.random.default_rng(1)
    return [
        {
            "w": rng.normal(size=(8, 2, 3)).astype(np.float32),
            "b": rng.normal(size=(8, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def test_specs_of_the_shared_accumulator():
    tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 16, axis_name="i")
    specs = state_partition_specs(tx, _params(), _mesh(), local_step=0)
    assert specs.storage == {"w": P("i"), "b": P("i")}
    assert all(s == P() for s in jax.tree.leaves(specs._replace(storage=None)))


def test_specs_of_plain_adam_and_of_cross_shard_adam():
    specs = state_partition_specs(adam(0.1), _params(), _mesh())
    scale = specs[0]  # adam is chain(scale_by_adam, scale)
    assert scale.count == P() and scale.mu == {"w": P("i"), "b": P("i")}
    specs = state_partition_specs(
        optax_accum.cross_shard_optimizer(adam(0.1), "i"), _params(), _mesh()
    )
    assert all(s == P() for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))


def test_specs_on_a_2d_mesh_with_grad_axes():
    mesh = _mesh((2, 4), ("pod", "data"))
    tx = optax_accum.conditional_accumulator(optax.sgd(0.1), 8, axis_name="data")
    specs = state_partition_specs(tx, _params(), mesh, grad_axes=("data",))
    assert specs.storage == {"w": P("data"), "b": P("data")}
    specs = state_partition_specs(tx, _params(), mesh)  # gradients differ over both axes
    assert specs.storage["w"] == P(("pod", "data"))


def test_varying_scalar_state_raises():
    # A per-replica running sum of the gradients: a scalar that differs per replica.
    tx = optax.GradientTransformation(
        lambda params: jnp.zeros(()),
        lambda updates, state, params=None: (updates, state + jnp.sum(updates["b"])),
    )
    with pytest.raises(ValueError, match=r"state is a scalar that differs between replicas"):
        state_partition_specs(tx, _params(), _mesh())
    with pytest.raises(ValueError, match="grad_axes must name axes of the mesh"):
        state_partition_specs(tx, _params(), _mesh(), grad_axes=("x",))


def _run_vmap(tx, grads, extra):
    params = jax.tree.map(lambda x: jnp.stack([x] * 8), _params())
    state = jax.vmap(tx.init)(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p, **extra)
        return optax.apply_updates(p, u), s

    fn = jax.jit(jax.vmap(step, axis_name="i"))
    for g in grads:
        params, state = fn(params, state, g)
    return params, state


def _run_shard_map(tx, grads, extra, specs):
    mesh = _mesh()
    params = jax.tree.map(lambda x: jnp.stack([x] * 8), _params())  # per-replica copies
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(_params())

    def first(t):
        return jax.tree.map(lambda x: x[0], t)

    def add(t):
        return jax.tree.map(lambda x: x[None], t)

    def body(p, s, g):
        u, s = tx.update(first(g), s, first(p), **extra)
        return add(optax.apply_updates(first(p), u)), s

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("i"), specs, P("i")), out_specs=(P("i"), specs))
    )
    for g in grads:
        params, state = fn(params, state, g)
    return params, state


@pytest.mark.parametrize(
    ("make", "param_axes"),
    [
        (lambda: optax_accum.conditional_accumulator(adam(0.1), 12, axis_name="i"), ()),
        (lambda: optax_accum.agn(optax.sgd(0.1, momentum=0.9), 2, axis_name="i"), ("i",)),
        (lambda: optax_accum.drop_stale_gradients(optax.sgd(0.1), 0, axis_name="i"), ()),
    ],
    ids=["conditional_accumulator", "agn", "drop_stale_gradients"],
)
def test_shard_map_with_derived_specs_matches_vmap(make, param_axes):
    tx, grads, extra = make(), _grads(), {"local_step": jnp.int32(0)}
    specs = state_partition_specs(tx, _params(), _mesh(), param_axes=param_axes, **extra)
    ref_params, ref_state = _run_vmap(tx, grads, extra)
    params, state = _run_shard_map(tx, grads, extra, specs)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), params, ref_params
    )

    def same(spec, got, ref):
        ref = np.asarray(ref)
        ref = ref[0] if spec == P() else ref.reshape(-1, *ref.shape[2:])  # stacked along dim 0
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-7)

    jax.tree.map(same, specs, state, ref_state, is_leaf=lambda x: isinstance(x, P))
