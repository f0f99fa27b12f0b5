"""Malformed calls to cross_shard and cross_shard_optimizer get a clear error.

Each entry of BAD is one malformed call; tests/_bad_inputs.py says what a clear error
is and holds the fixtures every table shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _bad_inputs import SGD, UNBOUND, Bad, check, ids, vmapped

import optax_accum

BAD: list[Bad] = [
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
        lambda: vmapped(optax_accum.cross_shard("i", group_assignment=[[0, 1]]), "i"),
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
        lambda: vmapped(optax_accum.cross_shard("i"), "j"),
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
        lambda: vmapped(optax_accum.cross_shard_optimizer(SGD, "i"), "j"),
        ValueError,
        UNBOUND,
    ),
    Bad(
        "cross_shard_optimizer/inner='sgd'",
        lambda: optax_accum.cross_shard_optimizer("sgd", "i"),
        TypeError,
        r"inner must be an optax\.GradientTransformation \(with init and update\), got 'sgd'",
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=ids(BAD))
def test_malformed_call_raises_a_clear_error(bad: Bad):
    check(bad)
