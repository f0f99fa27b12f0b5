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
from _hlo import AS_USERS_COMPILE

import optax_accum
from optax_accum import _compat

CA = optax_accum.conditional_accumulator
DS = optax_accum.drop_stale_gradients
LEAVES = 6


def _params(dtype=jnp.float32) -> dict:
    """Built on the host: `jnp.full` compiled a kernel per leaf shape and dtype."""
    return {
        f"w{i}": jnp.asarray(np.full((3 + i, 4), 0.1 * (i + 1)).astype(dtype))
        for i in range(LEAVES)
    }


def _grads(i: int, params: dict) -> dict:
    """sin(i + 1 + 3 p), leafwise, in float64 on the host and rounded to the leaf's
    dtype: every run of a test takes the same gradients, and no kernel is compiled for
    them (eager jnp ops compiled one per op, shape and dtype)."""
    return jax.tree.map(
        lambda p: jnp.asarray(np.sin(i + 1 + 3.0 * np.asarray(p, np.float64)).astype(p.dtype)),
        params,
    )


def _canonical(tx, params, state, grads, extra):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state


def _fused(tx, params, state, grads, extra):
    return optax_accum.apply_gradients(tx, grads, state, params, **extra)


STEPS = {"canonical": _canonical, "apply_gradients": _fused}


def _train(*runs, steps: int, dtype=jnp.float32, extra=lambda i, s: {}) -> list:
    """`runs`: (tx, step pattern) pairs, trained side by side in one jitted program (one
    compile, not one per run), each on its own params, gradients and tags. Returns
    [(params, state)], one per run."""
    params = [_params(dtype) for _ in runs]
    # One compiled init for all runs (eager inits compiled a kernel per op and shape).
    states = jax.jit(lambda ps: [tx.init(p) for (tx, _), p in zip(runs, ps, strict=True)])(params)

    def all_steps(params, states, grads, extras):
        out = [
            step(tx, p, s, g, e)
            for (tx, step), p, s, g, e in zip(runs, params, states, grads, extras, strict=True)
        ]
        return [p for p, _ in out], [s for _, s in out]

    run = jax.jit(all_steps, donate_argnums=(0, 1))
    for i in range(steps):
        grads = [_grads(i, p) for p in params]
        extras = [extra(i, s) for s in states]
        params, states = run(params, states, grads, extras)
    return list(zip(params, states, strict=True))


def test_accumulators_k_deep_are_multisteps_of_the_product():
    """Both step patterns (canonical and apply_gradients) against one pair of
    references (one level with the product, MultiSteps). Three levels of different n:
    a nest is built level by level, and its inner two levels are a 2-deep nest (each
    level's sum, release and restart), so no separate 2-deep run."""
    depth = 3
    with _compat.enable_x64():
        every = int(np.prod((2, 3, 2)[:depth]))
        steps = 2 * every + 1  # two releases, then one held step
        # MultiSteps keeps its running mean with float32 weights: ~1e-9 off in float64.
        multisteps = lenient(optax.MultiSteps(optax.adam(0.05), every))
        nested = []
        for pattern in sorted(STEPS):
            tx = adam(0.05)
            for n in (2, 3, 2)[:depth]:
                tx = CA(tx, n)
            nested.append((tx, STEPS[pattern]))
        (flat, _), (want, _), *runs = _train(
            (CA(adam(0.05), every), _canonical),
            (multisteps, _canonical),
            *nested,
            steps=steps,
            dtype=jnp.float64,
        )
        for pattern, (got, state) in zip(sorted(STEPS), runs, strict=True):
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
        ref_state = jax.jit(ref_tx.init)(params)
        ref_step = jax.jit(functools.partial(_canonical, ref_tx))
        for i, lag in enumerate(lags):
            if lag <= 1:
                params, ref_state = ref_step(params, ref_state, _grads(i, params), {})
        runs = _train(
            *[(DS(inner(), 1), STEPS[pattern]) for pattern in sorted(STEPS)],
            steps=len(lags),
            dtype=jnp.float64,
            extra=tag,
        )
        for pattern, (got, state) in zip(sorted(STEPS), runs, strict=True):
            for k in params:
                np.testing.assert_allclose(
                    got[k], params[k], rtol=1e-12, atol=1e-14, err_msg=pattern
                )
            assert int(state.num_dropped) == lags.count(2), pattern
            assert int(optax_accum.num_accumulated(state)) == int(ref_state.count), pattern


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_nests_match_one_level(dtype):
    """bfloat16 / float16 updates ride in float32 sums at every level."""
    (nested, _), (flat, _) = _train(
        (DS(CA(CA(optax.sgd(0.5), 2), 1), 3), _canonical),
        (CA(optax.sgd(0.5), 2), _canonical),
        steps=6,
        dtype=dtype,
    )
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
    # Shapes and dtypes are all a lowering reads: nothing runs before the compile.
    params = jax.eval_shape(_params)
    state = jax.eval_shape(tx.init, params)
    step = jax.jit(functools.partial(_canonical, tx), donate_argnums=(0, 1))
    compiled = step.lower(params, state, params, {}).compile(compiler_options=AS_USERS_COMPILE)
    text = compiled.as_text()
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
    params = jax.eval_shape(_params)
    step = functools.partial(_canonical, tx)
    lowered = jax.jit(step).trace(params, jax.eval_shape(tx.init, params), params, {})
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


