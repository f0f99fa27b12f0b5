"""Checkpoints of the one-reduction path: params typed reduced, sums typed unreduced.

On jax 0.10.2 neither Orbax nor `flax.serialization` saves a reduced or an unreduced
array. `optax_accum.to_checkpoint` gives every leaf typed plain (a reduced one retyped
in place, an unreduced one summed once), and `optax_accum.from_checkpoint` types each
saved leaf as a fresh state's. For every kind of state the path builds (the dense
accumulator, the sparse one with dense leaves, a nest, `drop_stale_gradients` around an
accumulator, `agn` inside an accumulator), 8 steps in float64 on an 8-device
data-parallel mesh are checkpointed mid-window and right after a release, with Orbax
and with `flax.serialization`, restored into the shapes of a fresh `tx.init` (abstract,
from `jax.eval_shape`), and continued:

- the saved values are the true values (an unreduced leaf: the sum of its devices'
  partial sums, read here in NumPy), each typed plain;
- every restored leaf has the fresh state's `jax.typeof`, and its true value is the
  saved one bit for bit;
- the continued run equals the run never stopped, to 1e-9 (the window's all-reduce
  adds the same gradients in another order);
- on an FSDP layout, the save program all-reduces each unreduced leaf's shard once
  and moves nothing else, a reduced leaf is saved in place (no copy), and a restore
  keeps each leaf's layout.

On one device and on meshes with plain types, both calls return what they are given.
One compiled step per kind serves the uninterrupted run and the four restored ones.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _cases import lenient
from _hlo import collectives
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

STEPS = 8
LAGS = (0, 0, 1, 0, 2, 0, 0, 1)  # how stale each step's gradient is (2: dropped by drop_stale)

# name: (mesh shape, axis names, the axis a matrix is sharded over, reduced axes)
LAYOUTS = {
    "data": ((8,), ("data",), None, "data"),
    "fsdp": ((2, 4), ("data", "fsdp"), "fsdp", "data"),
}


def _adam():
    return lenient(optax.adam(0.05))


KINDS = {
    "conditional_accumulator": lambda: optax_accum.conditional_accumulator(_adam(), 2),
    "sparse_dense_rows": lambda: optax_accum.sparse_conditional_accumulator(
        _adam(), 2, capacity=4, sparse=lambda p: jax.tree.map(lambda _: False, p)
    ),
    "nested": lambda: optax_accum.conditional_accumulator(
        optax_accum.conditional_accumulator(_adam(), 2), 2, reduction="sum"
    ),
    "drop_stale_accumulator": lambda: optax_accum.drop_stale_gradients(
        optax_accum.conditional_accumulator(_adam(), 2), 1
    ),
    "agn_in_accumulator": lambda: optax_accum.conditional_accumulator(
        optax_accum.agn(optax.sgd(0.1), 2), 2
    ),
}
# agn alone refuses params typed reduced at init (a TypeError that says what to do,
# tests/test_every_layout.py): each local step applies the worker's own gradient, so
# there is no sum to defer. Inside an accumulator (above) it runs on plain params.


@pytest.fixture(autouse=True)
def _x64():
    with _compat.enable_x64():
        yield


def _mesh(layout: str) -> jax.sharding.Mesh:
    shape, names, _, _ = LAYOUTS[layout]
    return jax.make_mesh(shape, names)  # explicit axes: jax.make_mesh's default


def _loss(params, batch):
    """A two-layer MLP whose params meet the batch only inside dots, where `jax.grad`
    leaves the gradients of params typed reduced unreduced (any model can use
    `optax_accum.unreduced_grad`; the checkpoint is the same)."""
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def _params(layout: str = "data") -> dict:
    """Fresh params on the layout's mesh (sharded where it says), typed reduced over its
    batch axis: the same values on every call."""
    _, _, sharded, reduced = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 8)) / 4, "v": rng.normal(size=(8, 4))}
    placed = {k: jax.reshard(jnp.asarray(x), P(sharded)) for k, x in params.items()}
    return optax_accum.as_reduced(placed, reduced)


def _batches() -> list:
    rng = np.random.default_rng(1)
    return [
        tuple(jax.reshard(jnp.asarray(rng.normal(size=s)), P("data")) for s in ((16, 16), (16, 4)))
        for _ in range(STEPS)
    ]


def _step(tx, params, state, batch, lag):
    grads = jax.grad(_loss)(params, batch)  # typed unreduced over "data": no all-reduce
    local_step = optax_accum.global_step(state) - lag
    return optax_accum.apply_gradients(tx, grads, state, params, local_step=local_step)


def _run(compiled, tree: dict, batches: list, start: int) -> list[dict]:
    """Steps `start`..STEPS-1 from `tree`; every tree after a step."""
    history = []
    for i in range(start, STEPS):
        params, state = compiled(tree["params"], tree["state"], batches[i], jnp.int32(LAGS[i]))
        tree = {"params": params, "state": state}
        history.append(tree)
    return history


def _values(tree) -> list[np.ndarray]:
    """The true value of every leaf, in NumPy."""
    return [np.asarray(x) for x in jax.tree.leaves(optax_accum.to_checkpoint(tree))]


def _true_value(x: jax.Array) -> np.ndarray:
    """An array's true value read from its device buffers in NumPy, on the data-parallel
    mesh: the sum of the partial sums for an unreduced array, any device's copy else."""
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    return np.sum(shards, axis=0) if _compat.sum_types(x)[1] else shards[0]


