"""Nested transforms: the values they release, and what they compile to.

A nest selects its updates once: the inner release's `where(pred, sum, 0)` is not
written into the enclosing branch's carry but selected after it, and every sum restarts
lazily after its release (docs/design.md, "Sums restart lazily"). Checked here:

- values, in float64, against the anchors: `conditional_accumulator` k deep with n_i
  per level is one level with their product, and `optax.MultiSteps` with it (equal
  windows, so the mean of means is the mean), `drop_stale_gradients` around an
  accumulator drops what it should and passes the rest, in the canonical step and in
  `apply_gradients`, mixed precision included;
- `optax_accum.accumulated` reads each level's sum, zeros right after its release;
- the XLA:CPU program: each level adds at most one kernel per leaf (its addition),
  `drop_stale_gradients` none, and the accelerators keep a `stablehlo.case` per level.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import adam, lenient, spent_as_zeros

import optax_accum
from optax_accum import _compat

CA = optax_accum.conditional_accumulator
DS = optax_accum.drop_stale_gradients
LEAVES = 6


def _params(dtype=jnp.float32) -> dict:
    return {f"w{i}": jnp.full((3 + i, 4), 0.1 * (i + 1), dtype) for i in range(LEAVES)}


def _grads(i: int, params: dict) -> dict:
    """sin(i + 1 + 3 p), leafwise. Computed on all leaves at once, concatenated: op by
    op on each leaf compiled a kernel per op, leaf shape and dtype (the same values,
    bit for bit; only the number of compiles differs)."""
    leaves, tree = jax.tree.flatten(params)
    host = [np.asarray(p) for p in leaves]
    x = jnp.asarray(np.concatenate([h.ravel() for h in host]))
    g = np.asarray(jnp.sin(jnp.ones_like(x) * (i + 1) + x * 3.0))
    ends = np.cumsum([h.size for h in host])
    parts = np.split(g, ends[:-1])
    return jax.tree.unflatten(
        tree, [jnp.asarray(v.reshape(h.shape)) for v, h in zip(parts, host, strict=True)]
    )


def _canonical(tx, params, state, grads, extra):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state


def _fused(tx, params, state, grads, extra):
    return optax_accum.apply_gradients(tx, grads, state, params, **extra)


STEPS = {"canonical": _canonical, "apply_gradients": _fused}


def _train(tx, steps: int, *, step=_canonical, dtype=jnp.float32, extra=lambda i, s: {}):
    params = _params(dtype)
    state = tx.init(params)
    run = jax.jit(functools.partial(step, tx), donate_argnums=(0, 1))
    for i in range(steps):
        params, state = run(params, state, _grads(i, params), extra(i, state))
    return params, state


@pytest.mark.parametrize("depth", [2, 3])
def test_accumulators_k_deep_are_multisteps_of_the_product(depth):
    """Both step patterns (canonical and apply_gradients) against one pair of
    references (one level with the product, MultiSteps), trained once per depth."""
    with _compat.enable_x64():
        every = int(np.prod((2, 3, 2)[:depth]))
        steps = 2 * every + 1  # two releases, then one held step
        flat, _ = _train(CA(adam(0.05), every), steps, dtype=jnp.float64)
        # MultiSteps keeps its running mean with float32 weights: ~1e-9 off in float64.
        multisteps = lenient(optax.MultiSteps(optax.adam(0.05), every))
        want, _ = _train(multisteps, steps, dtype=jnp.float64)
        for pattern in sorted(STEPS):
            tx = adam(0.05)
            for n in (2, 3, 2)[:depth]:
                tx = CA(tx, n)
            got, state = _train(tx, steps, step=STEPS[pattern], dtype=jnp.float64)
            for k in want:
                np.testing.assert_allclose(got[k], flat[k], rtol=1e-12, atol=1e-14, err_msg=pattern)
                np.testing.assert_allclose(got[k], want[k], rtol=1e-7, atol=1e-9, err_msg=pattern)
                assert not np.allclose(got[k], _params(jnp.float64)[k])  # the steps moved it
            outermost = (2, 3, 2)[depth - 1]
            assert int(optax_accum.global_step(state)) == steps // outermost, pattern


def test_drop_stale_around_an_accumulator_drops_and_passes():
    """Tags lag by 0, 1 or 2 behind drop_stale's step; staleness 1 drops lag 2. The
    accepted gradients go to the accumulator, fresh by its own step. Both step
    patterns (canonical and apply_gradients) against one jitted reference run."""
    lags = [0, 1, 2, 0, 0, 2, 1, 0]

    def tag(i, state):
        return {"local_step": optax_accum.global_step(state) - lags[i]}

    with _compat.enable_x64():
        inner = functools.partial(CA, adam(0.05), 2)
        # The same gradients, those of lag 2 left out, straight into the accumulator.
        params = _params(jnp.float64)
        ref_tx = inner()
        ref_state = ref_tx.init(params)
        ref_step = jax.jit(functools.partial(_canonical, ref_tx))
        for i, lag in enumerate(lags):
            if lag <= 1:
                params, ref_state = ref_step(params, ref_state, _grads(i, params), {})
        for pattern in sorted(STEPS):
            got, state = _train(
                DS(inner(), 1), len(lags), step=STEPS[pattern], dtype=jnp.float64, extra=tag
            )
            for k in params:
                np.testing.assert_allclose(
                    got[k], params[k], rtol=1e-12, atol=1e-14, err_msg=pattern
                )
            assert int(state.num_dropped) == lags.count(2), pattern
            assert int(optax_accum.num_accumulated(state)) == int(ref_state.count), pattern


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_nests_match_one_level(dtype):
    """bfloat16 / float16 updates ride in float32 sums at every level."""
    nested, _ = _train(DS(CA(CA(optax.sgd(0.5), 2), 1), 3), 6, dtype=dtype)
    flat, _ = _train(CA(optax.sgd(0.5), 2), 6, dtype=dtype)
    for k in flat:
        assert nested[k].dtype == dtype
        np.testing.assert_array_equal(np.asarray(nested[k]), np.asarray(flat[k]))


def test_accumulated_reads_each_level_zeros_after_its_release():
    params = {"w": jnp.zeros(2)}
    tx = CA(CA(optax.sgd(1.0), 2), 2)
    state = tx.init(params)
    step = jax.jit(tx.update)
    sums = []
    for g in (1.0, 2.0, 3.0):
        _, state = step({"w": jnp.full(2, g)}, state)
        sums.append(
            (
                float(optax_accum.accumulated(state)["w"][0]),
                float(optax_accum.accumulated(state.inner_state)["w"][0]),
            )
        )
    # outer: 1, released (zeros), 3; inner: nothing, then the mean 1.5, still held.
    assert sums == [(1.0, 0.0), (0.0, 1.5), (3.0, 1.5)]
    batched = jax.vmap(tx.init)({"w": jnp.zeros((3, 2))})
    batched = batched._replace(emitted=jnp.array([True, False, True]))
    assert optax_accum.accumulated(batched)["w"].shape == (3, 2)


# --------------------------------------------------------------------------- programs


def _fusions(tx) -> int:
    params = _params()
    state = tx.init(params)
    step = jax.jit(functools.partial(_canonical, tx), donate_argnums=(0, 1))
    text = step.lower(params, state, params, {}).compile().as_text()
    return text.count(" fusion(")


def test_each_level_adds_at_most_its_addition_to_the_cpu_program():
    """Before nests selected once, each level also added a selection into the enclosing
    carry and the reset of its sum: three kernels per leaf, not one."""
    one = _fusions(CA(adam(0.1), 2))
    two = _fusions(CA(CA(adam(0.1), 2), 2))
    three = _fusions(CA(CA(CA(adam(0.1), 2), 2), 2))
    dropped = _fusions(DS(CA(adam(0.1), 2), 1))
    slack = 12  # a level's scalar counters (its count, steps, drops, flags)
    assert two - one <= LEAVES + slack, (one, two)
    assert three - two <= LEAVES + slack, (two, three)
    assert dropped - one <= slack, (one, dropped)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_accelerators_branch_at_every_level(platform):
    tx = DS(CA(CA(adam(0.1), 2), 2), 1)
    params = _params()
    step = functools.partial(_canonical, tx)
    lowered = jax.jit(step).trace(params, tx.init(params), params, {})
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" not in text and "optimization_barrier" not in text
    assert text.count('"stablehlo.case"') >= 3


# --------------------------------------------------------------------------- verdicts


def _mostly_one(step):
    """Gradients per release: 1, 1, 2, 1, 1, 2, ..."""
    return jnp.where(step % 3 == 2, 2, 1)


def _sparse_accumulator(inner):
    # Leaf "w0" is kept as a row buffer, the others dense.
    return optax_accum.sparse_conditional_accumulator(
        inner, _mostly_one, capacity=16, sparse=lambda p: {k: k == "w0" for k in p}
    )


INNERS = {
    # Mostly 1 per release, so the accumulator's step stays close to drop_stale's and
    # tags that drop_stale accepts can still be stale to the accumulator.
    "conditional_accumulator": lambda: CA(adam(0.05), _mostly_one),
    "sparse_conditional_accumulator": lambda: _sparse_accumulator(optax_accum.sparse_sgd(0.5)),
}


@pytest.mark.parametrize("pattern", sorted(STEPS))
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_a_passed_verdict_equals_the_branch_around_the_accumulator(inner, pattern):
    """drop_stale_gradients calls an accumulator directly with its verdict; a chain
    around the accumulator hides it, and drop_stale_gradients branches as before. Both
    give the same updates and states, step for step, drops and releases mixed."""
    lags = [0, 0, 2, 1, 0, 3, 0, 0, 1, 2, 0, 0, 0]
    step = STEPS[pattern]
    if inner.startswith("sparse"):  # the sparse accumulator needs optax_accum's apply
        step = (
            functools.partial(_fused)
            if pattern == "apply_gradients"
            else lambda tx, p, s, g, e: _sparse_canonical(tx, p, s, g, e)
        )
    inner_type = type(INNERS[inner]().init(_params()))
    results = []
    for wrap in (lambda tx: tx, lambda tx: optax.chain(tx)):
        tx = DS(wrap(INNERS[inner]()), 2)
        params = _params()
        state = tx.init(params)
        run = jax.jit(functools.partial(step, tx))
        trace = []
        for i, lag in enumerate(lags):
            tag = optax_accum.global_step(state) - lag
            grads = _grads(i, params)
            if inner.startswith("sparse"):  # rows i % 3 and 2 of w0, row 2 twice
                rows = np.array([i % 3, 2, 2], np.int32)
                values = jnp.asarray(np.asarray(grads["w0"])[rows])  # gathered on the host
                grads["w0"] = optax_accum.IndexedSlices(
                    jnp.asarray(rows), values, grads["w0"].shape
                )
            params, state = run(params, state, grads, {"local_step": tag})
            inner_state = state.inner_state
            if not isinstance(inner_state, inner_type):
                inner_state = inner_state[0]  # inside the chain
            trace.append((params, state._replace(inner_state=inner_state)))
        results.append(trace)
    gated, branched = results
    assert optax_accum._gate.takes_verdict(INNERS[inner]())
    assert not optax_accum._gate.takes_verdict(optax.chain(INNERS[inner]()))
    for i, ((p1, s1), (p2, s2)) in enumerate(zip(gated, branched, strict=True)):
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            _assert_close(a, b, f"step {i}")
        left, right = jax.tree.leaves(spent_as_zeros(s1)), jax.tree.leaves(spent_as_zeros(s2))
        if inner.startswith("sparse"):  # a spent dense leaf reads as zeros, as in the state
            left = jax.tree.leaves(_spent_rows_as_zeros(s1))
            right = jax.tree.leaves(_spent_rows_as_zeros(s2))
        for a, b in zip(left, right, strict=True):
            _assert_close(a, b, f"step {i}")
    final = gated[-1][1]
    assert int(final.num_dropped) == sum(lag > 2 for lag in lags)
    # drop_stale consumes the tag, so the accumulator sees every gradient it passes.
    assert int(final.inner_state.num_dropped) == 0
    assert int(final.inner_state.global_step) >= 3  # and released several times


def _assert_close(a, b, message: str) -> None:
    """Integers exactly; floats to a few ulps (the two programs fuse differently)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, message
    if np.issubdtype(a.dtype, np.floating):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8, err_msg=message)
    else:
        np.testing.assert_array_equal(a, b, err_msg=message)


def _sparse_canonical(tx, params, state, grads, extra):
    updates, state = tx.update(grads, state, params, **extra)
    return optax_accum.apply_updates(params, updates), state


def _spent_rows_as_zeros(state):
    """The drop_stale state with its sparse accumulator's dense leaves read as zeros
    after a release (row buffers are kept apart by `size`)."""
    acc = state.inner_state

    def read(leaf):
        if isinstance(leaf, optax_accum.DenseRows):
            return jax.tree.map(lambda x: np.where(acc.emitted, 0, x), leaf)
        return leaf._replace(
            values=np.where(np.arange(leaf.values.shape[0])[:, None] < leaf.size, leaf.values, 0)
        )

    accumulator = jax.tree.map(
        read,
        acc.accumulator,
        is_leaf=lambda x: isinstance(x, optax_accum.DenseRows | optax_accum.RowBuffer),
    )
    return state._replace(inner_state=acc._replace(accumulator=accumulator))
