"""cross_shard / cross_shard_optimizer: docs/semantics.md §3 vectors, groups under every
mapper against NumPy, equivalence with single-device training, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _collectives, _compat
from optax_accum.cross_shard import cross_shard, cross_shard_optimizer

MAPPERS = ["pmap", "shard_map", "vmap"]


def mapped(fn, mapper: str, n: int):
    """jit(fn mapped over a leading axis of size n, with the axis bound as "i")."""
    if mapper == "pmap":
        return jax.pmap(fn, axis_name="i", devices=jax.devices()[:n])
    if mapper == "vmap":
        return jax.jit(jax.vmap(fn, axis_name="i"))
    mesh = Mesh(np.array(jax.devices()[:n]), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(*args):
        local = jax.tree.map(lambda a: a[0], args)
        return jax.tree.map(lambda o: o[None], fn(*local))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))


def reduced(tx, grads: np.ndarray, mapper: str) -> np.ndarray:
    """Each replica's output of `tx.update` for per-replica gradients `grads[r]`."""
    fn = mapped(lambda g: tx.update(g, tx.init(g))[0], mapper, grads.shape[0])
    return np.asarray(fn(jnp.asarray(grads)))


def numpy_group_reduce(grads: np.ndarray, groups, mean: bool) -> np.ndarray:
    """The float64 reference: each replica gets its group's sum (or mean)."""
    groups = groups or [list(range(grads.shape[0]))]
    out = np.empty(grads.shape, np.float64)
    for g in groups:
        total = grads[list(g)].astype(np.float64).sum(0)
        out[list(g)] = total / len(g) if mean else total
    return out


# -------------------------------------------------------------------- docs/semantics.md §3


@pytest.mark.parametrize("mapper", MAPPERS)
@pytest.mark.parametrize(
    ("reduction", "groups", "expected"),
    [
        ("mean", None, [2.0, 4.0]),
        ("sum", None, [8.0, 16.0]),
        ("MEAN", [[0, 1], [2, 3]], [2.0, 4.0]),
        ("SUM", [[0, 1], [2, 3]], [4.0, 8.0]),
        ("mean", [], [2.0, 4.0]),
    ],
)
def test_tf_vectors_same_gradient_on_every_replica(mapper, reduction, groups, expected):
    v = jnp.array([1.0, 2.0])
    grad = jax.grad(lambda v: jnp.sum(v**2))(v)  # [2, 4] on each of 4 replicas
    tx = cross_shard("i", reduction=reduction, group_assignment=groups)
    out = reduced(tx, np.tile(np.asarray(grad), (4, 1)), mapper)
    np.testing.assert_array_equal(out, np.tile(expected, (4, 1)))


@pytest.mark.parametrize("mapper", MAPPERS)
def test_tf_vector_groups_with_per_replica_gradients(mapper):
    grads = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # r*[1,1]
    tx = cross_shard("i", group_assignment=[[0, 2], [1, 3]])
    out = reduced(tx, grads, mapper)
    np.testing.assert_array_equal(out, [[1, 1], [2, 2], [1, 1], [2, 2]])


# --------------------------------------------------------------------------- groups vs NumPy

group_sizes = st.sampled_from([1, 2, 4, 8])


@st.composite
def assignments(draw):
    k = draw(group_sizes)
    perm = draw(st.permutations(list(range(8))))
    return [perm[i : i + k] for i in range(0, 8, k)]


@settings(max_examples=examples(12), deadline=None)
@given(groups=assignments(), seed=st.integers(0, 2**16), mean=st.booleans())
@pytest.mark.parametrize("mapper", MAPPERS)
def test_random_groups_match_numpy(mapper, groups, seed, mean):
    grads = np.random.default_rng(seed).normal(size=(8, 3, 2)).astype(np.float32)
    tx = cross_shard("i", reduction="mean" if mean else "sum", group_assignment=groups)
    out = reduced(tx, grads, mapper)
    np.testing.assert_allclose(out, numpy_group_reduce(grads, groups, mean), rtol=1e-5, atol=1e-6)
    for g in groups:  # every member of a group holds the same bits
        assert all(np.array_equal(out[g[0]], out[r]) for r in g)


