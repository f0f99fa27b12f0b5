"""Malformed calls to apply_gradients get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import optax
import pytest
from _bad_inputs import GRADS, Bad, accumulator_tx, check, ids

import optax_accum

BAD: list[Bad] = [
    Bad(
        "apply_gradients/tx='sgd'",
        lambda: optax_accum.apply_gradients("sgd", GRADS, optax.EmptyState(), GRADS),
        TypeError,
        r"tx must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
    Bad(
        "apply_gradients/grads of another structure",
        lambda: optax_accum.apply_gradients(
            accumulator_tx(), {"x": GRADS}, accumulator_tx().init(GRADS), GRADS
        ),
        ValueError,
        r"updates must have the tree structure of the params",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
