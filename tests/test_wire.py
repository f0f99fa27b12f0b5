"""The wire format of a cross-replica sum (`optax_accum._wire`).

Against a float64 NumPy model of the same quantization (blocks of 256 values per
leaf, a float32 scale per block, the sum in between): the values, the error bound the
module states against the exact sum, the same bits on every replica, and the bytes
each device sends, read from the compiled programs (XLA:CPU and the TPU lowering).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _hlo import collectives
from jax.sharding import PartitionSpec as P

from optax_accum import _wire

N = 4  # replicas of the value tests
NARROW = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "float8": jnp.float8_e4m3fn}
QMAX = {"int8": 127.0, "float8": 448.0}


def _tree(n: int = N) -> dict:
    """Per-replica leaves (leading axis): one spanning blocks with a ragged end, one
    smaller than a block and 1000x smaller in magnitude (its own blocks keep it
    precise), one holding an exact zero block, and one sent row by row (8 rows of 384
    values, rows scaled 0.01 to 100)."""
    rng = np.random.default_rng(7)
    big = rng.normal(size=(n, 37, 11)) * rng.uniform(0.1, 10.0, size=(n, 37, 1))
    rows = rng.normal(size=(n, 8, 384)) * np.logspace(-2, 2, 8)[:, None]
    return {
        "a": big.astype(np.float32),
        "b": (rng.normal(size=(n, 5)) * 1e-3).astype(np.float32),
        "r": rows.astype(np.float32),
        "z": np.zeros((n, 300), np.float32),
    }


def _row_wise(x: np.ndarray, n: int) -> bool:
    """A replica's leaf `x` goes row by row (the module's rule)."""
    return x.ndim >= 2 and x.shape[-1] >= _wire.BLOCK and (x.size // x.shape[-1]) % n == 0


# --------------------------------------------------------------------------- the model


def _round_trip(blocks: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row (a block) encoded and decoded in float64, and its scale (0 for
    bfloat16, which has none)."""
    if name == "bfloat16":
        return blocks.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64), 0 * blocks[
            :, 0
        ]
    qmax = QMAX[name]
    scale = np.abs(blocks).max(axis=1) / qmax
    safe = np.where(scale > 0, scale, 1.0)
    x = np.clip(blocks / safe[:, None], -qmax, qmax)
    q = np.round(x) if name == "int8" else x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * scale[:, None], scale


def _blocks(x: np.ndarray, n: int) -> np.ndarray:
    """A replica's leaf as the module cuts it: its rows, or blocks of 256 (padded)."""
    x = np.asarray(x, np.float64)
    if _row_wise(x, n):
        return x.reshape(-1, x.shape[-1])
    flat = x.ravel()
    return np.pad(flat, (0, -flat.size % _wire.BLOCK)).reshape(-1, _wire.BLOCK)


def _model(tree: dict, name: str, mean: bool) -> tuple[dict, dict, dict]:
    """The model's result, and per value the bound on its distance from the exact sum
    and the last rounding's step, each leaf cut into blocks (padded) and its blocks
    rounded one by one."""
    n = next(iter(tree.values())).shape[0]
    out, bounds, steps = {}, {}, {}
    for k, v in tree.items():
        total = bound = 0.0
        for r in range(n):
            blocks = _blocks(v[r], n)
            decoded, scale = _round_trip(blocks, name)
            total, bound = total + decoded, bound + _first_rounding(blocks, scale, name)
        if mean:
            total, bound = total / n, bound / n
        result, scale = _round_trip(total, name)
        out[k] = result.ravel()[: v[0].size].reshape(v.shape[1:])
        bounds[k] = (bound + _first_rounding(total, scale, name)).ravel()
        steps[k] = np.repeat(scale, total.shape[1])
    return out, bounds, steps


