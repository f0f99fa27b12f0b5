"""Malformed calls to every public entry point get a clear error, never a crash or a hang.

Each entry of BAD is one malformed call. It must raise ValueError or TypeError whose
message names the argument, what was expected and what came (checked with `match=`),
raised by optax_accum's own validation (the innermost frame is in the package), not
from deep inside JAX. Python values are rejected at construction; shapes, dtypes and
tree structure at trace time, under `jax.jit` as users call it.

HOST_BAD does the same for the stateful host accumulators and then checks that the
rejected call changed nothing: the counters, the global step, and the next take's
result. Every host call runs in a worker thread with a bounded wait, so a call that
blocks fails the test instead of hanging it.

Inside `jax.jit`, values cannot raise: the tests at the end check that an out-of-range
sparse row id and a capacity overflow are dropped (and the overflow counted in state).
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import optax_accum
from optax_accum import IndexedSlices

PACKAGE = pathlib.Path(optax_accum.__file__).parent
WAIT = 20.0  # seconds: the bound on any host call


@dataclasses.dataclass(frozen=True)
class Bad:
    """One malformed call: `call()` must raise `error` with a message matching `match`."""

    id: str
    call: Callable[[], Any]
    error: type[Exception]
    match: str


# --------------------------------------------------------------------------- fixtures

SGD = optax.sgd(1.0)
PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
GRADS = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
TABLE = jnp.zeros((10, 2))


def _slices(ids: Any, rows: Any, shape: tuple = (10, 2)) -> IndexedSlices:
    return IndexedSlices(jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.float32), shape)


def _jit_update(
    tx: optax.GradientTransformationExtraArgs,
    grads: Any,
    params: Any = None,
    state: Any = None,
    **extra: Any,
) -> Any:
    """`tx.update` under `jax.jit`, from `tx.init(params or PARAMS)` unless given a state."""
    init_params = PARAMS if params is None else params
    state = tx.init(init_params) if state is None else state
    return jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))(grads, state, params)


def _accumulate(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.conditional_accumulator(SGD, 2, **kw)


def _sparse(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, **{"capacity": 4, **kw}
    )


def _sparse_update(grads: Any, **extra: Any) -> Any:
    return _jit_update(_sparse(), grads, TABLE, **extra)


def _vmapped(tx: optax.GradientTransformationExtraArgs, axis: str, replicas: int = 4) -> Any:
    """`tx.update` of a [replicas] gradient under `jax.vmap(axis_name=axis)`."""

    def one(g):
        return tx.update(g, tx.init(g))[0]

    return jax.jit(jax.vmap(one, axis_name=axis))(jnp.ones((replicas, 2)))


def _agn(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.agn(SGD, 2, **kw)


def _drop(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.drop_stale_gradients(SGD, 1, **kw)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _train_state() -> optax_accum.TrainState:
    return optax_accum.TrainState.create(apply_fn=None, params=PARAMS, tx=_accumulate())


class _Tied(nn.Module):
    """An embedding whose table is also the output layer (attend): not row-sparse."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(10, 2)
        return embed.attend(embed(ids)).sum()


def _tied_params():
    return _Tied().init(jax.random.key(0), jnp.zeros(1, int))["params"]


def _tied_loss(params, ids):
    return _Tied().apply({"params": params}, ids)


def _embed_loss(params, ids):
    return nn.Embed(10, 2).apply({"params": params}, ids).sum()


UNBOUND = r"axis_name='i' is not bound here.*jax\.pmap, jax\.shard_map or jax\.vmap"
LOCAL_STEP_FLOAT = r"local_step must be an integer scalar, got (dtype float32|0\.5)"
LOCAL_STEP_VECTOR = r"local_step must be an integer scalar, got shape \(2,\)"
TREE = r"updates must have the tree structure of the params given to init: expected .*got"

