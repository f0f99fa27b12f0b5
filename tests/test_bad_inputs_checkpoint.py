"""Malformed calls to to_checkpoint and from_checkpoint get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _bad_inputs import Bad, check, ids, mesh8
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum


def _on_abstract_mesh() -> dict:
    """What `jax.eval_shape` gives under `jax.set_mesh`: shardings on an abstract mesh."""
    sharding = NamedSharding(mesh8().abstract_mesh, P())
    return {"w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding)}


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
        "from_checkpoint/like on an abstract mesh, none set",
        lambda: optax_accum.from_checkpoint({"w": jnp.zeros(3)}, _on_abstract_mesh()),
        ValueError,
        r"like\['w'\] must have a sharding on a concrete mesh, or on the abstract mesh of "
        r"the mesh set with jax\.set_mesh, got one on .* with no mesh set: call this under "
        r"jax\.set_mesh\(mesh\)",
    ),
    Bad(
        "to_checkpoint/abstract values on an abstract mesh, none set",
        lambda: optax_accum.to_checkpoint(_on_abstract_mesh()),
        ValueError,
        r"tree\['w'\] must have a sharding on a concrete mesh, or on the abstract mesh of "
        r"the mesh set with jax\.set_mesh, got one on .* with no mesh set",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
