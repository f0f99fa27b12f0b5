"""The table helper of the bad-input suites (tests/test_bad_inputs_*.py), one per module.

Each suite's BAD is a list of malformed calls. A call must raise ValueError or
TypeError whose message names the argument, what was expected and what came (checked
with `match=`), raised by optax_accum's own validation (the innermost frame is in the
package), not from deep inside JAX. Python values are rejected at construction;
shapes, dtypes and tree structure at trace time, under `jax.jit` as users call it.
Inside `jax.jit`, values cannot raise: the suites check that they are dropped and
counted in state instead.

tests/test_bad_inputs_coverage.py checks that the tables together cover the public
API.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_accum
from optax_accum import IndexedSlices

PACKAGE = pathlib.Path(optax_accum.__file__).parent


@dataclasses.dataclass(frozen=True)
class Bad:
    """One malformed call: `call()` must raise `error` with a message matching `match`."""

    id: str
    call: Callable[[], Any]
    error: type[Exception]
    match: str


def ids(table: list) -> list[str]:
    """The test ids of a table: each entry's `id`."""
    return [b.id for b in table]


def raised_by_optax_accum(info: pytest.ExceptionInfo) -> bool:
    """Whether the innermost frame of the traceback is optax_accum's own code."""
    return PACKAGE in pathlib.Path(str(info.traceback[-1].path)).parents


def check(bad: Bad, run: Callable[[Callable[[], Any]], Any] = lambda call: call()) -> None:
    """`bad.call` (through `run`) raises its error, from optax_accum's own code."""
    with pytest.raises(bad.error, match=bad.match) as info:
        run(bad.call)
    assert raised_by_optax_accum(info), f"raised outside optax_accum: {info.traceback[-1]}"


# --------------------------------------------------------------------------- fixtures

SGD = optax.sgd(1.0)
PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
GRADS = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
TABLE = jnp.zeros((10, 2))

UNBOUND = r"axis_name='i' is not bound here.*jax\.pmap, jax\.shard_map or jax\.vmap"
LOCAL_STEP_FLOAT = r"local_step must be an integer scalar, got (dtype float32|0\.5)"
LOCAL_STEP_VECTOR = r"local_step must be an integer scalar, got shape \(2,\)"
TREE = r"updates must have the tree structure of the params given to init: expected .*got"


def slices(ids: Any, rows: Any, shape: tuple = (10, 2)) -> IndexedSlices:
    """int32 ids and float32 rows of a `shape` table (TABLE's by default)."""
    return IndexedSlices(jnp.asarray(ids, jnp.int32), jnp.asarray(rows, jnp.float32), shape)


def jit_update(
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


def vmapped(tx: optax.GradientTransformationExtraArgs, axis: str, replicas: int = 4) -> Any:
    """`tx.update` of a [replicas] gradient under `jax.vmap(axis_name=axis)`."""

    def one(g):
        return tx.update(g, tx.init(g))[0]

    return jax.jit(jax.vmap(one, axis_name=axis))(jnp.ones((replicas, 2)))


def accumulator_tx(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.conditional_accumulator(SGD, 2, **kw)


def sparse_tx(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(1.0), 2, **{"capacity": 4, **kw}
    )


def sparse_update(grads: Any, **extra: Any) -> Any:
    return jit_update(sparse_tx(), grads, TABLE, **extra)


def agn_tx(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.agn(SGD, 2, **kw)


def drop_tx(**kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.drop_stale_gradients(SGD, 1, **kw)


def mesh8() -> jax.sharding.Mesh:
    """A 1-D mesh "data" of the 8 simulated devices."""
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