BAD: list[Bad] = [
    # ---------------------------------------------------------------- conditional_accumulator
    Bad(
        "accumulator/num_required=0",
        lambda: optax_accum.conditional_accumulator(SGD, 0),
        ValueError,
        r"num_required must be a positive int, got 0",
    ),
    Bad(
        "accumulator/num_required=2.0",
        lambda: optax_accum.conditional_accumulator(SGD, 2.0),
        TypeError,
        r"num_required must be a positive int, got 2\.0 \(float\)",
    ),
    Bad(
        "accumulator/num_required=True",
        lambda: optax_accum.conditional_accumulator(SGD, True),
        TypeError,
        r"num_required must be a positive int, got True \(bool\)",
    ),
    Bad(
        "accumulator/reduction",
        lambda: _accumulate(reduction="max"),
        ValueError,
        r"reduction must be \"mean\" or \"sum\" \(any case\), got 'max'",
    ),
    Bad(
        "accumulator/accumulator_dtype=int32",
        lambda: _accumulate(accumulator_dtype=jnp.int32),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got int32",
    ),
    Bad(
        "accumulator/accumulator_dtype=bogus",
        lambda: _accumulate(accumulator_dtype="bogus"),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got 'bogus'",
    ),
    Bad(
        "accumulator/axis_name=list",
        lambda: _accumulate(axis_name=["i"]),
        TypeError,
        r"axis_name must be None, an axis name \(str\) or a tuple of axis names, got \['i'\]",
    ),
    Bad(
        "accumulator/skip_nonfinite=1",
        lambda: _accumulate(skip_nonfinite=1),
        TypeError,
        r"skip_nonfinite must be a bool, got 1 \(int\)",
    ),
    Bad(
        "accumulator/tree mismatch",
        lambda: _jit_update(_accumulate(), {"w": GRADS["w"]}),
        ValueError,
        TREE + r" PyTreeDef\(\{'w': \*\}\)",
    ),
    Bad(
        "accumulator/shape mismatch",
        lambda: _jit_update(_accumulate(), {**GRADS, "w": jnp.ones((3, 2))}),
        ValueError,
        r"updates\['w'\] must have shape \(2, 3\), got \(3, 2\)",
    ),
    Bad(
        "accumulator/integer gradient",
        lambda: _jit_update(_accumulate(), {**GRADS, "w": jnp.ones((2, 3), jnp.int32)}),
        TypeError,
        r"updates\['w'\] must be floating, got dtype int32",
    ),
    Bad(
        "accumulator/local_step float array",
        lambda: _jit_update(_accumulate(), GRADS, local_step=jnp.float32(1)),
        TypeError,
        LOCAL_STEP_FLOAT,
    ),
    Bad(
        "accumulator/local_step vector",
        lambda: _jit_update(_accumulate(), GRADS, local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "accumulator/local_step bool",
        lambda: _jit_update(_accumulate(), GRADS, local_step=True),
        TypeError,
        r"local_step must be an integer scalar, got True",
    ),
    Bad(
        "accumulator/local_step str",
        lambda: _jit_update(_accumulate(), GRADS, local_step="0"),
        TypeError,
        r"local_step must be an integer scalar, got '0'",
    ),
    Bad(
        "accumulator/unbound axis_name",
        lambda: _jit_update(_accumulate(axis_name="i"), GRADS),
        ValueError,
        UNBOUND,
    ),
    # ------------------------------------------------------------- sparse_conditional_accumulator
    Bad(
        "sparse/inner='sgd'",
        lambda: optax_accum.sparse_conditional_accumulator("sgd", 2, capacity=4),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "sparse/capacity=0",
        lambda: _sparse(capacity=0),
        ValueError,
        r"capacity must be a positive int, got 0",
    ),
    Bad(
        "sparse/capacity=4.0",
        lambda: _sparse(capacity=4.0),
        TypeError,
        r"capacity must be a positive int, got 4\.0 \(float\)",
    ),
    Bad(
        "sparse/num_required=-1",
        lambda: optax_accum.sparse_conditional_accumulator(SGD, -1, capacity=4),
        ValueError,
        r"num_required must be a positive int, got -1",
    ),
    Bad(
        "sparse/reduction",
        lambda: _sparse(reduction="avg"),
        ValueError,
        r"reduction must be \"mean\" or \"sum\" \(any case\), got 'avg'",
    ),
    Bad(
        "sparse/sparse mask of another tree",
        lambda: _sparse(sparse={"a": True}).init(PARAMS),
        ValueError,
        r"sparse must be a tree of bools with the params' structure.*expected .*got "
        r"PyTreeDef\(\{'a': \*\}\)",
    ),
    Bad(
        "sparse/sparse mask of ints",
        lambda: _sparse(sparse={"w": 1, "b": 0}),
        TypeError,
        r"sparse must be a bool, got [01] \(int\)",
    ),
    Bad(
        "sparse/table of zero rows",
        lambda: _sparse(sparse=True).init(jnp.zeros((0, 2))),
        ValueError,
        r"params must have at least one row to be sparse, got shape \(0, 2\)",
    ),
    Bad(
        "sparse/IndexedSlices for a scalar leaf",
        lambda: _jit_update(
            _sparse(sparse={"w": False, "b": False}),
            {"w": GRADS["w"], "b": IndexedSlices(jnp.array([0]), jnp.ones((1,)), (1,))},
            {"w": jnp.zeros((2, 3)), "b": jnp.zeros(())},
        ),
        ValueError,
        r"updates\['b'\] must have dense_shape \(\), got \(1,\)",
    ),
    Bad(
        "sparse/dense gradient for a sparse leaf",
        lambda: _sparse_update(jnp.ones((10, 2))),
        TypeError,
        r"updates must be an IndexedSlices \(this leaf accumulates sparsely\), got",
    ),
    Bad(
        "sparse/dense_shape mismatch",
        lambda: _sparse_update(_slices([0], [[1, 2]], (11, 2))),
        ValueError,
        r"updates must have dense_shape \(10, 2\), got \(11, 2\)",
    ),
    Bad(
        "sparse/integer values",
        lambda: _sparse_update(IndexedSlices(jnp.array([0]), jnp.ones((1, 2), jnp.int32), (10, 2))),
        TypeError,
        r"updates\.values must be floating, got dtype int32",
    ),
    Bad(
        "sparse/local_step vector",
        lambda: _sparse_update(_slices([0], [[1, 2]]), local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "sparse/unbound axis_name",
        lambda: _jit_update(_sparse(axis_name="i"), _slices([0], [[1, 2]]), TABLE),
        ValueError,
        UNBOUND,
    ),
    # ---------------------------------------------------------------- IndexedSlices
    Bad(
        "IndexedSlices/list indices",
        lambda: IndexedSlices([0, 1], jnp.ones((2, 2)), (10, 2)),
        TypeError,
        r"IndexedSlices indices must be an array \(jax\.Array or numpy\.ndarray\), got list",
    ),
    Bad(
        "IndexedSlices/list values",
        lambda: IndexedSlices(jnp.array([0]), [[1.0, 2.0]], (10, 2)),
        TypeError,
        r"IndexedSlices values must be an array \(jax\.Array or numpy\.ndarray\), got list",
    ),
    Bad(
        "IndexedSlices/float indices",
        lambda: IndexedSlices(jnp.array([0.0]), jnp.ones((1, 2)), (10, 2)),
        TypeError,
        r"IndexedSlices\.indices must be integer, got dtype float32",
    ),
    Bad(
        "IndexedSlices/matrix indices",
        lambda: IndexedSlices(jnp.array([[0]]), jnp.ones((1, 2)), (10, 2)),
        ValueError,
        r"indices must be a vector, got shape \(1, 1\)",
    ),
    Bad(
        "IndexedSlices/scalar values",
        lambda: IndexedSlices(jnp.array([0]), jnp.float32(1), (10, 2)),
        ValueError,
        r"values must have rank >= 1 \(one row per index\), got a scalar",
    ),
    Bad(
        "IndexedSlices/rows != indices",
        lambda: IndexedSlices(jnp.array([0, 1]), jnp.ones((1, 2)), (10, 2)),
        ValueError,
        r"values must have one row per index: expected 2 rows, got values of shape \(1, 2\)",
    ),
    Bad(
        "IndexedSlices/row shape",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 3)), (10, 2)),
        ValueError,
        r"values rows must have shape dense_shape\[1:\] = \(2,\), got \(3,\)",
    ),
    Bad(
        "IndexedSlices/dense_shape=None",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), None),
        TypeError,
        r"dense_shape must be a tuple of ints, got None",
    ),
    Bad(
        "IndexedSlices/dense_shape str",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), "10,2"),
        TypeError,
        r"dense_shape must be a tuple of ints, got '10,2' \(str\)",
    ),
    Bad(
        "IndexedSlices/dense_shape float",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (10.5, 2)),
        TypeError,
        r"dense_shape must be a tuple of ints, got \(10\.5, 2\)",
    ),
    Bad(
        "IndexedSlices/dense_shape=()",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), ()),
        ValueError,
        r"dense_shape must have at least one dimension \(the rows\), got \(\)",
    ),
    Bad(
        "IndexedSlices/negative dense_shape",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (10, -2)),
        ValueError,
        r"dense_shape must hold non-negative sizes.*got \(10, -2\)",
    ),
    Bad(
        "IndexedSlices/arithmetic",
        lambda: _slices([0], [[1, 2]]) * 2.0,
        TypeError,
        r"IndexedSlices does not support arithmetic",
    ),
    Bad(
        "IndexedSlices/as an array",
        lambda: jnp.asarray(_slices([0], [[1, 2]])),
        TypeError,
        r"IndexedSlices is not an array; call \.to_dense\(\)",
    ),
    Bad(
        "IndexedSlices.to_dense/unknown rows",
        lambda: IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (-1, 2)).to_dense(),
        ValueError,
        r"to_dense\(\) needs a known number of rows, but dense_shape is \(-1, 2\)",
    ),
    Bad(
        "IndexedSlices.from_dense/scalar",
        lambda: IndexedSlices.from_dense(jnp.float32(1)),
        ValueError,
        r"dense must have rank >= 1, got shape \(\)",
    ),
    Bad(
        "IndexedSlices.from_dense/num_rows=-1",
        lambda: IndexedSlices.from_dense(jnp.ones((3, 2)), -1),
        ValueError,
        r"num_rows must be None or an int >= 0, got -1",
    ),
    Bad(
        "IndexedSlices.from_dense/too many rows",
        lambda: IndexedSlices.from_dense(jnp.ones((3, 2)), 1),
        ValueError,
        r"dense has 3 nonzero rows, more than num_rows=1",
    ),
    # ---------------------------------------------------------------- apply_updates, densify
    Bad(
        "apply_updates/row count mismatch",
        lambda: jax.jit(optax_accum.apply_updates)(jnp.zeros((5, 2)), _slices([0], [[1, 2]])),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(5, 2\)",
    ),
    Bad(
        "apply_updates/tree mismatch",
        lambda: jax.jit(optax_accum.apply_updates)({"a": jnp.zeros(2)}, {"b": jnp.zeros(2)}),
        ValueError,
        r"updates must have the tree structure of params: expected PyTreeDef\(\{'a': \*\}\), "
        r"got PyTreeDef\(\{'b': \*\}\)",
    ),
    Bad(
        "apply_updates/vector param",
        lambda: jax.jit(optax_accum.apply_updates)(jnp.zeros(10), _slices([0], [[1, 2]])),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(10,\)",
    ),
    Bad(
        "densify/param mismatch",
        lambda: jax.jit(lambda g, p: optax_accum.densify().update(g, optax.EmptyState(), p))(
            _slices([0], [[1, 2]]), jnp.zeros((4, 2))
        ),
        ValueError,
        r"updates has dense_shape \(10, 2\), which does not match the param's shape \(4, 2\)",
    ),
    Bad(
        "densify/unknown rows without params",
        lambda: optax_accum.densify().update(
            IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (-1, 2)), optax.EmptyState()
        ),
        ValueError,
        r"needs a known number of rows, but dense_shape is \(-1, 2\)",
    ),
    # ---------------------------------------------------------------- cross_shard(_optimizer)
    Bad(
        "cross_shard/axis_name=None",
        lambda: optax_accum.cross_shard(None),
        TypeError,
        r"axis_name must be an axis name \(str\) or a tuple of axis names, got None",
    ),
    Bad(
        "cross_shard/reduction",
        lambda: optax_accum.cross_shard("i", reduction="max"),
        ValueError,
        r"reduction must be \"mean\" or \"sum\" \(any case\), got 'max'",
    ),
    Bad(
        "cross_shard/group_assignment flat list",
        lambda: optax_accum.cross_shard("i", group_assignment=[0, 1]),
        ValueError,
        r"group_assignment must be a list of list.*got \[0, 1\]",
    ),
    Bad(
        "cross_shard/group_assignment unequal",
        lambda: optax_accum.cross_shard("i", group_assignment=[[0], [1, 2]]),
        ValueError,
        r"size of each subgroup in group_assignment must be equal, got sizes \[1, 2\]",
    ),
    Bad(
        "cross_shard/group_assignment repeats an id",
        lambda: optax_accum.cross_shard("i", group_assignment=[[0, 1], [1, 2], [3, 0]]),
        ValueError,
        r"group_assignment must not repeat a replica id.*got \[0, 1\] more than once",
    ),
    Bad(
        "cross_shard/group_assignment not a permutation",
        lambda: optax_accum.cross_shard("i", group_assignment=[[0, 5]]),
        ValueError,
        r"group_assignment must be a permutation of range\(2\), got \[\[0, 5\]\]",
    ),
    Bad(
        "cross_shard/group_assignment float ids",
        lambda: optax_accum.cross_shard("i", group_assignment=[[0.0, 1.0]]),
        ValueError,
        r"group_assignment must be a list of list of int replica ids, got \[\[0\.0, 1\.0\]\]",
    ),
    Bad(
        "cross_shard/group_assignment vs axis size",
        lambda: _vmapped(optax_accum.cross_shard("i", group_assignment=[[0, 1]]), "i"),
        ValueError,
        r"group_assignment must be a permutation of range\(4\) \(the size of axis 'i'\), "
        r"got the 2 replica ids",
    ),
    Bad(
        "cross_shard/communication_dtype=int8",
        lambda: optax_accum.cross_shard("i", communication_dtype=jnp.int8),
        TypeError,
        r"communication_dtype must be a floating dtype, got int8",
    ),
    Bad(
        "cross_shard/pack='yes'",
        lambda: optax_accum.cross_shard("i", pack="yes"),
        TypeError,
        r"pack must be a bool, got 'yes' \(str\)",
    ),
    Bad(
        "cross_shard/unbound axis_name",
        lambda: _vmapped(optax_accum.cross_shard("i"), "j"),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "cross_shard/integer gradient",
        lambda: jax.vmap(
            lambda g: optax_accum.cross_shard("i").update(g, optax.EmptyState())[0],
            axis_name="i",
        )(jnp.ones(2, jnp.int32)),
        TypeError,
        r"updates must be floating, got dtype int32",
    ),
    Bad(
        "cross_shard_optimizer/group_assignment str",
        lambda: optax_accum.cross_shard_optimizer(SGD, "i", group_assignment="01"),
        ValueError,
        r"group_assignment must be a list of list.*got '01'",
    ),
    Bad(
        "cross_shard_optimizer/unbound axis_name",
        lambda: _vmapped(optax_accum.cross_shard_optimizer(SGD, "i"), "j"),
        ValueError,
        UNBOUND,
    ),
    # ---------------------------------------------------------------- sharding helpers
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
            _accumulate(axis_name="data"), jnp.zeros(3), _mesh(), grad_axes=("model",)
        ),
        ValueError,
        r"grad_axes must name axes of the mesh \('data',\), got \['model'\]",
    ),
    Bad(
        "state_partition_specs/mesh=None",
        lambda: optax_accum.state_partition_specs(_accumulate(), jnp.zeros(3), None),
        TypeError,
        r"mesh must be a jax\.sharding\.Mesh, got None \(NoneType\)",
    ),
    Bad(
        "state_partition_specs/tx='sgd'",
        lambda: optax_accum.state_partition_specs("sgd", jnp.zeros(3), _mesh()),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    # ---------------------------------------------------------------- drop_stale_gradients
    Bad(
        "drop_stale/staleness=1.5",
        lambda: optax_accum.drop_stale_gradients(SGD, 1.5),
        TypeError,
        r"staleness must be an int \(or an int/float scalar array\), got 1\.5",
    ),
    Bad(
        "drop_stale/staleness='1'",
        lambda: optax_accum.drop_stale_gradients(SGD, "1"),
        TypeError,
        r"staleness must be an int \(or an int/float scalar array\), got '1'",
    ),
    Bad(
        "drop_stale/staleness vector",
        lambda: optax_accum.drop_stale_gradients(SGD, jnp.ones(2)),
        TypeError,
        r"staleness must be a scalar, got Array\(\[1\., 1\.\]",
    ),
    Bad(
        "drop_stale/axis_name=3.0",
        lambda: _drop(axis_name=3.0),
        TypeError,
        r"axis_name must be None, an axis name \(str\) or a tuple of axis names, got 3\.0",
    ),
    Bad(
        "drop_stale/local_step=0.5",
        lambda: _jit_update(_drop(), GRADS, local_step=0.5),
        TypeError,
        LOCAL_STEP_FLOAT,
    ),
    Bad(
        "drop_stale/local_step vector",
        lambda: _jit_update(_drop(), GRADS, local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "drop_stale/unbound axis_name",
        lambda: _jit_update(_drop(axis_name="i"), GRADS),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "staleness_percentage/not a drop_stale_gradients state",
        lambda: optax_accum.staleness_percentage(_accumulate().init(PARAMS)),
        ValueError,
        r"state holds no DropStaleGradientsState.*got ConditionalAccumulatorState",
    ),
    # ---------------------------------------------------------------- agn
    Bad(
        "agn/communication_period=0",
        lambda: optax_accum.agn(SGD, 0),
        ValueError,
        r"communication_period must be a positive int, got 0",
    ),
    Bad(
        "agn/communication_period=2.0",
        lambda: optax_accum.agn(SGD, 2.0),
        TypeError,
        r"communication_period must be a positive int, got 2\.0 \(float\)",
    ),
    Bad(
        "agn/commit",
        lambda: _agn(commit="params"),
        ValueError,
        r"commit must be \"gradients\" or \"delta\", got 'params'",
    ),
    Bad(
        "agn/accumulator_dtype=int8",
        lambda: _agn(accumulator_dtype=jnp.int8),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got int8",
    ),
    Bad(
        "agn/skip_nonfinite=None",
        lambda: _agn(skip_nonfinite=None),
        TypeError,
        r"skip_nonfinite must be a bool, got None",
    ),
    Bad(
        "agn/inner='sgd'",
        lambda: optax_accum.agn("sgd", 2),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd' "
        r"\(str\)",
    ),
    Bad(
        "agn/outer=optax module",
        lambda: _agn(outer=optax),
        TypeError,
        r"outer must be None or an optax\.GradientTransformation.*got <module 'optax'",
    ),
    Bad(
        "agn/missing params",
        lambda: _jit_update(_agn(), GRADS),
        ValueError,
        r"agn needs params: call update\(grads, state, params\).*got params=None",
    ),
    Bad(
        "agn/params of another tree",
        lambda: _jit_update(_agn(), GRADS, {"w": PARAMS["w"]}, state=_agn().init(PARAMS)),
        ValueError,
        r"params must have the tree structure of the params given to init: .*got "
        r"PyTreeDef\(\{'w': \*\}\)",
    ),
    Bad(
        "agn/gradient shape",
        lambda: _jit_update(_agn(), {**GRADS, "w": jnp.ones((3, 2))}, PARAMS),
        ValueError,
        r"updates\['w'\] must have shape \(2, 3\), got \(3, 2\)",
    ),
    Bad(
        "agn/unbound axis_name",
        lambda: _jit_update(_agn(axis_name="i"), GRADS, PARAMS),
        ValueError,
        UNBOUND,
    ),
    # ---------------------------------------------------------------- embedding_value_and_grad
    Bad(
        "embedding_value_and_grad/tied table used by attend",
        lambda: optax_accum.embedding_value_and_grad(_tied_loss)(_tied_params(), jnp.array([1])),
        ValueError,
        r"nn\.Embed at \('Embed_0',\) is used by attend\(\).*not row-sparse; use "
        r"jax\.value_and_grad",
    ),
    Bad(
        "embedding_value_and_grad/loss_fn not callable",
        lambda: optax_accum.embedding_value_and_grad("loss"),
        TypeError,
        r"loss_fn must be callable, got 'loss' \(str\)",
    ),
    Bad(
        "embedding_value_and_grad/has_aux='yes'",
        lambda: optax_accum.embedding_value_and_grad(_embed_loss, has_aux="yes"),
        TypeError,
        r"has_aux must be a bool, got 'yes' \(str\)",
    ),
    # ---------------------------------------------------------------- foreign states
    Bad(
        "sparse.update/state of another transform",
        lambda: _jit_update(_sparse(), _slices([0], [[1, 2]]), TABLE, state=optax.EmptyState()),
        TypeError,
        r"state must be a SparseConditionalAccumulatorState \(as returned by this "
        r"transform's init\), got EmptyState",
    ),
    Bad(
        "agn.update/state of another transform",
        lambda: _jit_update(_agn(), GRADS, PARAMS, state=_drop().init(PARAMS)),
        TypeError,
        r"state must be a AGNState \(as returned by this transform's init\), got "
        r"DropStaleGradientsState",
    ),
    Bad(
        "drop_stale.update/state of another transform",
        lambda: _jit_update(_drop(), GRADS, state=_accumulate().init(PARAMS)),
        TypeError,
        r"state must be a DropStaleGradientsState \(as returned by this transform's init\), "
        r"got ConditionalAccumulatorState",
    ),
    # ---------------------------------------------------------------- state accessors
    Bad(
        "global_step/no step state",
        lambda: optax_accum.global_step(optax.EmptyState()),
        ValueError,
        r"state holds no optax_accum step state.*got EmptyState",
    ),
    Bad(
        "num_accumulated/stateless transform",
        lambda: optax_accum.num_accumulated(
            optax_accum.cross_shard_optimizer(SGD, "i").init(PARAMS)
        ),
        ValueError,
        r"state holds no optax_accum step state.*got tuple",
    ),
    Bad(
        "num_accumulated/drop_stale_gradients has no count",
        lambda: optax_accum.num_accumulated(_drop().init(PARAMS)),
        ValueError,
        r"DropStaleGradientsState has no 'count' field",
    ),
    Bad(
        "has_updated/no step state",
        lambda: optax_accum.has_updated({}),
        ValueError,
        r"state holds no optax_accum step state.*got dict",
    ),
    Bad(
        "set_global_step/float",
        lambda: optax_accum.set_global_step(_accumulate().init(PARAMS), 1.5),
        TypeError,
        r"new_global_step must be an integer scalar, got 1\.5",
    ),
    Bad(
        "set_global_step/vector",
        lambda: optax_accum.set_global_step(_accumulate().init(PARAMS), jnp.zeros(2, jnp.int32)),
        ValueError,
        r"new_global_step must be an integer scalar, got shape \(2,\)",
    ),
    Bad(
        "set_global_step/None",
        lambda: optax_accum.set_global_step(_accumulate().init(PARAMS), None),
        TypeError,
        r"new_global_step must be an integer scalar, got None",
    ),
    # ---------------------------------------------------------------- TrainState
    Bad(
        "TrainState.apply_gradients/gradient tree",
        lambda: _train_state().apply_gradients(grads={"w": GRADS["w"]}),
        ValueError,
        TREE,
    ),
    Bad(
        "TrainState.apply_gradients/local_step=0.5",
        lambda: _train_state().apply_gradients(grads=GRADS, local_step=0.5),
        TypeError,
        r"local_step must be an integer scalar, got 0\.5",
    ),
    Bad(
        "conditional_accumulator/inner='sgd'",
        lambda: optax_accum.conditional_accumulator("sgd", 2),
        TypeError,
        r"inner must be an optax\.GradientTransformation.*got 'sgd'",
    ),
    Bad(
        "conditional_accumulator.update/state of another transform",
        lambda: _jit_update(_accumulate(), GRADS, state=optax.EmptyState()),
        TypeError,
        r"state must be a ConditionalAccumulatorState.*got EmptyState",
    ),
    Bad(
        "conditional_accumulator/num_required schedule returns a float",
        lambda: _jit_update(optax_accum.conditional_accumulator(SGD, lambda s: 2.5), GRADS),
        TypeError,
        r"num_required.*must return an integer.*got.*float",
    ),
    Bad(
        "state_partition_specs/scalar state leaf that differs between replicas",
        lambda: optax_accum.state_partition_specs(
            _accumulate(skip_nonfinite=True), jnp.zeros(3), _mesh()
        ),
        ValueError,
        r"state.*is a scalar that differs between replicas",
    ),
    Bad(
        "drop_stale_gradients/inner='sgd'",
        lambda: optax_accum.drop_stale_gradients("sgd", 1),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "apply_gradients/tx='sgd'",
        lambda: optax_accum.apply_gradients("sgd", GRADS, optax.EmptyState(), GRADS),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "apply_gradients/grads of another structure",
        lambda: optax_accum.apply_gradients(
            _accumulate(), {"x": GRADS}, _accumulate().init(GRADS), GRADS
        ),
        ValueError,
        r"updates must have the tree structure of the params",
    ),
    Bad(
        "NNXOptimizer/tx='sgd'",
        lambda: optax_accum.NNXOptimizer(_nnx_model(), "sgd", wrt=_nnx_param()),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "cross_shard_optimizer/inner='sgd'",
        lambda: optax_accum.cross_shard_optimizer("sgd", "i"),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
]


def _nnx_model():
    from flax import nnx

    return nnx.Linear(2, 1, rngs=nnx.Rngs(0))


def _nnx_param():
    from flax import nnx

    return nnx.Param


def _raised_by_optax_accum(info: pytest.ExceptionInfo) -> bool:
    """Whether the innermost frame of the traceback is optax_accum's own code."""
    return PACKAGE in pathlib.Path(str(info.traceback[-1].path)).parents


def test_enough_malformed_calls_across_the_public_api():
    calls = BAD + HOST_BAD + STATEFUL_BAD
    assert len(calls) >= 40
    named = {b.id.split("/")[0].split(".")[0] for b in calls}
    public = set(optax_accum.__all__) - {
        # State NamedTuples are built by init, never by hand; their misuse is covered
        # through the functions that take a state.
        "AGNState",
        "ConditionalAccumulatorState",
        "DenseRows",
        "DropStaleGradientsState",
        "RowBuffer",
        "SparseConditionalAccumulatorState",
    }
    short = {"accumulator": "conditional_accumulator", "sparse": "sparse_conditional_accumulator"}
    short |= {"drop_stale": "drop_stale_gradients", "sparse_sgd": "sparse_sgd"}
    covered = {short.get(n, n) for n in named}
    assert public - covered <= {"sparse_sgd"}, public - covered


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_malformed_call_raises_a_clear_error(bad: Bad):
    with pytest.raises(bad.error, match=bad.match) as info:
        bad.call()
    assert _raised_by_optax_accum(info), f"raised outside optax_accum: {info.traceback[-1]}"


# --------------------------------------------------------------------------- host objects


def _in_thread(call: Callable[[], Any]) -> Any:
    """Runs `call` in a daemon thread, waits at most WAIT seconds, re-raises its error."""
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), f"call still blocked after {WAIT} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _dense_acc(**kw: Any) -> optax_accum.ConditionalAccumulator:
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), **kw)
    acc.apply_grad(np.array([1.0, 2.0], np.float32), local_step=0)
    acc.apply_grad(np.array([3.0, 6.0], np.float32), local_step=0)
    return acc


