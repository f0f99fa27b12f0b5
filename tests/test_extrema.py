"""Leaves that combine by max or min (`reduction` per leaf, `optax_accum._extrema`).

- marin #7659's case: FP8 delayed scaling keeps an amax history that each micro-batch
  rewrites (its new amax in front); `optax.MultiSteps` averages the micro-batches'
  histories, so the window's amax is their mean, the scale too large, and the largest
  activations are clipped with no error and no NaN. A "max" leaf releases the true max.
- Every reduction against a float64 NumPy model (weights, stale and NaN gradients, two
  windows), the reduction given as a function of the leaf path.
- Under `jax.shard_map` with `axis_name`: a held step moves nothing gradient-sized, the
  release runs one max all-reduce; in a nest; in the sparse accumulator.
- Under `jax.jit` on params typed reduced (`as_reduced`): each device keeps its own
  max and min through held steps that move nothing, and the release takes one max and
  one min all-reduce, beside the sum's; equal to the float64 max over devices and steps.
- Bad input: a max on a sparse leaf, an `IndexedSlices` for a max leaf, a gradient
  typed otherwise than its param, a tree that does not fit.
"""

from __future__ import annotations

import functools
import re

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

E4M3_MAX = 448.0
HISTORY = 8


def _overwrite() -> optax.GradientTransformation:
    """FP8 meta params take their "gradient" as their new value (Flax's
    `OverwriteWithGradient`, levanter's `CustomGradientAccumulation`)."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params: (jax.tree.map(lambda g, p: g - p, updates, params), state),
    )


def _fp8_inner() -> optax.GradientTransformation:
    labels = {"kernel": "sgd", "fp8_meta": {"amax_history": "overwrite"}}
    return optax.multi_transform({"sgd": optax.sgd(0.1), "overwrite": _overwrite()}, labels)


def test_marin_7659_the_window_keeps_its_true_amax_where_multisteps_averages_it():
    rng = np.random.default_rng(0)
    history = np.full(HISTORY, 1.0, np.float32)
    params = {"kernel": jnp.ones((4, 4)), "fp8_meta": {"amax_history": jnp.asarray(history)}}
    # Four micro-batches; the third holds an outlier activation (9.0).
    activations = [rng.uniform(-1, 1, size=64).astype(np.float32) for _ in range(4)]
    activations[2][17] = 9.0

    def micro_grads(x: np.ndarray) -> dict:  # the new history, this batch's amax in front
        new = np.roll(history, 1)
        new[0] = np.abs(x).max()
        return {"kernel": jnp.full((4, 4), float(x.mean())), "fp8_meta": {"amax_history": new}}

    ours = optax_accum.conditional_accumulator(
        _fp8_inner(), 4, reduction={"kernel": "mean", "fp8_meta": "max"}
    )
    theirs = optax.MultiSteps(_fp8_inner(), 4)
    out = {}
    for name, tx in (("ours", ours), ("multisteps", theirs)):
        # MultiSteps mixes int32 and float32 in its own code (strict promotion here).
        with jax.numpy_dtype_promotion("standard"):
            step = jax.jit(lambda p, s, g, tx=tx: _applied(tx, p, s, g))
            p, s = params, tx.init(params)
            for x in activations:
                p, s = step(p, s, micro_grads(x))
        out[name] = p
    amax = {k: float(v["fp8_meta"]["amax_history"][0]) for k, v in out.items()}
    true_amax = max(float(np.abs(x).max()) for x in activations)
    assert amax["ours"] == true_amax == 9.0
    assert amax["multisteps"] == pytest.approx(np.mean([np.abs(x).max() for x in activations]))
    np.testing.assert_allclose(out["ours"]["kernel"], out["multisteps"]["kernel"], rtol=1e-6)
    # The scale from the history: the outlier batch quantized with MultiSteps' scale
    # clips its largest activation, silently (everything finite); with ours, nothing.
    for name, clipped in (("ours", 0), ("multisteps", 1)):
        scale = E4M3_MAX / float(np.max(out[name]["fp8_meta"]["amax_history"]))
        scaled = activations[2] * scale
        assert np.all(np.isfinite(np.asarray(out[name]["fp8_meta"]["amax_history"])))
        assert int(np.sum(np.abs(scaled) > E4M3_MAX)) == clipped, name


def _applied(tx, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


# --------------------------------------------------------------------------- the model


def _model(grads: np.ndarray, tags: list, weights: np.ndarray, k: int) -> list:
    """Each release of an accumulator of `k` gradients whose leaves reduce by sum,
    mean, max and min (weights scale sum and mean only), in float64."""
    releases, window, step = [], [], 0
    for g, tag, w in zip(grads, tags, weights, strict=True):
        if tag < step:
            continue
        window.append((g, w))
        if len(window) == k:
            gs, ws = np.stack([a for a, _ in window]), np.array([b for _, b in window])
            total = np.einsum("i,i...->...", ws, gs)
            releases.append(
                {"sum": total, "mean": total / ws.sum(), "max": gs.max(0), "min": gs.min(0)}
            )
            window, step = [], step + 1
    return releases


def test_every_reduction_matches_the_float64_model():
    rng = np.random.default_rng(1)
    steps, k = 9, 3
    grads = rng.normal(size=(steps, 5))
    tags = [0, 0, 0, 0, 1, 0, 1, 1, 1]  # step 5's tag is stale once a window is out
    weights = rng.uniform(0.5, 2.0, size=steps).astype(np.float32)  # weights are float32
    grads[5] = np.nan  # stale: must reach no leaf
    with _compat.enable_x64():
        tx = optax_accum.conditional_accumulator(
            optax.identity(), k, reduction=lambda path: path[0].key
        )
        params = {name: jnp.zeros(5) for name in ("sum", "mean", "max", "min")}
        update = jax.jit(tx.update)
        state, got = tx.init(params), []
        for g, tag, w in zip(grads, tags, weights, strict=True):
            tree = {name: jnp.asarray(g) for name in params}
            u, state = update(tree, state, local_step=tag, weight=w)
            if bool(state.emitted):
                got.append(u)
    expected = _model(grads, tags, weights, k)
    assert len(got) == len(expected) == 2
    for g, e in zip(got, expected, strict=True):
        for name in e:
            np.testing.assert_allclose(g[name], e[name], rtol=1e-12, err_msg=name)


def test_a_nest_takes_the_max_of_both_levels():
    inner = optax_accum.conditional_accumulator(optax.identity(), 2, reduction="max")
    tx = optax_accum.conditional_accumulator(inner, 2, reduction={"a": "max", "b": "max"})
    params = {"a": jnp.zeros(3), "b": jnp.zeros(())}
    grads = np.array([[1.0, -5, 2], [4, -6, 0], [2, -7, 3], [3, -8, 1]])
    update, state = jax.jit(tx.update), tx.init(params)
    for i, g in enumerate(grads):
        u, state = update({"a": g, "b": -g.sum()}, state)
        if i < 3:  # the outer releases at 1 and 3, the inner (to identity) at 3 only
            assert not np.any(np.asarray(u["a"])), i
    np.testing.assert_array_equal(u["a"], grads.max(0))
    assert float(u["b"]) == (-grads.sum(1)).max()


def test_the_sparse_accumulator_takes_the_max_of_a_dense_leaf():
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=4, reduction={"table": "mean", "amax": "max"}
    )
    params = {"table": jnp.zeros((8, 2)), "amax": jnp.zeros(3)}
    state = tx.init(params)
    assert type(state.storage["amax"]).__name__ == "RunningMax"
    update = jax.jit(tx.update)
    for ids, amax in (([1, 2], [1.0, 5.0, 2.0]), ([2, 3], [3.0, 4.0, 0.5])):
        rows = optax_accum.IndexedSlices(jnp.asarray(ids), jnp.ones((2, 2)), (8, 2))
        u, state = update({"table": rows, "amax": jnp.asarray(amax)}, state)
    np.testing.assert_array_equal(u["amax"], [-3.0, -5.0, -2.0])  # sgd(1.0): minus the max
    assert u["table"].indices.tolist()[:3] == [1, 2, 3]


# --------------------------------------------------------------------------- axis_name


N = 8


@functools.cache
def _sharded() -> tuple:
    """`conditional_accumulator` (identity, 2 N gradients a window, "w" mean and
    "amax" max) under `jax.shard_map` over 8 devices: the compiled step and state."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax_accum.conditional_accumulator(
        optax.identity(), 2 * N, axis_name="data", reduction={"w": "mean", "amax": "max"}
    )
    params = {"w": jnp.zeros((16, 16)), "amax": jnp.zeros(16)}
    specs = optax_accum.state_partition_specs(tx, params, mesh)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.jit(init)(params)

    def body(state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        return updates, state

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))
    grads = {k: jax.ShapeDtypeStruct((N, *v.shape), v.dtype) for k, v in params.items()}
    grads = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P("data"))),
        grads,
    )
    compiled = jax.jit(mapped, donate_argnums=(0,)).lower(state, grads).compile()
    return compiled, state, mesh


