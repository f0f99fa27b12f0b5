"""Unreduced gradients on every supported jax: they work where jax has reduced and
unreduced sharding types (0.10 and newer, tests/test_unreduced.py), and on an older jax
`as_reduced` and `unreduced_grad` raise an error that names the jax they need, instead
of failing somewhere inside JAX. This file runs in the oldest-versions run too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import optax_accum
from optax_accum import _compat


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def test_as_reduced_types_the_params_or_names_the_jax_it_needs():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        params = {"w": jnp.ones((4, 2))}
        if not _compat.has_sum_types():
            with pytest.raises(RuntimeError, match=r"jax 0\.10 or newer.*" + jax.__version__):
                optax_accum.as_reduced(params, "data")
            return
        reduced = optax_accum.as_reduced(params, "data")
    assert jax.typeof(reduced["w"]).sharding.spec.reduced == frozenset({"data"})


def test_unreduced_grad_or_names_the_jax_it_needs():
    loss = lambda p, x: jnp.sum(x @ p["w"])  # noqa: E731
    mesh = _mesh()
    with jax.set_mesh(mesh):
        params = {"w": jnp.ones((4, 2))}
        x = jax.device_put(jnp.ones((8, 4)), jax.sharding.PartitionSpec("data"))
        if not _compat.has_sum_types():
            with pytest.raises(RuntimeError, match=r"jax 0\.10 or newer.*" + jax.__version__):
                jax.jit(optax_accum.unreduced_grad(loss, "data"))(params, x)
            return
        grads = jax.jit(optax_accum.unreduced_grad(loss, "data"))(params, x)
    assert jax.typeof(grads["w"]).sharding.spec.unreduced == frozenset({"data"})