def _sparse_acc(**kw: Any) -> optax_accum.SparseConditionalAccumulator:
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2), **kw)
    acc.apply_grad([0, 1], np.array([[1.0, 0.0], [0.0, 2.0]], np.float32), local_step=0)
    acc.apply_grad([0], np.array([[3.0, 4.0]], np.float32), local_step=0)
    return acc


def _snapshot(acc: Any) -> tuple:
    return (
        acc.num_accumulated(),
        acc.global_step,
        acc.num_dropped,
        acc.num_nonfinite,
        acc.num_waiting_takes(),
    )


def _dense_take_after(acc: Any) -> list:
    """Applies one more gradient and takes: the mean of [1,2], [3,6] and [2,4]."""
    acc.apply_grad(np.array([2.0, 4.0], np.float32), local_step=0)
    return np.asarray(_in_thread(lambda: acc.take_grad(3, timeout=WAIT))).tolist()


def _sparse_take_after(acc: Any) -> list:
    acc.apply_grad([3], np.array([[5.0, 5.0]], np.float32), local_step=0)
    indices, values, shape = _in_thread(lambda: acc.take_grad(3, timeout=WAIT))
    return [indices.tolist(), np.asarray(values).tolist(), shape]


def _deleted(x: jax.Array) -> jax.Array:
    x.delete()
    return x