# Each accumulator in one step pattern, each pattern once: the verdict reaches the
# accumulator's predicate the same way in both; the step pattern only decides whether
# its release branch also applies the updates (the sink, which tests/test_train_step.py
# runs for each accumulator). conditional_accumulator takes the verdict in both
# patterns in test_drop_stale_around_an_accumulator_drops_and_passes too.
VERDICT_ROWS = [
    ("conditional_accumulator", "canonical"),
    ("sparse_conditional_accumulator", "apply_gradients"),
]


@pytest.mark.parametrize(
    ("inner", "pattern"), VERDICT_ROWS, ids=[f"{i}-{p}" for i, p in VERDICT_ROWS]
)
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
    inner_type = type(jax.eval_shape(INNERS[inner]().init, _params()))
    # Gated and branched side by side in one jitted program (one compile, not two).
    txs = [DS(wrap(INNERS[inner]()), 2) for wrap in (lambda tx: tx, optax.chain)]

    def both(params, states, grads, extras):
        runs = zip(txs, params, states, grads, extras, strict=True)
        out = [step(tx, p, s, g, e) for tx, p, s, g, e in runs]
        return [p for p, _ in out], [s for _, s in out]

    run = jax.jit(both)
    params = [_params() for _ in txs]
    states = jax.jit(lambda ps: [tx.init(p) for tx, p in zip(txs, ps, strict=True)])(params)
    results = [[] for _ in txs]
    for i, lag in enumerate(lags):
        grads = [_grads(i, p) for p in params]
        if inner.startswith("sparse"):  # rows i % 3 and 2 of w0, row 2 twice
            rows = np.array([i % 3, 2, 2], np.int32)
            for g in grads:
                values = jnp.asarray(np.asarray(g["w0"])[rows])  # gathered on the host
                g["w0"] = optax_accum.IndexedSlices(jnp.asarray(rows), values, g["w0"].shape)
        extras = [{"local_step": optax_accum.global_step(s) - lag} for s in states]
        params, states = run(params, states, grads, extras)
        for trace, p, s in zip(results, params, states, strict=True):
            inner_state = s.inner_state
            if not isinstance(inner_state, inner_type):
                inner_state = inner_state[0]  # inside the chain
            trace.append((p, s._replace(inner_state=inner_state)))
    gated, branched = results
    assert optax_accum._protocol.takes_verdict(INNERS[inner]())
    assert not optax_accum._protocol.takes_verdict(optax.chain(INNERS[inner]()))
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
    """Integers exactly; floats to a few ulps (the two runs fuse differently)."""
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
        acc.storage,
        is_leaf=lambda x: isinstance(x, optax_accum.DenseRows | optax_accum.RowBuffer),
    )
    return state._replace(inner_state=acc._replace(storage=accumulator))
