"""Malformed calls to replica_group_mesh, state_partition_specs and state_shardings get
a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _bad_inputs import Bad, accumulator_tx, check, ids, mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum


def _on_two_meshes() -> dict:
    devices = jax.devices()
    first = jax.sharding.Mesh(devices[:4], ("fsdp",))
    second = jax.sharding.Mesh(devices[4:], ("fsdp",))
    return {
        "w": jax.device_put(jnp.zeros(4), NamedSharding(first, P("fsdp"))),
        "v": jax.device_put(jnp.zeros(4), NamedSharding(second, P("fsdp"))),
    }


BAD: list[Bad] = [
    Bad(
        "state_shardings/params without a NamedSharding",
        lambda: optax_accum.state_shardings(accumulator_tx(), {"w": jnp.zeros(3)}),
        ValueError,
        r"params\['w'\] must have a NamedSharding \(place it with jax\.device_put",
    ),
    Bad(
        "state_shardings/a ShapeDtypeStruct without a sharding",  # jax.eval_shape's output
        lambda: optax_accum.state_shardings(
            accumulator_tx(), jax.eval_shape(lambda: {"w": jnp.zeros(3)})
        ),
        ValueError,
        r"params\['w'\] must have a NamedSharding \(an abstract value takes it as an "
        r"argument: jax\.ShapeDtypeStruct\(x\.shape, x\.dtype, "
        r"sharding=NamedSharding\(mesh, spec\)\), or jax\.eval_shape of a jax\.jit given "
        r"out_shardings\), got None",
    ),
    Bad(
        "state_shardings/params on two meshes",
        lambda: optax_accum.state_shardings(accumulator_tx(), _on_two_meshes()),
        ValueError,
        r"params must lie on one mesh, got 2 meshes",
    ),
    Bad(
        "state_shardings/tx='sgd'",
        lambda: optax_accum.state_shardings("sgd", {}),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "replica_group_mesh/empty group_assignment",
        lambda: optax_accum.replica_group_mesh([]),
        ValueError,
        r"group_assignment must be a non-empty list of list, got \[\]",
    ),
    Bad(
        "replica_group_mesh/too few replicas",
        lambda: optax_accum.replica_group_mesh([[0, 1], [2, 3]]),
        ValueError,
        r"group_assignment must be a permutation of range\(8\) \(the number of devices\), "
        r"got the 4 replica ids",
    ),
    Bad(
        "replica_group_mesh/axis_names",
        lambda: optax_accum.replica_group_mesh([[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("a", "a")),
        ValueError,
        r"axis_names must be two distinct names, got \('a', 'a'\)",
    ),
    Bad(
        "state_partition_specs/grad_axes",
        lambda: optax_accum.state_partition_specs(
            accumulator_tx(axis_name="data"), jnp.zeros(3), mesh8(), grad_axes=("model",)
        ),
        ValueError,
        r"grad_axes must name axes of the mesh \('data',\), got \['model'\]",
    ),
    Bad(
        "state_partition_specs/mesh=None",
        lambda: optax_accum.state_partition_specs(accumulator_tx(), jnp.zeros(3), None),
        TypeError,
        r"mesh must be a jax\.sharding\.Mesh, got None \(NoneType\)",
    ),
    Bad(
        "state_partition_specs/tx='sgd'",
        lambda: optax_accum.state_partition_specs("sgd", jnp.zeros(3), mesh8()),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "state_partition_specs/scalar state leaf that differs between replicas",
        lambda: optax_accum.state_partition_specs(
            accumulator_tx(skip_nonfinite=True), jnp.zeros(3), mesh8()
        ),
        ValueError,
        r"state.*is a scalar that differs between replicas",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