DENSE_TAKE = [2.0, 4.0]
SPARSE_TAKE = [[0, 1, 3], [[2.0, 2.0], [0.0, 2.0], [5.0, 5.0]], (4, 2)]

F32 = np.float32
ROW = np.ones((1, 2), F32)
DENSE_GRAD = np.ones(2, F32)

HOST_BAD: list[Bad] = [
    # ---------------------------------------------------------------- construction
    Bad(
        "ConditionalAccumulator/dtype=int32",
        lambda: optax_accum.ConditionalAccumulator(np.int32),
        TypeError,
        r"dtype must be one of float16, bfloat16, float32, float64, got <class 'numpy\.int32'>",
    ),
    Bad(
        "ConditionalAccumulator/dtype=None",
        lambda: optax_accum.ConditionalAccumulator(None),
        TypeError,
        r"dtype must be one of float16, bfloat16, float32, float64, got None",
    ),
    Bad(
        "ConditionalAccumulator/negative shape",
        lambda: optax_accum.ConditionalAccumulator(F32, shape=(-2,)),
        ValueError,
        r"shape must hold non-negative ints \(None or -1 for unknown dims\), got \(-2,\)",
    ),
    Bad(
        "ConditionalAccumulator/float shape",
        lambda: optax_accum.ConditionalAccumulator(F32, shape=(2.0,)),
        ValueError,
        r"shape must hold non-negative ints .*got \(2\.0,\)",
    ),
    Bad(
        "ConditionalAccumulator/shared_name=3",
        lambda: optax_accum.ConditionalAccumulator(F32, shared_name=3),
        TypeError,
        r"shared_name must be None or a str, got 3",
    ),
    Bad(
        "ConditionalAccumulator/name=3",
        lambda: optax_accum.ConditionalAccumulator(F32, name=3),
        TypeError,
        r"name must be a str, got 3",
    ),
    Bad(
        "ConditionalAccumulator/reduction_type",
        lambda: optax_accum.ConditionalAccumulator(F32, reduction_type="MAX"),
        ValueError,
        r"reduction_type must be \"mean\" or \"sum\" \(any case\), got 'MAX'",
    ),
    Bad(
        "SparseConditionalAccumulator/skip_nonfinite='no'",
        lambda: optax_accum.SparseConditionalAccumulator(F32, skip_nonfinite="no"),
        TypeError,
        r"skip_nonfinite must be a bool, got 'no' \(str\)",
    ),
]