def _max_all_reduces(text: str) -> list[str]:
    """The all-reduces whose reduction computation takes a maximum."""
    comps = dict(re.findall(r"^%?([\w.\-]+) .*?\{\n(.*?)\n\}", text, flags=re.M | re.S))
    found = []
    for line in text.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            target = re.search(r"to_apply=%?([\w.\-]+)", line)
            if target and " maximum(" in comps.get(target.group(1), ""):
                found.append(line)
    return found


def test_axis_name_holds_per_replica_and_the_release_takes_one_max():
    compiled, state, mesh = _sharded()
    found = collectives(compiled)
    assert all(c.nbytes <= 64 for c in found if c.every_step), found  # the counts alone
    released = [c for c in found if not c.every_step]
    assert sorted(c.nbytes for c in released) == [16 * 4, 16 * 16 * 4], released
    assert len(_max_all_reduces(compiled.as_text())) == 1
    rng = np.random.default_rng(2)
    data = [{"w": rng.normal(size=(N, 16, 16)), "amax": rng.uniform(size=(N, 16))} for _ in "ab"]
    data = jax.tree.map(lambda a: a.astype(np.float32), data)
    for step in data:
        placed = jax.device_put(step, NamedSharding(mesh, P("data")))
        updates, state = compiled(state, placed)
    both = jax.tree.map(lambda a, b: np.concatenate([a, b]), *data)
    np.testing.assert_array_equal(updates["amax"], both["amax"].max(0))
    np.testing.assert_allclose(updates["w"], both["w"].mean(0), rtol=1e-5)