def _first_rounding(blocks: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """The most one rounding moves each value (the module docstring's bound)."""
    if name == "int8":
        return np.broadcast_to(scale[:, None] / 2, blocks.shape)
    if name == "float8":
        return np.abs(blocks) / 16 + scale[:, None] / 1024
    return np.abs(blocks) / 256


def _padded(x: np.ndarray, n: int) -> np.ndarray:
    """A replica's leaf in the model's layout, padded as its blocks are."""
    return _blocks(x, n).ravel()


# --------------------------------------------------------------------------- values


@functools.cache
def _results() -> dict:
    """Every dtype's sum and mean, under `jax.vmap` over N replicas: one program."""

    def f(tree: dict) -> dict:
        return {
            (name, mean): _wire.reduced(tree, "i", communication_dtype=dtype, mean=mean)
            for name, dtype in [("none", None), *NARROW.items()]
            for mean in (False, True)
        }

    return jax.jit(jax.vmap(f, axis_name="i"))(_tree())


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("name", list(NARROW))
def test_matches_the_float64_model_and_its_error_bound(name, mean):
    tree = _tree()
    got = _results()[(name, mean)]
    model, bounds, steps = _model(tree, name, mean)
    exact = {k: v.astype(np.float64).sum(0) / (N if mean else 1) for k, v in tree.items()}
    for k in tree:
        assert got[k].dtype == tree[k].dtype
        for r in range(1, N):  # the same bits on every replica
            np.testing.assert_array_equal(got[k][r], got[k][0], err_msg=k)
        mine, want = _padded(got[k][0], N), _padded(model[k], N)
        bound, step = bounds[k], steps[k]
        # Against the model: float32 against float64 arithmetic may round a value to
        # the next step at a tie, at most one step of each rounding; almost all agree.
        tolerance = 2 * step + bound + 1e-30
        diff = np.abs(mine - want)
        assert np.all(diff <= tolerance), (k, np.max(diff / tolerance))
        assert np.mean(diff <= 1e-6 * (np.abs(want) + step)) > 0.98, k
        # Against the exact sum: within the stated bound (plus float32 rounding).
        truth = _padded(exact[k], N)
        assert np.all(np.abs(mine - truth) <= bound * (1 + 1e-5) + 1e-6 * np.abs(truth) + 1e-30)
    np.testing.assert_array_equal(got["z"], 0.0)  # a zero block stays zero, no NaN
    # Row by row, each row keeps its own scale: the 0.01 row as precise as the 100 one.
    rel = np.abs(got["r"][0] - exact["r"]).max(axis=1) / np.abs(exact["r"]).max(axis=1)
    assert rel.max() < 4 * rel.min() + 1e-6
    if name != "bfloat16":  # the small leaf keeps its own scale: 1/254 of its max, not a's
        small = np.abs(got["b"][0] - exact["b"]).max() / np.abs(exact["b"]).max()
        assert small < 0.1


def test_without_a_dtype_it_is_psum():
    tree, got = _tree(), _results()
    for k in tree:
        np.testing.assert_allclose(got[("none", False)][k][0], tree[k].sum(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[("none", True)][k][0], tree[k].mean(0), rtol=1e-5, atol=1e-6)


def test_shard_map_and_pmap_give_vmaps_bits_also_over_a_tuple_of_axes():
    tree = {k: v for k, v in _tree(8).items() if k in ("b", "r")}  # in blocks, by rows
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    f = functools.partial(_wire.reduced, axis_name=("a", "b"), communication_dtype=jnp.int8)
    one = functools.partial(jax.tree.map, lambda x: x[0])
    mapped = jax.jit(
        jax.shard_map(lambda t: f(one(t)), mesh=mesh, in_specs=P(("a", "b")), out_specs=P())
    )
    placed = jax.device_put(tree, jax.NamedSharding(mesh, P(("a", "b"))))
    on_mesh = mapped(placed)  # typed invariant: out_specs P() holds
    nested = jax.jit(jax.vmap(jax.vmap(f, axis_name="b"), axis_name="a"))
    by_vmap = nested(jax.tree.map(lambda x: x.reshape(2, 4, *x.shape[1:]), tree))
    by_pmap = jax.pmap(functools.partial(f, axis_name="i"), axis_name="i")(tree)
    for k in tree:
        np.testing.assert_array_equal(on_mesh[k], by_vmap[k][1, 2])
        np.testing.assert_array_equal(by_pmap[k][5], by_vmap[k][1, 1])


# --------------------------------------------------------------------------- bytes


def _wire_bytes(found: list) -> int:
    """Bytes each device sends, over a ring: an all-reduce its result twice
    (reduce-scatter, then all-gather), an all-to-all and an all-gather theirs once;
    the (n-1)/n they share is left out of both sides of a ratio."""
    weights = {"all-reduce": 2, "all-to-all": 1, "all-gather": 1}
    return sum(weights[c.opcode] * c.nbytes for c in found)


@functools.cache
def _programs(dtype_name: str) -> tuple:
    """One release's reduction of 2 leaves of 128 x 64 float32 (64 blocks: 8 shares
    of 8) over 8 devices under `jax.shard_map`: compiled for XLA:CPU, lowered for TPU."""
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    dtype = None if dtype_name == "none" else NARROW[dtype_name]
    sharding = jax.NamedSharding(mesh, P("i"))
    tree = {k: jax.ShapeDtypeStruct((8, 128, 64), jnp.float32, sharding=sharding) for k in "ab"}

    def body(t: dict) -> dict:
        local = jax.tree.map(lambda x: x[0], t)
        return _wire.reduced(local, "i", communication_dtype=dtype)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
    traced = fn.trace(tree)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text(dialect="hlo")
    return collectives(traced.lower().compile()), collectives(tpu)


@pytest.mark.parametrize("name", list(NARROW))
def test_bytes_per_sync_read_from_the_compiled_programs(name):
    for plain, narrow in zip(_programs("none"), _programs(name), strict=True):
        assert {c.opcode for c in plain} == {"all-reduce"}
        pairs = 1 if name == "bfloat16" else 2  # the values, and the scales apart
        assert sorted(c.opcode for c in narrow) == ["all-gather"] * pairs + ["all-to-all"] * pairs
        ratio = _wire_bytes(narrow) / _wire_bytes(plain)
        if name == "bfloat16":
            assert ratio == 0.5
        else:  # 1 byte a value and 4 a block of 256: (1 + 4/256) / 4 = 1/3.94
            assert ratio == (1 + 4 / 256) / 4
            assert ratio <= 1 / 3.9
    # The TPU compiler itself (tests/test_quantized_release.py) turns the scales'
    # all-gather into an all-reduce of the same bytes: 1/3.91 there.


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("value", "error"),
    [(jnp.float16, ValueError), ("int4", ValueError), (jnp.int32, ValueError), (3, TypeError)],
)
def test_bad_communication_dtype_is_named(value, error):
    with pytest.raises(error, match=r"communication_dtype must be None, jnp\.float32"):
        _wire.wire_dtype("communication_dtype", value)


def test_float32_and_names_are_accepted():
    assert _wire.wire_dtype("communication_dtype", jnp.float32) is None
    assert _wire.wire_dtype("communication_dtype", "int8") == np.dtype(np.int8)
    assert _wire.wire_dtype("communication_dtype", "float8_e4m3fn") == jnp.float8_e4m3fn
