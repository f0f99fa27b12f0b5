"""Malformed calls to conditional_accumulator get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_inputs import (
    GRADS,
    LOCAL_STEP_FLOAT,
    LOCAL_STEP_VECTOR,
    SGD,
    TREE,
    UNBOUND,
    Bad,
    accumulator_tx,
    check,
    ids,
    jit_update,
)

import optax_accum

BAD: list[Bad] = [
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
        lambda: accumulator_tx(reduction="median"),
        ValueError,
        r"reduction must be \"mean\", \"sum\", \"max\" or \"min\" \(any case\), a tree of "
        r"them shaped like the params \(or a prefix of it\), or a function of a leaf's path "
        r"returning one; got 'median'",
    ),
    Bad(
        "accumulator/reduction tree leaf",
        lambda: accumulator_tx(reduction={"w": "max", "b": "avg"}),
        ValueError,
        r"reduction must be .*; got 'avg' at reduction\['b'\]",
    ),
    Bad(
        "accumulator/reduction tree leaf type",
        lambda: accumulator_tx(reduction={"w": 1}),
        TypeError,
        r"reduction must be .*; got 1 \(int\) at reduction\['w'\]",
    ),
    Bad(
        "accumulator/communication_dtype=float16",
        lambda: accumulator_tx(communication_dtype=jnp.float16),
        ValueError,
        r"communication_dtype must be None, jnp.float32, jnp.bfloat16, jnp.int8 or "
        r"jnp.float8_e4m3fn, got float16",
    ),
    Bad(
        "accumulator/communication_dtype=list",
        lambda: accumulator_tx(communication_dtype=[8]),
        TypeError,
        r"communication_dtype must be None, .*, got \[8\] \(list\)",
    ),
    Bad(
        "accumulator/accumulator_dtype=int32",
        lambda: accumulator_tx(accumulator_dtype=jnp.int32),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got int32",
    ),
    Bad(
        "accumulator/accumulator_dtype=bogus",
        lambda: accumulator_tx(accumulator_dtype="bogus"),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got 'bogus'",
    ),
    Bad(
        "accumulator/axis_name=list",
        lambda: accumulator_tx(axis_name=["i"]),
        TypeError,
        r"axis_name must be None, an axis name \(str\) or a tuple of axis names, got \['i'\]",
    ),
    Bad(
        "accumulator/skip_nonfinite=1",
        lambda: accumulator_tx(skip_nonfinite=1),
        TypeError,
        r"skip_nonfinite must be a bool, got 1 \(int\)",
    ),
    Bad(
        "accumulator/tree mismatch",
        lambda: jit_update(accumulator_tx(), {"w": GRADS["w"]}),
        ValueError,
        TREE + r" PyTreeDef\(\{'w': \*\}\)",
    ),
    Bad(
        "accumulator/shape mismatch",
        lambda: jit_update(accumulator_tx(), {**GRADS, "w": jnp.ones((3, 2))}),
        ValueError,
        r"updates\['w'\] must have shape \(2, 3\), got \(3, 2\)",
    ),
    Bad(
        "accumulator/integer gradient",
        lambda: jit_update(accumulator_tx(), {**GRADS, "w": jnp.ones((2, 3), jnp.int32)}),
        TypeError,
        r"updates\['w'\] must be floating, got dtype int32",
    ),
    Bad(
        "accumulator/local_step float array",
        lambda: jit_update(accumulator_tx(), GRADS, local_step=jnp.float32(1)),
        TypeError,
        LOCAL_STEP_FLOAT,
    ),
    Bad(
        "accumulator/local_step vector",
        lambda: jit_update(accumulator_tx(), GRADS, local_step=jnp.zeros(2, jnp.int32)),
        ValueError,
        LOCAL_STEP_VECTOR,
    ),
    Bad(
        "accumulator/local_step bool",
        lambda: jit_update(accumulator_tx(), GRADS, local_step=True),
        TypeError,
        r"local_step must be an integer scalar, got True",
    ),
    Bad(
        "accumulator/local_step str",
        lambda: jit_update(accumulator_tx(), GRADS, local_step="0"),
        TypeError,
        r"local_step must be an integer scalar, got '0'",
    ),
    Bad(
        "accumulator/unbound axis_name",
        lambda: jit_update(accumulator_tx(axis_name="i"), GRADS),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "conditional_accumulator/inner='sgd'",
        lambda: optax_accum.conditional_accumulator("sgd", 2),
        TypeError,
        r"inner must be an optax\.GradientTransformation.*got 'sgd'",
    ),
    Bad(
        "conditional_accumulator.update/state of another transform",
        lambda: jit_update(accumulator_tx(), GRADS, state=optax.EmptyState()),
        TypeError,
        r"state must be a ConditionalAccumulatorState.*got EmptyState",
    ),
    Bad(
        "conditional_accumulator/num_required schedule returns a float",
        lambda: jit_update(optax_accum.conditional_accumulator(SGD, lambda s: 2.5), GRADS),
        TypeError,
        r"num_required.*must return an integer.*got.*float",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)


# --------------------------------------------------------------------------- values inside jit


def test_traced_num_required_below_one_releases_every_gradient():
    """A schedule may return 0 or less at run time; it is treated as 1, never a stall."""
    tx = optax_accum.conditional_accumulator(SGD, lambda step: 1 - step)
    step = jax.jit(lambda g, s: tx.update(g, s))
    state = tx.init(jnp.zeros(2))
    for i in range(3):
        updates, state = step(jnp.full(2, float(i + 1)), state)
        np.testing.assert_array_equal(np.asarray(updates), [-(i + 1.0)] * 2)
    assert int(optax_accum.global_step(state)) == 3