# --------------------------------------------------------------------------- params typed reduced


def _local_extrema(x: jax.Array, mesh: jax.sharding.Mesh) -> tuple[jax.Array, jax.Array]:
    """Each device's own column max of |x| and min of x, over its rows of the batch,
    typed unreduced over "data" (what an FP8 layer's amax is, before any reduction)."""

    def local(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        stats = jnp.abs(rows).max(0), rows.min(0)
        return jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="unreduced"), stats)

    held = P(None, unreduced={"data"})
    return jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=(held, held))(x)


@functools.cache
def _reduced_step() -> tuple:
    """The canonical step on params typed reduced over "data" (8 devices), identity
    inside `conditional_accumulator` (2 gradients a window; "w" mean, "amax" max,
    "amin" min): the compiled step (params and state donated), a function making
    fresh params and state, the mesh."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax_accum.conditional_accumulator(
        optax.identity(), 2, reduction={"w": "mean", "amax": "max", "amin": "min"}
    )

    def fresh() -> tuple:
        with jax.set_mesh(mesh):
            w = jnp.asarray(np.random.default_rng(4).normal(size=(16, 4)) / 16, jnp.float32)
            params = optax_accum.as_reduced(
                {"w": w, "amax": jnp.zeros(16), "amin": jnp.zeros(16)}, "data"
            )
            return params, jax.jit(tx.init)(params)

    params, state = fresh()

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        grads["amax"], grads["amin"] = _local_extrema(x, mesh)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    x = jax.ShapeDtypeStruct((4 * N, 16), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x).compile()
    return compiled, fresh, mesh


def test_params_typed_reduced_keep_each_devices_max_and_release_one_max():
    compiled, fresh, mesh = _reduced_step()
    params, state = fresh()
    text = compiled.as_text()
    found = collectives(text)
    assert all(c.nbytes <= 64 for c in found if c.every_step), found  # the gate's scalars
    released = sorted(c.nbytes for c in found if not c.every_step)
    assert released == [16 * 4, 16 * 4, 16 * 4 * 4], found  # amax, amin, w: one each
    assert len(_max_all_reduces(text)) == 1
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(4, 4 * N, 16)).astype(np.float32)
    xs[1, 5, 2] = 40.0  # one device's outlier, in one micro-batch of the first window
    w = np.asarray(params["w"], np.float64)
    got = []
    with jax.set_mesh(mesh):
        for i, x in enumerate(xs):
            params, state, updates = compiled(params, state, jax.device_put(x, P("data")))
            got.append(jax.tree.map(np.asarray, updates))
            if i == 2:  # mid-window (a spent store holds no meaningful values)
                kept = state.storage["amax"].values
                assert _compat.sum_types(kept) == (frozenset(), {"data"})
                kept = np.stack([np.asarray(s.data) for s in kept.addressable_shards])
    for i, window in ((1, xs[:2]), (3, xs[2:])):
        x64 = window.astype(np.float64)
        np.testing.assert_array_equal(got[i]["amax"], np.abs(x64).max((0, 1)))
        np.testing.assert_array_equal(got[i]["amin"], x64.min((0, 1)))
        mean = np.mean([2 * b.T @ (b @ w) for b in x64], 0)
        np.testing.assert_allclose(got[i]["w"], mean, rtol=1e-5, atol=1e-6)
        w = w + mean  # identity's update, applied
    assert got[1]["amax"][2] == 40.0  # the outlier survives its window
    assert not any(np.any(got[i][k]) for i in (0, 2) for k in got[i])  # held: no update
    # Mid-window, each device keeps its own maxima: those of its 4 rows of the batch.
    own = np.abs(xs[2]).reshape(N, 4, 16).max(1)
    np.testing.assert_array_equal(kept, own)
    assert len({row.tobytes() for row in kept}) == N


def test_a_checkpoint_saves_the_max_over_devices_and_restores_it_on_every_device():
    """Mid-window (1 of 2 gradients in): `to_checkpoint` saves the running max and min
    over the devices (a sum would add 8 maxima), `from_checkpoint` puts them whole on
    every device, and the restored run releases what the uninterrupted one does."""
    compiled, fresh, mesh = _reduced_step()
    params, state = fresh()
    xs = np.random.default_rng(6).normal(size=(2, 4 * N, 16)).astype(np.float32)
    with jax.set_mesh(mesh):
        params, state, _ = compiled(params, state, jax.device_put(xs[0], P("data")))
        saved = optax_accum.to_checkpoint({"params": params, "opt_state": state})
        kept = saved["opt_state"].storage
        np.testing.assert_array_equal(kept["amax"].values, np.abs(xs[0]).max(0))
        np.testing.assert_array_equal(kept["amin"].values, xs[0].min(0))
        like = jax.eval_shape(lambda: {"params": params, "opt_state": state})
        # Through flax's bytes, as a user's checkpoint would go.
        flax_serialization = pytest.importorskip("flax.serialization")
        data = flax_serialization.to_bytes(saved)
        plain = flax_serialization.from_bytes(optax_accum.to_checkpoint(like), data)
        restored = optax_accum.from_checkpoint(plain, like)
        assert jax.typeof(restored["opt_state"].storage["amax"].values) == jax.typeof(
            state.storage["amax"].values
        )
        x = jax.device_put(xs[1], P("data"))
        _, _, want = compiled(params, state, x)
        _, _, got = compiled(restored["params"], restored["opt_state"], x)
    for k in ("amax", "amin"):
        np.testing.assert_array_equal(got[k], want[k])
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)  # one sum, reordered


def test_the_sparse_accumulator_on_params_typed_reduced_skips_a_devices_nan_max():
    """Eager init, `apply_gradients` (the update applied inside the release), a dense
    max leaf of the sparse accumulator, and one device's NaN maximum dropping the whole
    gradient under `skip_nonfinite`."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = optax_accum.sparse_conditional_accumulator(
        optax.sgd(1.0),
        2,
        capacity=4,
        reduction={"w": "mean", "amax": "max"},
        sparse={"w": False, "amax": False},
        skip_nonfinite=True,
    )

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.nan_to_num(x) @ p["w"]))(params)
        grads["amax"] = _local_extrema(x, mesh)[0]  # NaN only here
        return optax_accum.apply_gradients(tx, grads, state, params)

    xs = np.random.default_rng(5).normal(size=(3, 4 * N, 16)).astype(np.float32)
    xs[1, 9, 3] = np.nan  # device 2's rows: its max is NaN, the others' are not
    with jax.set_mesh(mesh):
        params = optax_accum.as_reduced({"w": jnp.ones((16, 2)), "amax": jnp.zeros(16)}, "data")
        state = tx.init(params)
        assert _compat.sum_types(state.storage["amax"].values)[1] == {"data"}
        update = jax.jit(step, donate_argnums=(0, 1))
        for x in xs:
            params, state = update(params, state, jax.device_put(x, P("data")))
        assert int(state.num_nonfinite) == 1
        assert _compat.sum_types(params["amax"])[0] == {"data"}  # typed as it came
    want = -np.abs(xs[[0, 2]].astype(np.float64)).max((0, 1))  # sgd(1.0): minus the max
    np.testing.assert_array_equal(params["amax"], want)


