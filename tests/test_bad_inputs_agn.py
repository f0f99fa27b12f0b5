"""Malformed calls to agn get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import GRADS, PARAMS, SGD, UNBOUND, Bad, agn_tx, check, drop_tx, ids, jit_update

import optax_accum

BAD: list[Bad] = [
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
        lambda: agn_tx(commit="params"),
        ValueError,
        r"commit must be \"gradients\" or \"delta\", got 'params'",
    ),
    Bad(
        "agn/accumulator_dtype=int8",
        lambda: agn_tx(accumulator_dtype=jnp.int8),
        TypeError,
        r"accumulator_dtype must be a floating dtype, got int8",
    ),
    Bad(
        "agn/skip_nonfinite=None",
        lambda: agn_tx(skip_nonfinite=None),
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
        lambda: agn_tx(outer=optax),
        TypeError,
        r"outer must be None or an optax\.GradientTransformation.*got <module 'optax'",
    ),
    Bad(
        "agn/missing params",
        lambda: jit_update(agn_tx(), GRADS),
        ValueError,
        r"agn needs params: call update\(grads, state, params\).*got params=None",
    ),
    Bad(
        "agn/params of another tree",
        lambda: jit_update(agn_tx(), GRADS, {"w": PARAMS["w"]}, state=agn_tx().init(PARAMS)),
        ValueError,
        r"params must have the tree structure of the params given to init: .*got "
        r"PyTreeDef\(\{'w': \*\}\)",
    ),
    Bad(
        "agn/gradient shape",
        lambda: jit_update(agn_tx(), {**GRADS, "w": jnp.ones((3, 2))}, PARAMS),
        ValueError,
        r"updates\['w'\] must have shape \(2, 3\), got \(3, 2\)",
    ),
    Bad(
        "agn/unbound axis_name",
        lambda: jit_update(agn_tx(axis_name="i"), GRADS, PARAMS),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "agn.update/state of another transform",
        lambda: jit_update(agn_tx(), GRADS, PARAMS, state=drop_tx().init(PARAMS)),
        TypeError,
        r"state must be a AGNState \(as returned by this transform's init\), got "
        r"DropStaleGradientsState",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
