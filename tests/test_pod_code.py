"""Pod code as it is written, on the one-reduction path.

Training loops for large models (EasyLM, t5x) take the loss and metrics from the
forward pass that gives the gradients (`jax.value_and_grad(..., has_aux=True)`), pass
Python flags to the loss (`train=True`, a mode name), start from `jax.eval_shape` of
their init, and place the state with partition specs that regex rules give. Here:

- `unreduced_value_and_grad` and `unreduced_grad(has_aux=True)` give the loss and aux
  of the same pass, each device's share typed unreduced (their true values are
  `jax.value_and_grad`'s on one device, in float64), with no collective at all on a
  data-parallel mesh; Python bools, strings and ints reach the loss as they are,
  under `jax.jit`, positionally and by keyword;
- `as_reduced` and `state_shardings` take `jax.eval_shape`'s output (abstract
  values on an abstract mesh), and the jitted init they lead to gives the state
  `tx.init` gives on the arrays;
- `keep_reduction_axes` gives specs from rules the types of the state, and a state
  placed with specs that lost them gets a step error that names the fix.

tests/porting.md's EasyLM port runs all of it in one training loop.
"""

from __future__ import annotations

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


@pytest.fixture(autouse=True)
def _x64():
    with _compat.enable_x64():
        yield


def _data_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",))  # explicit axes: jax.make_mesh's default


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(6, 4)) / 2, "b": rng.normal(size=4), "v": rng.normal(size=(4, 2))}


def _batch() -> tuple:
    rng = np.random.default_rng(1)
    return rng.normal(size=(16, 6)), rng.normal(size=(16, 2))


def _loss(params, batch, train, mode, *, layers=1, reduce=jnp.mean):
    """A model with a bias and a centring (no dot-only rule applies), Python control
    flow on a bool, a string and an int, and aux metrics: a float and a count."""
    x, y = batch
    h = x @ params["w"] + params["b"]
    if train:
        h = 1.5 * h
    h = jnp.tanh(h) if mode == "tanh" else jax.nn.relu(h)
    for _ in range(layers):
        h = h - jnp.mean(h, axis=-1, keepdims=True)
    err = jnp.sum((h @ params["v"] - y) ** 2, axis=-1)
    good = err < 1.0
    return reduce(err), {"accuracy": jnp.mean(good.astype(err.dtype)), "count": jnp.sum(good)}


def _read(tree):
    """Each leaf by its true value: an unreduced share summed (the all-reduce)."""

    def read(x):
        if _compat.sum_types(x)[1]:
            x = _compat.retyped(x, reduced=_compat.sum_types(x)[0])
        return np.asarray(x)

    return jax.tree.map(read, tree)


def _assert_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(_read(got)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- value and aux


def test_value_and_grad_gives_the_loss_and_aux_of_the_same_pass_under_jit():
    params, batch = _params(), _batch()
    reference = jax.jit(
        lambda p, b: jax.value_and_grad(_loss, has_aux=True)(p, b, True, "tanh", layers=2)
    )
    (want_loss, want_aux), want_grads = reference(params, batch)
    fn = optax_accum.unreduced_value_and_grad(_loss, "data", has_aux=True)
    with jax.set_mesh(_data_mesh()):
        placed = optax_accum.as_reduced(jax.tree.map(jnp.asarray, params), "data")
        split = tuple(jax.reshard(jnp.asarray(x), P("data")) for x in batch)
        step = jax.jit(lambda p, b: fn(p, b, True, "tanh", layers=2))
        compiled = step.lower(placed, split).compile()
        (loss, aux), grads = compiled(placed, split)
    for x in (loss, *jax.tree.leaves(aux), *jax.tree.leaves(grads)):
        assert _compat.sum_types(x) == (frozenset(), frozenset({"data"})), jax.typeof(x)
    # Shares of a mean (the loss, the accuracy) add up to the mean, a count's to the count.
    _assert_close((loss, aux, grads), (want_loss, want_aux, want_grads))
    assert aux["count"].dtype == want_aux["count"].dtype
    assert collectives(compiled) == []  # nothing moves to return the loss and metrics


def test_grad_with_aux_and_a_summed_loss():
    """`unreduced_grad(has_aux=True)` returns `(grads, aux)`, as `jax.grad` does; with
    `reduction="sum"`, a loss that sums over its batch, and its float aux, add up."""
    params, batch = _params(), _batch()
    loss = functools.partial(_loss, reduce=jnp.sum)
    reference = jax.jit(jax.grad(loss, has_aux=True), static_argnums=(2, 3))
    want_grads, want_aux = reference(params, batch, False, "relu")
    want_aux["accuracy"] = want_aux["accuracy"] * 8  # the sum of 8 shards' means
    fn = optax_accum.unreduced_grad(loss, "data", has_aux=True, reduction="sum")
    with jax.set_mesh(_data_mesh()):
        placed = jax.tree.map(jnp.asarray, params)  # plain params: the same gradients
        split = tuple(jax.reshard(jnp.asarray(x), P("data")) for x in batch)
        grads, aux = jax.jit(fn, static_argnums=(2, 3))(placed, split, False, "relu")
    _assert_close((grads, aux), (want_grads, want_aux))


# --------------------------------------------------------------------------- abstract init


def _fsdp_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("dp", "fsdp"))