def _types(tree) -> list:
    return [jax.typeof(x) for x in jax.tree.leaves(tree)]


def _orbax_round_trip(directory: pathlib.Path, saved: dict, like: dict) -> dict:
    """`saved` through an Orbax checkpoint, restored into `to_checkpoint(like)`."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory.resolve() / "checkpoint", saved)
    checkpointer.wait_until_finished()
    target = optax_accum.to_checkpoint(like)
    restored = checkpointer.restore(directory.resolve() / "checkpoint", target)
    checkpointer.close()
    return restored


def _flax_round_trip(saved, like):
    """`saved` through `flax.serialization`'s bytes, restored into `like`'s structure."""
    return flax.serialization.from_bytes(like, flax.serialization.to_bytes(saved))


def _split_points(start: dict, history: list[dict]) -> dict[str, int]:
    """After which step the state holds gradients mid-window, and after which a release
    has just changed the params (each with a step left to run)."""
    points, before = {}, start
    for k in range(1, STEPS):
        tree = history[k - 1]
        changed = any(
            not np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(tree["params"]), jax.tree.leaves(before["params"]), strict=True
            )
        )
        if changed:
            points.setdefault("after_release", k)
        elif int(optax_accum.num_accumulated(tree["state"])) > 0:
            points.setdefault("mid_window", k)
        before = tree
    assert points.keys() == {"mid_window", "after_release"}, points
    return points


def _train(tx) -> tuple:
    """The compiled step, the start, the batches and every tree of 8 uninterrupted steps."""
    params = _params()
    start = {"params": params, "state": tx.init(params)}
    batches = _batches()
    step = jax.jit(functools.partial(_step, tx))
    compiled = step.lower(start["params"], start["state"], batches[0], jnp.int32(0)).compile()
    return compiled, start, batches, _run(compiled, start, batches, 0)


def _assert_saved_plain_true_values(tree, saved) -> None:
    assert any(_compat.sum_types(x)[1] for x in jax.tree.leaves(tree))  # sums to reduce
    for got, x in zip(jax.tree.leaves(saved), jax.tree.leaves(tree), strict=True):
        assert _compat.sum_types(got) == (frozenset(), frozenset()), jax.typeof(got)
        np.testing.assert_allclose(np.asarray(got), _true_value(x), rtol=1e-13)


@pytest.mark.parametrize("kind", list(KINDS))
def test_saved_mid_window_and_after_a_release_restore_and_continue(kind, tmp_path):
    tx = KINDS[kind]()
    with jax.set_mesh(_mesh("data")):
        compiled, start, batches, history = _train(tx)
        want = _values(history[-1])
        points = _split_points(start, history)

        def fresh():
            params = _params()
            return {"params": params, "state": tx.init(params)}

        like = jax.eval_shape(fresh)  # abstract, its shardings on an abstract mesh
        fresh_types = _types(fresh())
        saved = {}
        for name, k in points.items():
            saved[name] = optax_accum.to_checkpoint(history[k - 1])
            _assert_saved_plain_true_values(history[k - 1], saved[name])
        restored = {
            "orbax": _orbax_round_trip(tmp_path, saved, {name: like for name in points}),
            "flax": {name: _flax_round_trip(saved[name], like) for name in points},
        }
        for how, trees in restored.items():
            for name, k in points.items():
                back = optax_accum.from_checkpoint(trees[name], like)
                assert _types(back) == fresh_types, (how, name)
                for got, w in zip(_values(back), jax.tree.leaves(saved[name]), strict=True):
                    assert got.tobytes() == np.asarray(w).tobytes(), (how, name)  # exact
                final = _run(compiled, back, batches, k)[-1]  # the same compiled step
                for got, w in zip(_values(final), want, strict=True):
                    np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12, err_msg=how + name)


def test_a_save_reduces_each_unreduced_shard_once_and_a_restore_keeps_the_layout():
    """On the FSDP layout (params sharded over `fsdp`, reduced over `data`): the save
    program's collectives are all-reduces of the unreduced leaves' shards (their bytes,
    no more) and nothing else; the reduced params are saved over their own buffers;
    restored, every leaf has its fresh type (its layout) and its saved value."""
    tx = KINDS["conditional_accumulator"]()
    with jax.set_mesh(_mesh("fsdp")):
        params = _params("fsdp")
        like = {"params": params, "state": tx.init(params)}
        compiled = jax.jit(optax_accum.to_checkpoint).lower(like).compile()
        saved_params = optax_accum.to_checkpoint(params)
        saved = jax.tree.map(  # the sums given values of their own
            lambda s, x: np.arange(1.0, s.size + 1).reshape(s.shape) if _unreduced(x) else s,
            optax_accum.to_checkpoint(like),
            like,
        )
        back = optax_accum.from_checkpoint(saved, like)
        got = _values(back)
    sums = [x for x in jax.tree.leaves(like) if _unreduced(x)]
    assert len(sums) == len(params)  # the running sums
    found = collectives(compiled)
    assert {c.opcode for c in found} == {"all-reduce"}, found
    shard_bytes = sum(x.addressable_shards[0].data.nbytes for x in sums)
    assert sum(c.nbytes for c in found) == shard_bytes == (16 * 8 + 8 * 4) * 8 // 4
    for s, p in zip(jax.tree.leaves(saved_params), jax.tree.leaves(params), strict=True):
        assert _compat.sum_types(s) == (frozenset(), frozenset())
        assert s.sharding.spec == P(*p.sharding.spec.partitions)  # the layout kept
        pointers = [b.data.unsafe_buffer_pointer() for b in s.addressable_shards]
        assert pointers == [b.data.unsafe_buffer_pointer() for b in p.addressable_shards]
    assert _types(back) == _types(like)
    for g, w in zip(got, jax.tree.leaves(saved), strict=True):
        assert g.tobytes() == np.asarray(w).tobytes()


def _unreduced(x) -> bool:
    return bool(_compat.sum_types(x)[1])


@pytest.mark.parametrize("layout", ["one_device", "explicit_mesh", "auto_mesh"])
def test_plain_types_pass_through_unchanged(layout):
    """No reduced or unreduced leaf: both calls return what they are given (the same
    objects), and a NumPy leaf restored by flax is placed as the fresh leaf."""
    tx = KINDS["conditional_accumulator"]()
    mesh = {
        "one_device": None,
        "explicit_mesh": jax.make_mesh((8,), ("data",)),
        "auto_mesh": jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)),
    }[layout]
    context = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    with context:
        params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
        if mesh is not None:
            params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
        tree = {"params": params, "state": tx.init(params)}
        assert optax_accum.to_checkpoint(tree) is tree
        like = jax.eval_shape(lambda: tree)
        target = optax_accum.to_checkpoint(like)  # what Orbax restores into
        for t, x in zip(jax.tree.leaves(target), jax.tree.leaves(like), strict=True):
            if isinstance(getattr(x.sharding, "mesh", None), jax.sharding.AbstractMesh):
                assert t.sharding == jax.sharding.NamedSharding(mesh, x.sharding.spec)
                assert (t.shape, t.dtype) == (x.shape, x.dtype)
            else:  # no sharding, or a concrete one: the same struct
                assert t is x
        back = optax_accum.from_checkpoint(tree, tree)
        assert all(
            a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
        )
        from_flax = optax_accum.from_checkpoint(_flax_round_trip(tree, tree), tree)
    assert _types(from_flax) == _types(tree)
    for a, b in zip(jax.tree.leaves(from_flax), jax.tree.leaves(tree), strict=True):
        assert isinstance(a, jax.Array) and a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)