@settings(max_examples=examples(12), deadline=None)
@given(groups=assignments(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize(
    "method",
    [_collectives.one_hot_group_sum, _collectives.permute_group_sum],
    ids=["onehot", "ppermute"],
)
def test_both_exact_group_methods_match_numpy(method, groups, seed):
    """Both shard_map methods, whichever the cost rule picks, are exact group sums."""
    grads = np.random.default_rng(seed).normal(size=(8, 5)).astype(np.float32)
    validated = _collectives.validate_group_assignment(groups)
    fn = mapped(lambda g: method(g, "i", validated), "shard_map", 8)
    out = np.asarray(fn(jnp.asarray(grads)))
    np.testing.assert_allclose(out, numpy_group_reduce(grads, groups, False), rtol=1e-5, atol=1e-5)
    for g in groups:
        assert all(np.array_equal(out[g[0]], out[r]) for r in g)


def test_nan_stays_inside_its_group():
    grads = np.ones((8, 2), np.float32)
    grads[5] = np.nan
    groups = [[0, 3, 5, 6], [1, 2, 4, 7]]
    for mapper in ("shard_map", "pmap"):
        out = reduced(cross_shard("i", group_assignment=groups), grads, mapper)
        assert np.isnan(out[[0, 3, 5, 6]]).all()
        np.testing.assert_array_equal(out[[1, 2, 4, 7]], 1.0)


# --------------------------------------------------------------------------- options


def _tree_grads(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(8, 4, 3)).astype(np.float32),
        "b": rng.normal(size=(8, 3)).astype(np.float32),
        "h": rng.normal(size=(8, 2)).astype(jnp.bfloat16),
    }


@pytest.mark.parametrize("groups", [None, [[0, 3, 5, 6], [1, 2, 4, 7]]])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_pack_gives_the_same_bits_as_per_leaf(mapper, groups):
    grads = _tree_grads()

    def run(pack):
        tx = cross_shard("i", group_assignment=groups, pack=pack)
        fn = mapped(lambda g: tx.update({**g, "none": None}, tx.init(g))[0], mapper, 8)
        return fn(grads)

    packed, plain = run(True), run(False)
    assert packed["none"] is None
    for key in grads:
        assert packed[key].dtype == grads[key].dtype
        np.testing.assert_array_equal(np.asarray(packed[key]), np.asarray(plain[key]))


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_communication_dtype_bfloat16(reduction, pack):
    grads = _tree_grads(1)
    del grads["h"]
    tx = cross_shard("i", reduction=reduction, communication_dtype=jnp.bfloat16, pack=pack)
    out = mapped(lambda g: tx.update(g, tx.init(g))[0], "shard_map", 8)(grads)
    for key, g in grads.items():
        assert out[key].dtype == jnp.float32
        expected = numpy_group_reduce(g, None, reduction == "mean")
        # Each replica's value is rounded to bfloat16 (8 significant bits) on the wire.
        np.testing.assert_allclose(np.asarray(out[key]), expected, rtol=0.05, atol=0.05)
        assert not np.array_equal(np.asarray(out[key]), expected.astype(np.float32))


def test_none_leaves_pass_through_and_state_is_empty():
    tx = cross_shard("i")
    grads = {"a": jnp.ones((2, 3)), "b": None}
    out, state = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="i"))(grads)
    assert out["b"] is None and state == optax.EmptyState()
    np.testing.assert_array_equal(out["a"], 1.0)


def test_optimizer_forwards_extra_args_and_applies_inner():
    seen = {}

    def inner_update(updates, state, params=None, *, lr_scale=None, **extra):
        seen["lr_scale"] = lr_scale
        return jax.tree.map(lambda u: -lr_scale * u, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    tx = cross_shard_optimizer(inner, "i", reduction="sum")
    fn = jax.jit(
        jax.vmap(lambda g: tx.update(g, tx.init(g), lr_scale=jnp.float32(0.5))[0], axis_name="i")
    )
    out = fn(jnp.arange(3.0))
    np.testing.assert_array_equal(out, [-1.5, -1.5, -1.5])
    assert seen["lr_scale"] is not None


# --------------------------------------------------------------------------- equivalence


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 2)) + 0.1 * rng.normal(size=(n, 2))).astype(np.float32)
    return x, y


