"""Malformed calls to as_reduced and unreduced_grad get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _bad_inputs import Bad, check, ids
from jax.sharding import PartitionSpec as P

import optax_accum


def _explicit_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _under_mesh(call):
    """`call` under an explicit 8-device mesh."""

    def run():
        with jax.set_mesh(_explicit_mesh()):
            return call()

    return run


def _loss(params, x):
    return jnp.mean(x @ params["w"])


BAD: list[Bad] = [
    Bad(
        "as_reduced/axes=[]",
        lambda: optax_accum.as_reduced({"w": jnp.zeros(3)}, []),
        TypeError,
        r"axes must be a mesh axis name or a non-empty sequence of them, got \[\]",
    ),
    Bad(
        "as_reduced/params on no mesh",
        lambda: optax_accum.as_reduced({"w": jnp.zeros(3)}, "data"),
        ValueError,
        r"params\['w'\] must be on a mesh with explicit axes",
    ),
    Bad(
        "as_reduced/params sharded over the axis",
        _under_mesh(
            lambda: optax_accum.as_reduced({"w": jax.reshard(jnp.zeros(8), P("data"))}, "data")
        ),
        ValueError,
        r"params\['w'\] must not be sharded over the batch axes \['data'\]",
    ),
    Bad(
        "unreduced_grad/fun=3",
        lambda: optax_accum.unreduced_grad(3, "data"),
        TypeError,
        r"fun must be callable, got 3 \(int\)",
    ),
    Bad(
        "unreduced_grad/argnums='0'",
        lambda: optax_accum.unreduced_grad(_loss, "data", argnums="0"),
        TypeError,
        r"argnums must be an int, got '0' \(str\)",
    ),
    Bad(
        "unreduced_grad/no mesh",
        lambda: optax_accum.unreduced_grad(_loss, "data")({"w": jnp.zeros(3)}, jnp.ones((8, 3))),
        ValueError,
        r"unreduced_grad needs a mesh with explicit axes set with jax\.set_mesh",
    ),
    Bad(
        "unreduced_grad/an axis that names no mesh axis",
        _under_mesh(
            lambda: optax_accum.unreduced_grad(_loss, "batch")(
                {"w": jnp.zeros(3)}, jax.reshard(jnp.ones((8, 3)), P("data"))
            )
        ),
        ValueError,
        r"axes must name axes of the mesh \('data',\), got \['batch'\]",
    ),
    Bad(
        "unreduced_grad/a batch not split over the axis",
        _under_mesh(
            lambda: optax_accum.unreduced_grad(_loss, "data")({"w": jnp.zeros(3)}, jnp.ones((8, 3)))
        ),
        ValueError,
        r"axes must be mesh axes the batch is split over, got \['data'\]",
    ),
    Bad(
        "unreduced_grad/argnums out of range",
        _under_mesh(
            lambda: optax_accum.unreduced_grad(_loss, "data", argnums=2)(
                {"w": jnp.zeros(3)}, jax.reshard(jnp.ones((8, 3)), P("data"))
            )
        ),
        ValueError,
        r"argnums=2 names no argument of the 2 given",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
