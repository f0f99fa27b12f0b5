"""Malformed calls to drop_stale_gradients and staleness_percentage get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from _bad_inputs import (
    GRADS,
    LOCAL_STEP_FLOAT,
    LOCAL_STEP_VECTOR,
    PARAMS,
    SGD,
    UNBOUND,
    Bad,
    accumulator_tx,
    check,
    drop_tx,
    ids,
    jit_update,
)

import optax_accum

BAD: list[Bad] = [
    Bad(
        "drop_stale/staleness=True",
        lambda: optax_accum.drop_stale_gradients(SGD, True),
        TypeError,
        r"staleness must be an int or a float \(or an int/float scalar array\), got True",
    ),
    Bad(
        "drop_stale/staleness=nan",
        lambda: optax_accum.drop_stale_gradients(SGD, float("nan")),
        ValueError,
        r"staleness must be a number, got nan",
    ),
    Bad(
        "drop_stale/staleness='1'",
        lambda: optax_accum.drop_stale_gradients(SGD, "1"),
        TypeError,
        r"staleness must be an int or a float \(or an int/float scalar array\), got '1'",
    ),
    Bad(
        "drop_stale/staleness vector",
        lambda: optax_accum.drop_stale_gradients(SGD, jnp.ones(2)),
        TypeError,
        r"staleness must be a scalar, got Array\(\[1\., 1\.\]",
    ),
    Bad(
        "drop_stale/axis_name=3.0",
        lambda: drop_tx(axis_name=3.0),
        TypeError,
        r"axis_name must be None, an axis name \(str\) or a tuple of axis names, got 3\.0",
    ),
    Bad(
        "drop_stale/local_step=0.5",
        lambda: jit_update(drop_tx(), GRADS, local_step=0.5),
        TypeError,
        LOCAL_STEP_FLOAT,
    ),
    Bad(
        "drop_stale/local_step vector",
        lambda: jit_update(drop_tx(), GRADS, local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "drop_stale/unbound axis_name",
        lambda: jit_update(drop_tx(axis_name="i"), GRADS),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "staleness_percentage/not a drop_stale_gradients state",
        lambda: optax_accum.staleness_percentage(accumulator_tx().init(PARAMS)),
        ValueError,
        r"state holds no DropStaleGradientsState.*got ConditionalAccumulatorState",
    ),
    Bad(
        "drop_stale.update/state of another transform",
        lambda: jit_update(drop_tx(), GRADS, state=accumulator_tx().init(PARAMS)),
        TypeError,
        r"state must be a DropStaleGradientsState \(as returned by this transform's init\), "
        r"got ConditionalAccumulatorState",
    ),
    Bad(
        "drop_stale_gradients/inner='sgd'",
        lambda: optax_accum.drop_stale_gradients("sgd", 1),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