@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_data_parallel_training_equals_single_device_on_the_whole_batch(mapper):
    """Adam on 8 replicas' averaged shard gradients == Adam on the concatenated batch."""
    x, y = _data()
    params = {"w": jnp.zeros((5, 2)), "b": jnp.zeros(2)}
    inner = adam(0.05)

    single = jax.jit(lambda p, s: (lambda g, s: inner.update(g, s, p))(jax.grad(_loss)(p, x, y), s))
    p_ref, s_ref = params, inner.init(params)
    tx = cross_shard_optimizer(inner, "i")

    def replica_step(p, s, xb, yb):
        updates, s = tx.update(jax.grad(_loss)(p, xb, yb), s, p)
        return optax.apply_updates(p, updates), s

    step = mapped(replica_step, mapper, 8)
    stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * 8), t)  # noqa: E731
    p_dp, s_dp = stack(params), stack(tx.init(params))
    xs, ys = x.reshape(8, 8, 5), y.reshape(8, 8, 2)
    for _ in range(5):
        updates, s_ref = single(p_ref, s_ref)
        p_ref = optax.apply_updates(p_ref, updates)
        p_dp, s_dp = step(p_dp, s_dp, xs, ys)
    for key in params:
        got = np.asarray(p_dp[key])
        assert all(np.array_equal(got[0], got[r]) for r in range(8))
        np.testing.assert_allclose(got[0], np.asarray(p_ref[key]), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (5, "must be a list of list"),
        ([0, 1, 2, 3], "must be a list of list"),
        ([[0, 1], 2], "must be a list of list"),
        ([[0, 1], [2, 4]], r"must be a permutation of range\(4\)"),
        ([[1, 2], [3, 4]], r"must be a permutation of range\(4\)"),
        ([[0, 1, 2], [3]], "The size of each subgroup in group_assignment must be equal"),
        ([[0, 1], [1, 2], [3, 0]], "must not repeat a replica id"),
        ([[0, 1.0]], "list of list of int"),
        ([[0, True]], "list of list of int"),
        ([[], []], "must not hold an empty subgroup"),
        ([[0, 1], []], "must not hold an empty subgroup"),
    ],
)
def test_bad_group_assignment_raises_at_construction(groups, message):
    with pytest.raises(ValueError, match=message):
        cross_shard("i", group_assignment=groups)
    with pytest.raises(ValueError, match=message):
        cross_shard_optimizer(optax.sgd(1.0), "i", group_assignment=groups)


