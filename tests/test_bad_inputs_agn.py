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
    Bad(
        "agn/period not a multiple of fragments",
        lambda: optax_accum.agn(SGD, 100, fragments=37),
        ValueError,
        r"communication_period=100 must be a multiple of fragments=37.*choose a period of 74 "
        r"or 111\); nothing is rounded",
    ),
    Bad(
        "agn/period not a multiple of a tree's fragments",
        lambda: optax_accum.agn(SGD, 3, fragments={"w": 0, "b": 1}).init(PARAMS),
        ValueError,
        r"communication_period=3 must be a multiple of the number of fragments, 2",
    ),
    Bad(
        "agn/delay without fragments",
        lambda: agn_tx(delay=1),
        ValueError,
        r"delay=1 and blend=0\.0 apply to fragments, got fragments=None",
    ),
    Bad(
        "agn/blend without fragments",
        lambda: agn_tx(blend=0.5),
        ValueError,
        r"delay=0 and blend=0\.5 apply to fragments, got fragments=None",
    ),
    Bad(
        "agn/delay beyond the period",
        lambda: agn_tx(fragments=1, delay=3),
        ValueError,
        r"delay must be between 0 and communication_period=2, got 3",
    ),
    Bad(
        "agn/delay=1.5",
        lambda: agn_tx(fragments=1, delay=1.5),
        TypeError,
        r"delay must be an int >= 0, got 1\.5 \(float\)",
    ),
    Bad(
        "agn/blend=2",
        lambda: agn_tx(fragments=1, blend=2.0),
        ValueError,
        r"blend must be in \[0, 1\], got 2\.0",
    ),
    Bad(
        "agn/fragments=0",
        lambda: agn_tx(fragments=0),
        ValueError,
        r"fragments must be a positive int, got 0",
    ),
    Bad(
        "agn/more fragments than leaves",
        lambda: agn_tx(fragments=2).init({"w": PARAMS["w"]}),
        ValueError,
        r"fragments=2 needs at least 2 param leaves, the params have 1",
    ),
    Bad(
        "agn/a fragment with no leaf",
        lambda: optax_accum.agn(SGD, 4, fragments={"w": 0, "b": 2}).init(PARAMS),
        ValueError,
        r"fragments must number every fragment from 0 to 2 with at least one leaf each, got "
        r"no leaf in fragment 1",
    ),
    Bad(
        "agn/a fragment number that is no int",
        lambda: agn_tx(fragments=lambda path: "first").init(PARAMS),
        TypeError,
        r"fragments\(\['b'\]\) must be a fragment number \(an int >= 0\), got 'first'",
    ),
    Bad(
        "agn/fragments of another tree",
        lambda: agn_tx(fragments={"w": 0}).init(PARAMS),
        ValueError,
        r"fragments must be an int, a function of a leaf's path, or a tree of fragment numbers "
        r"with the params' structure",
    ),
    Bad(
        "agn/communication_dtype without axis_name",
        lambda: agn_tx(communication_dtype=jnp.int8),
        ValueError,
        r"communication_dtype=int8 needs axis_name",
    ),
    Bad(
        "agn/communication_dtype=float16",
        lambda: agn_tx(axis_name="i", communication_dtype=jnp.float16),
        ValueError,
        r"communication_dtype must be None, jnp\.float32, jnp\.bfloat16, jnp\.int8 or "
        r"jnp\.float8_e4m3fn, got float16",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
