"""Malformed calls to to_checkpoint, from_checkpoint and upgrade_checkpoint get a clear
error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import Bad, check, ids
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat


def _on_abstract_mesh() -> dict:
    """What `jax.eval_shape` gives of params typed reduced: on an abstract mesh."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = NamedSharding(mesh.abstract_mesh, P(None, reduced={"data"}))
    return {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding)}


def _a_sum() -> jax.Array:
    """A running sum typed unreduced, as a state holds it (a checkpoint holds it plain)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        params = optax_accum.as_reduced({"w": jnp.zeros(3)}, "data")
        state = optax_accum.conditional_accumulator(optax.sgd(0.1), 2).init(params)
    return next(x for x in jax.tree.leaves(state) if _compat.sum_types(x)[1])


BAD: list[Bad] = [
    Bad(
        "from_checkpoint/saved of another structure",
        lambda: optax_accum.from_checkpoint({"w": jnp.zeros(3)}, {"w": jnp.zeros(3), "b": 0.0}),
        ValueError,
        r"saved must have like's structure \(restore into the shapes of the same "
        r"transform's init on the same params\)",
    ),
    Bad(
        "from_checkpoint/a leaf of another shape",
        lambda: optax_accum.from_checkpoint({"w": jnp.zeros(4)}, {"w": jnp.zeros(3)}),
        ValueError,
        r"saved\['w'\] must have like\['w'\]'s shape and dtype float32\[3\], got "
        r"float32\[4\]: restore the checkpoint of the same transform on the same params",
    ),
    Bad(
        "from_checkpoint/a leaf of another dtype",
        lambda: optax_accum.from_checkpoint({"w": jnp.zeros(3, jnp.int32)}, {"w": jnp.zeros(3)}),
        ValueError,
        r"saved\['w'\] must have like\['w'\]'s shape and dtype float32\[3\], got int32\[3\]",
    ),
    Bad(
        "upgrade_checkpoint/a field the checkpoint lacks",
        lambda: optax_accum.upgrade_checkpoint(
            {"global_step": 0},
            optax_accum.drop_stale_gradients(optax.sgd(1.0), 0).init(jnp.zeros(2)),
        ),
        ValueError,
        r"the checkpoint holds no tree\['num_dropped'\] \(nor \[\]\)",
    ),
]

# Reduced and unreduced types are jax 0.10's: on an older jax these calls cannot be made
# (tests/test_unreduced_versions.py checks what as_reduced says there instead).
if _compat.has_sum_types():
    BAD += [
        Bad(
            "from_checkpoint/like on an abstract mesh, none set",
            lambda: optax_accum.from_checkpoint({"w": jnp.zeros(3)}, _on_abstract_mesh()),
            ValueError,
            r"like\['w'\] must have a sharding on a concrete mesh, or on the abstract mesh "
            r"of the mesh set with jax\.set_mesh, got float32\[3\]\{R:data\} on .* with no "
            r"mesh set: call this under jax\.set_mesh\(mesh\)",
        ),
        Bad(
            "to_checkpoint/abstract values on an abstract mesh, none set",
            lambda: optax_accum.to_checkpoint(_on_abstract_mesh()),
            ValueError,
            r"tree\['w'\] must have a sharding on a concrete mesh, or on the abstract mesh "
            r"of the mesh set with jax\.set_mesh, got float32\[3\]\{R:data\} on .* with no "
            r"mesh set",
        ),
        Bad(
            "from_checkpoint/saved typed unreduced, as the state",
            lambda: optax_accum.from_checkpoint({"w": _a_sum()}, {"w": jnp.zeros(3)}),
            ValueError,
            r"saved\['w'\] must be typed plain, as to_checkpoint gives it, got "
            r"float32\[3\]\{U:data\}: pass what to_checkpoint returned, or a restore of it",
        ),
    ]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