def _init_params(key) -> dict:
    w = jax.random.normal(key, (8, 4))
    return {"w": jax.reshard(w, P("fsdp", None)), "b": jnp.zeros(4)}


def test_as_reduced_and_state_shardings_take_eval_shape_output():
    """The guide's `jax.eval_shape` recipe on the one-reduction path: the abstract
    params (on the abstract mesh `jax.eval_shape` gives) typed reduced, the state's
    shardings from them, and the jitted init places exactly what `tx.init` gives."""
    tx = optax_accum.conditional_accumulator(optax.adam(0.1), 2)
    with jax.set_mesh(_fsdp_mesh()):
        shapes = jax.eval_shape(_init_params, jax.random.key(0))
        assert isinstance(shapes["w"].sharding.mesh, jax.sharding.AbstractMesh)
        abstract = optax_accum.as_reduced(shapes, "dp")
        assert abstract["w"].sharding.spec == P("fsdp", None, reduced={"dp"})
        shardings = optax_accum.state_shardings(tx, abstract)
        param_shardings = jax.tree.map(lambda s: s.sharding, abstract)

        def init(key):
            return tx.init(optax_accum.as_reduced(_init_params(key), "dp"))

        state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
        params = jax.jit(_init_params, out_shardings=param_shardings)(jax.random.key(0))
    assert shardings.storage["w"].spec == P("fsdp", None, unreduced={"dp"})
    assert shardings.storage["w"].mesh == _fsdp_mesh()  # the mesh set, not the abstract
    assert jax.typeof(params["w"]) == jax.typeof(abstract["w"]).update(weak_type=False)
    with jax.set_mesh(_fsdp_mesh()):  # what tx.init gives on the arrays, traced
        direct = jax.eval_shape(init, jax.random.key(0))
    assert [jax.typeof(x).sharding.spec for x in jax.tree.leaves(state)] == [
        P() if x.sharding is None else x.sharding.spec for x in jax.tree.leaves(direct)
    ]


def _match(rules, tree):
    """EasyLM's `match_partition_rules`: the first rule whose regex is found in the
    leaf's path wins; scalars are replicated."""
    import re

    def spec(path, leaf):
        if not leaf.shape:
            return P()
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return next(s for pattern, s in rules if re.search(pattern, name))

    return jax.tree_util.tree_map_with_path(spec, tree)


RULES = ((r"w$", P("fsdp", None)), (r".*", P(None)))


def test_specs_from_rules_keep_the_states_types():
    tx = optax_accum.conditional_accumulator(optax.adam(0.1), 2)

    def init(key):
        params = optax_accum.as_reduced(_init_params(key), "dp")
        return params, tx.init(params)

    with jax.set_mesh(_fsdp_mesh()):
        shapes = jax.eval_shape(init, jax.random.key(0))
        specs = optax_accum.keep_reduction_axes(_match(RULES, shapes), shapes)
        params, state = jax.jit(init, out_shardings=specs)(jax.random.key(0))
        shardings = optax_accum.keep_reduction_axes(
            jax.tree.map(lambda s: NamedSharding(_fsdp_mesh(), s), _match(RULES, shapes)), shapes
        )
    assert specs[0]["w"] == P("fsdp", None, reduced={"dp"})
    assert specs[1].storage["b"] == P(None, unreduced={"dp"})
    assert specs[1].inner_state[0].mu["w"] == P("fsdp", None)  # Adam's moments stay plain
    assert state.storage["w"].sharding.spec == P("fsdp", None, unreduced={"dp"})
    assert _compat.sum_types(params["b"]) == ({"dp"}, frozenset())
    assert shardings[1].storage["w"].spec == specs[1].storage["w"]


def test_a_state_placed_by_specs_without_types_names_the_fix():
    """Rules' specs, as they come, make the sums plain; the step says to keep the types."""
    tx = optax_accum.conditional_accumulator(optax.adam(0.1), 2)

    def init(key):
        params = optax_accum.as_reduced(_init_params(key), "dp")
        return params, tx.init(params)

    def loss(params, x):
        return jnp.mean((x @ params["w"] + params["b"]) ** 2)

    def step(params, state, x):
        grads = optax_accum.unreduced_grad(loss, "dp")(params, x)
        return optax_accum.apply_gradients(tx, grads, state, params)

    with jax.set_mesh(_fsdp_mesh()):
        shapes = jax.eval_shape(init, jax.random.key(0))
        stripped = jax.eval_shape(
            jax.jit(init, out_shardings=_match(RULES, shapes)), jax.random.key(0)
        )
        assert _compat.sum_types(stripped[1].storage["w"]) == (frozenset(), frozenset())
        x = jax.ShapeDtypeStruct(
            (16, 8), jnp.float64, sharding=NamedSharding(_fsdp_mesh(), P(("dp", "fsdp")))
        )
        params = optax_accum.as_reduced(stripped[0], "dp")
        with pytest.raises(TypeError, match=r"keep_reduction_axes\(specs, jax\.eval_shape"):
            jax.jit(step).trace(params, stripped[1], x)
