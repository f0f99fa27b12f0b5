"""Malformed calls to as_reduced, unreduced_grad, unreduced_value_and_grad,
keep_reduction_axes, and record_global_norm on unreduced updates get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
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


def _batch() -> jax.Array:
    return jax.reshard(jnp.ones((8, 3)), P("data"))


def _closing_over_the_batch():
    """A loss that reads the batch from its closure, differentiated under jit."""

    def step(params, x, weights):
        loss = lambda p, w: jnp.mean((x @ p["w"]) * w)  # noqa: E731
        return optax_accum.unreduced_value_and_grad(loss, "data")(params, weights)

    with jax.set_mesh(_explicit_mesh()):
        params = optax_accum.as_reduced({"w": jnp.zeros(3)}, "data")
        jax.jit(step).trace(params, _batch(), jax.reshard(jnp.ones(8), P("data")))


def _bool_aux():
    loss = lambda p, x: (jnp.mean(x @ p["w"]), jnp.all(x > 0))  # noqa: E731
    with jax.set_mesh(_explicit_mesh()):
        fn = optax_accum.unreduced_value_and_grad(loss, "data", has_aux=True)
        jax.jit(fn).trace({"w": jnp.zeros(3)}, _batch())


def _record_unreduced_updates():
    tx = optax.chain(optax_accum.record_global_norm(), optax.sgd(0.1))
    with jax.set_mesh(_explicit_mesh()):
        params = optax_accum.as_reduced({"w": jnp.zeros(3)}, "data")
        grads = jax.eval_shape(optax_accum.unreduced_grad(_loss, "data"), params, _batch())
        jax.jit(tx.update).trace(grads, tx.init(params), params)


def _typed_like_rules(spec):
    """`keep_reduction_axes` of `spec` for a param typed reduced over "data"."""
    with jax.set_mesh(_explicit_mesh()):
        shapes = jax.eval_shape(lambda: optax_accum.as_reduced({"w": jnp.zeros((8, 2))}, "data"))
    return optax_accum.keep_reduction_axes(spec, shapes)


BAD += [
    Bad(
        "unreduced_value_and_grad/has_aux='yes'",
        lambda: optax_accum.unreduced_value_and_grad(_loss, "data", has_aux="yes"),
        TypeError,
        r"has_aux must be a bool, got 'yes' \(str\)",
    ),
    Bad(
        "unreduced_value_and_grad/fun closes over the batch",
        _closing_over_the_batch,
        ValueError,
        r"fun must take the arrays it reads as arguments: it closes over an array sharded",
    ),
    Bad(
        "unreduced_grad/fun reads the whole batch from a closure",
        _under_mesh(
            lambda: optax_accum.unreduced_grad(lambda p: _loss(p, _batch()), "data")(
                {"w": jnp.zeros(3)}
            )
        ),
        ValueError,
        r"If fun reads the batch from a closure, pass it as an argument instead",
    ),
    Bad(
        "unreduced_value_and_grad/a bool aux",
        _bool_aux,
        TypeError,
        r"aux values must be floats .* or integers \(summed\), got bool",
    ),
    Bad(
        "as_reduced/an abstract param with no sharding",
        lambda: optax_accum.as_reduced({"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, "data"),
        ValueError,
        r"params\['w'\] must be on a mesh with explicit axes .* got float32\[3\] with "
        r"sharding None",
    ),
    Bad(
        "keep_reduction_axes/a spec that shards over a reduced axis",
        lambda: _typed_like_rules({"w": P("data", None)}),
        ValueError,
        r"specs\['w'\] must not shard over \['data'\], which the leaf is typed reduced or "
        r"unreduced over",
    ),
    Bad(
        "keep_reduction_axes/specs for another tree",
        lambda: _typed_like_rules({"w": P(), "b": P()}),
        ValueError,
        r"specs must have one spec per leaf of like",
    ),
    Bad(
        "record_global_norm/updates typed unreduced",
        _record_unreduced_updates,
        TypeError,
        r"record_global_norm needs summed updates, but updates\['w'\] is typed unreduced "
        r"over \['data'\].*Put it inside an accumulator",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
