"""Malformed calls to record_global_norm and recorded_global_norm get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares. (Updates typed unreduced, which need
jax 0.10's sharding types, are in tests/test_bad_inputs_unreduced.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import Bad, check, ids

import optax_accum


def _unknown_rows():
    """Row-sparse updates whose table's row count is unknown (dense_shape[0] == -1)."""
    tx = optax_accum.record_global_norm()
    slices = optax_accum.IndexedSlices(jnp.array([0, 1]), jnp.ones((2, 3)), (-1, 3))
    jax.jit(tx.update).trace({"emb": slices}, tx.init({"emb": jnp.zeros((4, 3))}))


BAD: list[Bad] = [
    Bad(
        "recorded_global_norm/a state without one",
        lambda: optax_accum.recorded_global_norm(optax.adam(0.1).init(jnp.zeros(2))),
        ValueError,
        r"state must hold a RecordGlobalNormState: put optax_accum\.record_global_norm\(\) "
        r"in the optimizer's chain .*got tuple",
    ),
    Bad(
        "record_global_norm/row-sparse updates of unknown rows",
        _unknown_rows,
        ValueError,
        r"record_global_norm needs an IndexedSlices' row count, but dense_shape is "
        r"\(-1, 3\)",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