@dataclasses.dataclass(frozen=True)
class HostBad:
    """A malformed call on a host accumulator built by `make`; state must not change."""

    id: str
    make: Callable[[], Any]
    call: Callable[[Any], Any]
    error: type[Exception]
    match: str
    take_after: Callable[[Any], Any]
    expected_take: Any


def _dense(id, call, error, match):
    return HostBad(
        f"ConditionalAccumulator.{id}",
        _dense_acc,
        call,
        error,
        match,
        _dense_take_after,
        DENSE_TAKE,
    )


def _sparse_host(id, call, error, match):
    return HostBad(
        f"SparseConditionalAccumulator.{id}",
        _sparse_acc,
        call,
        error,
        match,
        _sparse_take_after,
        SPARSE_TAKE,
    )


STATEFUL_BAD: list[HostBad] = [
    _dense(
        "apply_grad/shape",
        lambda a: a.apply_grad(np.ones(3, F32)),
        ValueError,
        r"grad must have a shape compatible with the accumulator's shape \(2,\), got \(3,\)",
    ),
    _dense(
        "apply_grad/float64 into float32",
        lambda a: a.apply_grad(np.ones(2, np.float64)),
        TypeError,
        r"grad must have the accumulator's dtype float32, got float64",
    ),
    _dense(
        "apply_grad/int32",
        lambda a: a.apply_grad(np.ones(2, np.int32)),
        TypeError,
        r"grad must have the accumulator's dtype float32, got int32",
    ),
    _dense(
        "apply_grad/str",
        lambda a: a.apply_grad("grad"),
        TypeError,
        r"grad must be an array or nested list of numbers",
    ),
    _dense(
        "apply_grad/stale and malformed",
        lambda a: a.apply_grad(np.ones(3, F32), local_step=-5),
        ValueError,
        r"grad must have a shape compatible with the accumulator's shape \(2,\), got \(3,\)",
    ),
    _dense(
        "apply_grad/None",
        lambda a: a.apply_grad(None),
        TypeError,
        r"grad must be an array or nested list of numbers, got None",
    ),
    _dense(
        "apply_grad/local_step=1.0",
        lambda a: a.apply_grad(DENSE_GRAD, local_step=1.0),
        TypeError,
        r"local_step must be an int, got 1\.0 \(float\)",
    ),
    _dense(
        "apply_grad/local_step vector",
        lambda a: a.apply_grad(DENSE_GRAD, local_step=np.array([1, 2])),
        TypeError,
        r"local_step must be an int, got array\(\[1, 2\]\)",
    ),
    _dense(
        "take_grad/num_required=0",
        lambda a: a.take_grad(0, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _dense(
        "take_grad/num_required=-1",
        lambda a: a.take_grad(-1, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was -1",
    ),
    _dense(
        "take_grad/num_required=1.5",
        lambda a: a.take_grad(1.5, timeout=WAIT),
        TypeError,
        r"num_required must be a positive int, got 1\.5 \(float\)",
    ),
    _dense(
        "take_grad/timeout=-1",
        lambda a: a.take_grad(1, timeout=-1),
        ValueError,
        r"timeout must be None or >= 0 seconds, got -1",
    ),
    _dense(
        "take_grad/timeout='1'",
        lambda a: a.take_grad(1, timeout="1"),
        TypeError,
        r"timeout must be None or a number of seconds, got '1'",
    ),
    _dense(
        "set_global_step/1.5",
        lambda a: a.set_global_step(1.5),
        TypeError,
        r"new_global_step must be an int, got 1\.5 \(float\)",
    ),
    _dense(
        "set_global_step/None",
        lambda a: a.set_global_step(None),
        TypeError,
        r"new_global_step must be an int, got None",
    ),
    _dense(
        "apply_grad/deleted jax array",
        lambda a: a.apply_grad(_deleted(jnp.ones(2))),
        ValueError,
        r"grad must be a live array, got one whose buffer was deleted \(donated to a jit",
    ),
    _dense(
        "take_grad/num_required vector",
        lambda a: a.take_grad(np.array([1, 2]), timeout=WAIT),
        TypeError,
        r"num_required must be a positive int, got array\(\[1, 2\]\) \(ndarray\)",
    ),
    _dense(
        "take_grad/num_required 0-d array 0",
        lambda a: a.take_grad(jnp.array(0), timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _sparse_host(
        "apply_grad/float indices",
        lambda a: a.apply_grad(np.array([0.0]), ROW),
        TypeError,
        r"grad_indices must be integers, got dtype float64",
    ),
    _sparse_host(
        "apply_grad/matrix indices",
        lambda a: a.apply_grad(np.array([[0]]), ROW),
        ValueError,
        r"grad_indices must be a vector, got shape \[1, 1\]",
    ),
    _sparse_host(
        "apply_grad/scalar values",
        lambda a: a.apply_grad(np.array([0]), F32(1)),
        ValueError,
        r"grad_values cannot be 0-dimensional; expected \[nnz, \.\.\.\]",
    ),
    _sparse_host(
        "apply_grad/rows != indices",
        lambda a: a.apply_grad(np.array([0, 1]), ROW),
        ValueError,
        r"grad_values must have one row per index: expected 2 rows, got 1",
    ),
    _sparse_host(
        "apply_grad/index out of range",
        lambda a: a.apply_grad(np.array([4]), ROW),
        ValueError,
        r"grad_indices\[0\] = 4 exceeds the accumulator's shape\[0\] = 4",
    ),
    _sparse_host(
        "apply_grad/negative index",
        lambda a: a.apply_grad(np.array([1, -1]), np.ones((2, 2), F32)),
        ValueError,
        r"grad_indices\[1\] = -1 is negative; indices must be row ids",
    ),
    _sparse_host(
        "apply_grad/values dtype",
        lambda a: a.apply_grad(np.array([0]), np.ones((1, 2), np.float64)),
        TypeError,
        r"grad_values must have the accumulator's dtype float32, got float64",
    ),
    _sparse_host(
        "apply_grad/values row shape",
        lambda a: a.apply_grad(np.array([0]), np.ones((1, 3), F32)),
        ValueError,
        r"grad_values dim 1 must be 2 \(the accumulator's shape \(4, 2\)\), got 3",
    ),
    _sparse_host(
        "apply_grad/grad_shape rank",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=[4]),
        ValueError,
        r"grad_shape must have rank at least 2 \(the accumulator's shape \(4, 2\)\), got \(4,\)",
    ),
    _sparse_host(
        "apply_grad/grad_shape dim",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=[5, 2]),
        ValueError,
        r"grad_shape dim 0 must be 4 \(the accumulator's shape \(4, 2\)\), got 5",
    ),
    _sparse_host(
        "apply_grad/grad_shape str",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape="4,2"),
        ValueError,
        r"grad_shape must hold non-negative ints \(None or -1 for unknown dims\), got '4,2'",
    ),
    _sparse_host(
        "apply_grad/grad_shape float array",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=jnp.array([4.0, 2.0])),
        ValueError,
        r"grad_shape must hold non-negative ints \(None or -1 for unknown dims\), got Array",
    ),
    _sparse_host(
        "apply_grad/deleted values",
        lambda a: a.apply_grad(np.array([0]), _deleted(jnp.ones((1, 2)))),
        ValueError,
        r"grad_values must be a live array, got one whose buffer was deleted",
    ),
    _sparse_host(
        "apply_grad/local_step=0.5",
        lambda a: a.apply_grad(np.array([0]), ROW, local_step=0.5),
        TypeError,
        r"local_step must be an int, got 0\.5 \(float\)",
    ),
    _sparse_host(
        "apply_indexed_slices_grad/not IndexedSlices",
        lambda a: a.apply_indexed_slices_grad((np.array([0]), ROW)),
        TypeError,
        r"grad must be an optax_accum\.IndexedSlices, got tuple",
    ),
    _sparse_host(
        "apply_indexed_slices_grad/row shape",
        lambda a: a.apply_indexed_slices_grad(
            IndexedSlices(jnp.array([0]), jnp.ones((1, 3)), (4, 3))
        ),
        ValueError,
        r"grad_shape dim 1 must be 2 \(the accumulator's shape \(4, 2\)\), got 3",
    ),
    _sparse_host(
        "take_grad/num_required=0",
        lambda a: a.take_grad(0, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _sparse_host(
        "take_indexed_slices_grad/num_required=-1",
        lambda a: a.take_indexed_slices_grad(-1, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was -1",
    ),
    _sparse_host(
        "set_global_step/float32",
        lambda a: a.set_global_step(np.float32(1)),
        TypeError,
        r"new_global_step must be an int, got np\.float32\(1\.0\)",
    ),
]


@pytest.mark.parametrize("bad", HOST_BAD, ids=[b.id for b in HOST_BAD])
def test_host_construction_raises_a_clear_error(bad: Bad):
    with pytest.raises(bad.error, match=bad.match) as info:
        _in_thread(bad.call)
    assert _raised_by_optax_accum(info), f"raised outside optax_accum: {info.traceback[-1]}"


@pytest.mark.parametrize("bad", STATEFUL_BAD, ids=[b.id for b in STATEFUL_BAD])
def test_host_rejection_leaves_state_unchanged(bad: HostBad):
    acc = bad.make()
    before = _snapshot(acc)
    with pytest.raises(bad.error, match=bad.match) as info:
        _in_thread(lambda: bad.call(acc))
    assert _raised_by_optax_accum(info), f"raised outside optax_accum: {info.traceback[-1]}"
    assert _snapshot(acc) == before
    assert bad.take_after(acc) == bad.expected_take
    assert acc.global_step == before[1] + 1


@pytest.mark.parametrize(
    "first, second, match",
    [
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(2,)),
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float64, shape=(2,)),
            r"dtype=float32.*got a ConditionalAccumulator\(dtype=float64",
        ),
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(2,)),
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(3,)),
            r"shape=\(2,\).*got a ConditionalAccumulator\(dtype=float32, shape=\(3,\)",
        ),
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            dict(cls=optax_accum.SparseConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            r"ConditionalAccumulator\(dtype.*got a SparseConditionalAccumulator",
        ),
        (
            dict(cls=optax_accum.SparseConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            dict(
                cls=optax_accum.SparseConditionalAccumulator,
                dtype=np.float32,
                shape=(4, 2),
                reduction_type="SUM",
            ),
            r"reduction_type=MEAN.*got a SparseConditionalAccumulator.*reduction_type=SUM",
        ),
    ],
    ids=["dtype", "shape", "kind", "reduction"],
)
def test_shared_name_clash_is_rejected_and_leaves_the_first_untouched(first, second, match):
    name = f"bad-inputs-{uuid.uuid4().hex}"
    cls = first.pop("cls")
    acc = cls(shared_name=name, **first)
    if cls is optax_accum.ConditionalAccumulator:
        acc.apply_grad(np.ones(first["shape"], np.float32))
    else:
        acc.apply_grad([0], np.ones((1, 2), np.float32))
    before = _snapshot(acc)
    other = second.pop("cls")
    with pytest.raises(ValueError, match=rf"shared_name '{name}' is already used by a .*{match}"):
        _in_thread(lambda: other(shared_name=name, **second))
    assert _snapshot(acc) == before
    again = cls(shared_name=name, **first)  # the same signature still shares it
    assert again.accumulator_ref is acc.accumulator_ref
    assert again.num_accumulated() == 1