def test_group_assignment_for_another_replica_count_raises_at_trace_time():
    tx = cross_shard("i", group_assignment=[[0, 1], [2, 3]])  # valid for 4 replicas
    fn = mapped(lambda g: tx.update(g, tx.init(g))[0], "shard_map", 8)
    with pytest.raises(ValueError, match=r"must be a permutation of range\(8\).*axis 'i'"):
        fn(jnp.zeros((8, 2)))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"reduction": "max"}, ValueError, "reduction must be"),
        ({"reduction": None}, ValueError, "reduction must be"),
        (
            {"communication_dtype": jnp.int8},
            TypeError,
            "communication_dtype must be a floating dtype, got int8",
        ),
        ({"communication_dtype": "nope"}, TypeError, "communication_dtype must be"),
        ({"pack": 1}, TypeError, "pack must be a bool"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        cross_shard("i", **kwargs)


@pytest.mark.parametrize("axis_name", [None, 3.5, ("i", None)])
def test_bad_axis_name_raises(axis_name):
    with pytest.raises(TypeError, match="axis_name must be"):
        cross_shard(axis_name)


def test_unbound_axis_and_integer_gradients_raise_at_trace_time():
    tx = cross_shard("i")
    with pytest.raises(ValueError, match="axis_name='i' is not bound"):
        jax.jit(lambda g: tx.update(g, tx.init(g)))(jnp.ones(2))
    fn = jax.jit(jax.vmap(lambda g: tx.update(g, optax.EmptyState()), axis_name="i"))
    with pytest.raises(TypeError, match=r"updates\['n'\] must be floating"):
        fn({"n": jnp.ones((2, 3), jnp.int32)})


def test_exported():
    assert optax_accum.cross_shard is cross_shard
    assert optax_accum.cross_shard_optimizer is cross_shard_optimizer


def test_replica_invariant_gradient_under_shard_map_raises():
    """jax.grad w.r.t. replicated params under shard_map is already the sum over the axis."""
    mesh = Mesh(np.array(jax.devices()), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = cross_shard("i")

    def body(w, x, per_replica):
        if per_replica:
            w = _compat.pcast_varying(w, "i")
        g = jax.grad(lambda w: jnp.sum(w * x))(w)
        return tx.update(g, tx.init(g))[0]

    def run(per_replica):
        fn = jax.shard_map(
            lambda w, x: body(w, x, per_replica), mesh=mesh, in_specs=(P(), P("i")), out_specs=P()
        )
        return jax.jit(fn)(jnp.ones(1), jnp.arange(8.0))

    np.testing.assert_array_equal(run(True), [3.5])  # the mean of the replicas' gradients
    with pytest.raises(ValueError, match=r"must differ per replica of axis 'i'.*pcast"):
        run(False)


@pytest.mark.parametrize(
    ("options", "all_reduces", "itemsize"),
    [
        ({}, 3, 4),
        ({"pack": True}, 1, 4),
        ({"communication_dtype": jnp.bfloat16}, 3, 2),
        ({"communication_dtype": jnp.bfloat16, "pack": True}, 1, 2),
    ],
)
def test_emitted_collectives_per_option(options, all_reduces, itemsize):
    """What benchmarks/collectives.py reports, checked on the HLO JAX emits."""
    from optax_accum.demo.hlo import count_collectives

    grads = {k: jnp.zeros((8, 4, n)) for k, n in (("a", 1), ("b", 2), ("c", 3))}
    tx = cross_shard("i", **options)
    lowered = mapped(lambda g: tx.update(g, tx.init(g))[0], "shard_map", 8).lower(grads)
    counts = count_collectives(lowered.as_text(dialect="hlo"))["every_step"]
    assert counts["all-reduce"] == all_reduces
    assert counts["all-reduce bytes"] == 4 * (1 + 2 + 3) * itemsize


def test_groups_on_a_1d_shard_map_axis_use_permutes_with_the_stated_cost():
    """Groups of k on n replicas: k - 1 permutes while k(k-1) < 2(n-1), else one
    all-reduce of an n/k times larger buffer."""
    from optax_accum.demo.hlo import count_collectives

    def counts(groups):
        tx = cross_shard("i", group_assignment=groups)
        fn = mapped(lambda g: tx.update(g, tx.init(g))[0], "shard_map", 8)
        return count_collectives(fn.lower(jnp.zeros((8, 5))).as_text(dialect="hlo"))

    two_by_four = counts([[0, 3, 5, 6], [1, 2, 4, 7]])["every_step"]
    assert two_by_four == {"collective-permute": 3, "collective-permute bytes": 3 * 20}
    assert counts([[i] for i in range(8)])["every_step"] == {}  # groups of one: identity
    one_hot = _collectives.one_hot_group_sum
    fn = mapped(lambda g: one_hot(g, "i", ((0, 3, 5, 6), (1, 2, 4, 7))), "shard_map", 8)
    buffer = count_collectives(fn.lower(jnp.zeros((8, 5))).as_text(dialect="hlo"))
    assert buffer["every_step"] == {"all-reduce": 1, "all-reduce bytes": 2 * 20}


@pytest.mark.parametrize(
    "groups", [None, [[0, 3, 5, 6], [1, 2, 4, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]]
)
def test_tuple_axis_name_reduces_over_the_row_major_replica_index(groups):
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = cross_shard(("a", "b"), group_assignment=groups)
    spec = P(("a", "b"))
    fn = jax.jit(
        jax.shard_map(
            lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=spec, out_specs=spec
        )
    )
    grads = np.random.default_rng(3).normal(size=(8, 2)).astype(np.float32)
    out = np.asarray(fn(jnp.asarray(grads)))
    np.testing.assert_allclose(out, numpy_group_reduce(grads, groups, True), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "groups",
    [None, [[0, 2, 4], [1, 3, 5]], [[0, 1], [2, 3], [4, 5]], [[0, 5], [1, 4], [2, 3]]],
)
@pytest.mark.parametrize("pack", [False, True])
def test_nested_vmap_with_a_tuple_axis_name(groups, pack):
    """`vmap(vmap(f, axis_name="a"), axis_name="b")` with `axis_name=("b", "a")`: with
    groups, the same bits as one flat vmap over the row-major replica index (without,
    jax's own `pmean` over two names adds in another order); and NumPy's numbers."""
    b, a = 2, 3
    grads = np.random.default_rng(4).normal(size=(b * a, 5)).astype(np.float32)
    nested_tx = cross_shard(("b", "a"), group_assignment=groups, pack=pack)
    flat_tx = cross_shard("i", group_assignment=groups, pack=pack)
    nested = jax.jit(
        jax.vmap(
            jax.vmap(lambda g: nested_tx.update(g, nested_tx.init(g))[0], axis_name="a"),
            axis_name="b",
        )
    )(jnp.asarray(grads).reshape(b, a, 5))
    flat = reduced(flat_tx, grads, "vmap")
    nested = np.asarray(nested).reshape(b * a, 5)
    if groups is not None:
        np.testing.assert_array_equal(nested, flat)
    expected = numpy_group_reduce(grads, groups, True)
    np.testing.assert_allclose(nested, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("groups", [[[0, 3, 5, 6], [1, 2, 4, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]])
def test_nested_vmap_groups_match_the_shard_map_bits(groups):
    """A tuple of vmap axes cannot be permuted; the gathered group sum that replaces the
    permutes adds in the group's member order, so it gives shard_map's bits."""
    grads = np.random.default_rng(6).normal(size=(8, 3)).astype(np.float32)
    tx = cross_shard(("b", "a"), group_assignment=groups)
    nested = jax.jit(
        jax.vmap(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="a"), axis_name="b")
    )(jnp.asarray(grads).reshape(2, 4, 3))
    mesh = jax.make_mesh((2, 4), ("b", "a"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(("b", "a"))
    sharded = jax.jit(
        jax.shard_map(
            lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=spec, out_specs=spec
        )
    )(jnp.asarray(grads))
    np.testing.assert_array_equal(np.asarray(nested).reshape(8, 3), np.asarray(sharded))