# --------------------------------------------------------------------------- bad input


def test_a_max_on_a_sparse_leaf_is_refused_at_init():
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=2, reduction="max"
    )
    with pytest.raises(ValueError, match=r"reduction \"max\" is for dense leaves, but params"):
        tx.init({"table": jnp.zeros((8, 2))})


def test_an_indexed_slices_for_a_max_leaf_is_refused():
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=2, reduction="max", sparse={"t": False}
    )
    state = tx.init({"t": jnp.zeros((8, 2))})
    rows = optax_accum.IndexedSlices(jnp.array([1]), jnp.ones((1, 2)), (8, 2))
    with pytest.raises(TypeError, match=r"updates\['t'\] must be an array \(reduction \"max\""):
        tx.update({"t": rows}, state)


def test_a_tree_that_does_not_fit_and_a_bad_function_are_refused():
    tx = optax_accum.conditional_accumulator(optax.identity(), 2, reduction={"a": "max"})
    with pytest.raises(ValueError, match=r"reduction must be a tree shaped like the params"):
        tx.init({"b": jnp.zeros(2)})
    tx = optax_accum.conditional_accumulator(optax.identity(), 2, reduction=lambda path: "avg")
    with pytest.raises(ValueError, match=r"got 'avg' from reduction\(.*\) for params\['b'\]"):
        tx.init({"b": jnp.zeros(2)})


def test_a_max_leaf_refuses_a_gradient_typed_otherwise_than_its_param():
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def struct(spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(mesh, spec))

    tx = optax_accum.conditional_accumulator(optax.identity(), 2, reduction="max")
    with jax.set_mesh(mesh):
        plain = jax.eval_shape(tx.init, {"a": struct(P(None))})
        with pytest.raises(TypeError, match=r"updates\['a'\] must hold its true values"):
            jax.eval_shape(tx.update, {"a": struct(P(None, unreduced={"data"}))}, plain)
        reduced = jax.eval_shape(tx.init, {"a": struct(P(None, reduced={"data"}))})
        with pytest.raises(TypeError, match=r"updates\['a'\] must be typed unreduced over"):
            jax.eval_shape(tx.update, {"a": struct(P(None))}, reduced)