# --------------------------------------------------------------------------- values inside jit


def test_out_of_range_sparse_ids_are_dropped_inside_jit():
    """Ids outside [0, rows) cannot raise under jit: those rows are ignored and counted."""
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=4, reduction="sum"
    )
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(TABLE)
    bad = _slices([1, 10, -3, 2**30], [[1.0, 1.0], [9.0, 9.0], [7.0, 7.0], [5.0, 5.0]])
    _, state = step(bad, state)
    assert int(optax_accum.num_accumulated(state)) == 1
    assert int(state.num_out_of_range) == 2  # -3 and 2**30; id 10 is the padding id
    updates, state = step(_slices([0], [[2.0, 0.0]]), state)
    dense = updates.to_dense()
    expected = np.zeros((10, 2), np.float32)
    expected[0], expected[1] = [-2.0, 0.0], [-1.0, -1.0]
    np.testing.assert_array_equal(np.asarray(dense), expected)
    assert np.isfinite(np.asarray(updates.values)).all()


def test_capacity_overflow_is_rejected_whole_and_counted_inside_jit():
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, capacity=3, reduction="sum"
    )
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(TABLE)
    _, state = step(_slices([0, 1], [[1.0, 0.0], [0.0, 1.0]]), state)
    before = state
    # Two new rows on top of two: four distinct rows > capacity 3, rejected whole.
    _, state = step(_slices([2, 3], [[5.0, 5.0], [6.0, 6.0]]), state)
    assert int(state.num_overflowed) == 1
    assert int(optax_accum.num_accumulated(state)) == 1
    fits = _slices([1, 2], [[1.0, 1.0], [2.0, 2.0]])  # three distinct rows: fits
    updates, state = step(fits, state)
    # The rejected gradient left nothing behind: the same release as without it.
    unrejected, _ = step(fits, before)
    assert updates.to_dense().tobytes() == unrejected.to_dense().tobytes()
    expected = np.zeros((10, 2), np.float32)
    expected[0], expected[1], expected[2] = [-1.0, 0.0], [-1.0, -2.0], [-2.0, -2.0]
    np.testing.assert_array_equal(np.asarray(updates.to_dense()), expected)
    assert int(state.num_overflowed) == 1


def test_traced_num_required_below_one_releases_every_gradient():
    """A schedule may return 0 or less at run time; it is treated as 1, never a stall."""
    tx = optax_accum.conditional_accumulator(SGD, lambda step: 1 - step)
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(jnp.zeros(2))
    for i in range(3):
        updates, state = step(jnp.full(2, float(i + 1)), state)
        np.testing.assert_array_equal(np.asarray(updates), [-(i + 1.0)] * 2)
    assert int(optax_accum.global_step(state)) == 3
