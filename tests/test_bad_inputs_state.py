"""Malformed calls to the state accessors (global_step, num_accumulated, has_updated,
accumulated, set_global_step) get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import PARAMS, SGD, Bad, accumulator_tx, check, drop_tx, ids

import optax_accum

BAD: list[Bad] = [
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
        lambda: optax_accum.num_accumulated(drop_tx().init(PARAMS)),
        ValueError,
        r"DropStaleGradientsState has no 'count' field",
    ),
    Bad(
        "accumulated/drop_stale_gradients keeps no sum",
        lambda: optax_accum.accumulated(drop_tx().init(PARAMS)),
        ValueError,
        r"state holds no ConditionalAccumulatorState or AGNState.*got DropStaleGradientsState",
    ),
    Bad(
        "has_updated/no step state",
        lambda: optax_accum.has_updated({}),
        ValueError,
        r"state holds no optax_accum step state.*got dict",
    ),
    Bad(
        "set_global_step/float",
        lambda: optax_accum.set_global_step(accumulator_tx().init(PARAMS), 1.5),
        TypeError,
        r"new_global_step must be an integer scalar, got 1\.5",
    ),
    Bad(
        "set_global_step/vector",
        lambda: optax_accum.set_global_step(accumulator_tx().init(PARAMS), jnp.zeros(2, jnp.int32)),
        ValueError,
        r"new_global_step must be an integer scalar, got shape \(2,\)",
    ),
    Bad(
        "set_global_step/None",
        lambda: optax_accum.set_global_step(accumulator_tx().init(PARAMS), None),
        TypeError,
        r"new_global_step must be an integer scalar, got None",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
