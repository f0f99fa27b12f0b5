"""Gradients in another dtype than the params: float32 on bfloat16 or float16, and the
reverse, in every transform that holds, drops or syncs.

As with `optax.MultiSteps`: on every step, held or released, the updates have the
dtypes of the inner optimizer's own updates; the state keeps its structure and dtypes;
applying the updates keeps the params' dtypes; and the results match MultiSteps (or
the inner optimizer on the mean gradient). Users run jax's standard dtype promotion,
which mixing dtypes needs (optax's own `apply_updates` adds `bf16 + f32`), so these
tests do too. The dtype checks run a pairwise matrix (`MIXED`): every transform meets
every inner optimizer, dtype pair and step pattern, not every triple of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _matrix import pairwise

import optax_accum

PAIRS = [
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float32),
    (jnp.float32, jnp.bfloat16),
]
PAIR_IDS = ["bf16-params-f32-grads", "f16-params-f32-grads", "f32-params-bf16-grads"]

INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
}

TRANSFORMS = {
    "conditional_accumulator": lambda inner: optax_accum.conditional_accumulator(inner, 3),
    "drop_stale_gradients": lambda inner: optax_accum.drop_stale_gradients(inner, 0),
    "agn": lambda inner: optax_accum.agn(inner, 3),
    "agn_delta": lambda inner: optax_accum.agn(inner, 3, commit="delta"),
}


@pytest.fixture(autouse=True)
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _params(dtype):
    return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4).astype(dtype), "b": jnp.ones(4, dtype)}


def _grads(i, dtype):
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=(3, 4)), dtype),
        "b": jnp.asarray(rng.normal(size=(4,)), dtype),
    }


def _avals(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _extra(name, i):
    # drop_stale_gradients(staleness=0): every third gradient lags one step (dropped).
    if name == "drop_stale_gradients":
        return {"local_step": jnp.int32(-1 if i % 3 == 2 else i - i // 3)}
    return {}


# transform x inner x dtype pair x step pattern is 72 compiles; pairwise keeps every
# pair of any two of those factors (each transform with each inner, with each dtype
# pair and with both step patterns; each inner with each dtype pair; ...) in 12.
MIXED = pairwise(sorted(TRANSFORMS), sorted(INNERS), PAIR_IDS, ["canonical", "apply_gradients"])


@pytest.mark.parametrize(
    ("transform", "inner", "pair", "pattern"), MIXED, ids=["-".join(m) for m in MIXED]
)
def test_mixed_dtypes_keep_every_dtype(transform, inner, pair, pattern):
    param_dtype, grad_dtype = PAIRS[PAIR_IDS.index(pair)]
    fused = pattern == "apply_gradients"
    inner_tx = INNERS[inner]()
    tx = TRANSFORMS[transform](inner_tx)
    params = _params(param_dtype)
    state = tx.init(params)
    # The dtypes the inner optimizer itself gives these gradients.
    own, _ = jax.eval_shape(inner_tx.update, _grads(0, grad_dtype), inner_tx.init(params), params)

    @jax.jit
    def step(params, state, grads, extra):
        updates, new_state = tx.update(grads, state, params, **extra)
        if fused:
            new_params, fused_state = optax_accum.apply_gradients(tx, grads, state, params, **extra)
            return new_params, fused_state, updates
        return optax.apply_updates(params, updates), new_state, updates

    for i in range(7):
        new_params, new_state, updates = step(
            params, state, _grads(i, grad_dtype), _extra(transform, i)
        )
        assert _avals(updates) == _avals(own), f"step {i}"
        assert _avals(new_state) == _avals(state), f"step {i}"
        assert _avals(new_params) == _avals(params), f"step {i}"
        params, state = new_params, new_state
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))


# Each inner optimizer once and each dtype pair once (the inner's own mixed-precision
# arithmetic is optax's, the same in both runs; the dtype test above crosses them).
# SGD is not the one on bfloat16 gradients: optax 0.2.5's MultiSteps raises there (see
# the float64 reference below, which runs SGD on every pair).
MULTISTEPS = list(
    zip(sorted(INNERS), PAIRS[2:] + PAIRS[:2], PAIR_IDS[2:] + PAIR_IDS[:2], strict=True)
)


@pytest.mark.parametrize(
    ("inner", "pair"), [m[:2] for m in MULTISTEPS], ids=[f"{m[2]}-{m[0]}" for m in MULTISTEPS]
)
def test_conditional_accumulator_matches_multisteps_in_mixed_precision(inner, pair):
    param_dtype, grad_dtype = pair
    ours = optax_accum.conditional_accumulator(INNERS[inner](), 3, accumulator_dtype=jnp.float32)
    theirs = optax.MultiSteps(INNERS[inner](), 3)
    params = _params(param_dtype)
    results = []
    for tx in (ours, theirs):
        p, s = params, tx.init(params)
        step = jax.jit(
            lambda p, s, g, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(
                *tx.update(g, s, p)
            )
        )
        for i in range(9):
            p, s = step(p, s, _grads(i, grad_dtype))
        results.append(p)
    # Both release the mean in the gradients' dtype; the rest is rounding in the
    # low-precision dtype (bfloat16 has 8 bits of mantissa).
    tol = {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        assert a.dtype == b.dtype == param_dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


@pytest.mark.parametrize(("param_dtype", "grad_dtype"), PAIRS, ids=PAIR_IDS)
def test_conditional_accumulator_sgd_matches_a_float64_reference(param_dtype, grad_dtype):
    """SGD on the mean of each window of 3 gradients, in float64 NumPy: an anchor that
    holds on every optax version (optax 0.2.5's MultiSteps, the anchor above, raises
    on bfloat16 gradients for float32 params under SGD)."""
    tx = optax_accum.conditional_accumulator(INNERS["sgd"](), 3)
    params = _params(param_dtype)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p, s = params, tx.init(params)
    expected = {k: np.asarray(v, np.float64) for k, v in params.items()}
    window = []
    for i in range(9):
        grads = _grads(i, grad_dtype)
        p, s = step(p, s, grads)
        window.append({k: np.asarray(v, np.float64) for k, v in grads.items()})
        if len(window) == 3:
            for k in expected:
                expected[k] -= 0.1 * np.mean([w[k] for w in window], axis=0)
            window = []
    for k in expected:  # rounding in the low-precision dtype, as above
        assert p[k].dtype == param_dtype
        np.testing.assert_allclose(np.asarray(p[k], np.float64), expected[k], rtol=2e-2, atol=2e-2)
