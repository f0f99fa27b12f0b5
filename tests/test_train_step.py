"""`apply_gradients` gives the canonical optax step's results, for every transform.

Over whole cycles (held, dropped and released steps alike), under `jax.jit` and, for
the shared cases, under `jax.vmap` with an axis name, `apply_gradients(tx, grads,
opt_state, params)` matches `updates, opt_state = tx.update(...); params =
apply_updates(params, updates)`: the transform alone, last in an `optax.chain`,
inside `optax.inject_hyperparams`, and followed by another transform (where it cannot
fuse and must fall back). A held step of a fused run leaves the parameters bit for bit
as they were. Every case runs, each transform family in every context (`ALONE` and
`CONTEXT_CASES` say which case where, and why that covers every path).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import CASE_IDS, CASES, REPLICAS, Case, first, spent_as_zeros, stack, step_inputs

import optax_accum
from optax_accum import _protocol

STEPS = 7

WRAPPERS = {
    "alone": lambda tx: tx,
    "last_in_chain": lambda tx: optax.chain(_scale_values(2.0), tx),
    "inject_hyperparams": lambda tx: optax.inject_hyperparams(
        lambda factor: optax.chain(_scale_values(factor), tx)
    )(factor=2.0),
    "followed_by_scale": lambda tx: optax.chain(tx, _scale_values(0.5)),
}


def _scale_values(factor: float) -> optax.GradientTransformation:
    """`optax.scale` that scales only the values of `IndexedSlices` updates (optax's
    element-wise transforms must never see raw `IndexedSlices`)."""

    def update_fn(updates, state, params=None):
        del params

        def scale(u):
            if isinstance(u, optax_accum.IndexedSlices):
                return optax_accum.IndexedSlices(u.indices, u.values * factor, u.dense_shape)
            return u * factor

        is_slices = lambda x: isinstance(x, optax_accum.IndexedSlices)  # noqa: E731
        return jax.tree.map(scale, updates, is_leaf=is_slices), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _canonical(tx, case: Case):
    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return optax_accum.apply_updates(params, updates), state

    return step


def _fused(tx):
    def step(params, state, grads, extra):
        return optax_accum.apply_gradients(tx, grads, state, params, **extra)

    return step


def _run(case: Case, tx, steps: int = STEPS):
    """The canonical and the fused step side by side in one jitted program (one compile,
    not one per step shape), each on its own params and state, the same gradients:
    [(params, state)] of each after every one of `steps` steps (replica 0 under an
    axis)."""
    canonical, fused = _canonical(tx, case), _fused(tx)

    def both(one, other, grads, extra):
        return canonical(*one, grads, extra), fused(*other, grads, extra)

    params = case.params()
    if case.needs_axis:
        params = stack([params] * REPLICAS)
        state = jax.vmap(tx.init)(params)
        fn = jax.jit(jax.vmap(both, in_axes=(0, 0, 0, None), axis_name="replicas"))
    else:
        state = tx.init(params)
        fn = jax.jit(both)
    one = other = (params, state)
    out = ([], [])
    for i in range(steps):
        one, other = fn(one, other, step_inputs(case, i, frozenset()), case.extra_args(i))
        for history, run in zip(out, (one, other), strict=True):
            history.append(first(run) if case.needs_axis else run)
    return out


def _assert_close(a, b):
    a, b = spent_as_zeros(a), spent_as_zeros(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-6, atol=1e-7
        )


# Which (case, context) pairs run. Each is a compile (canonical and fused in one
# program), so not all 11 x 4. Three families fuse (conditional, sparse, drop_stale):
# each of their cases runs alone (the transform's own fused step) or, for the two that
# are their namesake with an axis name and nothing else (tests/test_contract.py's
# AXIS_TWINS), fused in a chain or inside inject_hyperparams, where the same sink takes
# the same release. In the two contexts where the step fuses (last_in_chain,
# inject_hyperparams) each fusing family runs once with a bound axis and once without
# (the vmapped sink is another path), and each such context has both;
# followed_by_scale is the fallback after a fused attempt, run once per fusing family.
# agn and cross_shard never fuse: apply_gradients is their canonical step in any
# context, the same fallback for each of their cases, so one case of each runs alone
# and the other inside inject_hyperparams (a fusing position).
ALONE = [
    "conditional_accumulator",
    "conditional_accumulator_sum_schedule",
    "sparse_conditional_accumulator",
    "agn",
    "cross_shard_packed",
    "drop_stale_gradients",
    "drop_stale_gradients_shared",
]
CONTEXT_CASES = {
    "last_in_chain": [
        "conditional_accumulator_shared",
        "sparse_conditional_accumulator",
        "drop_stale_gradients_shared",
    ],
    "inject_hyperparams": [
        "conditional_accumulator_sum_schedule",
        "sparse_conditional_accumulator_shared",
        "agn_delta_shared",
        "cross_shard_optimizer_groups_sum",
        "drop_stale_gradients",
    ],
    "followed_by_scale": [
        "conditional_accumulator",
        "sparse_conditional_accumulator",
        "drop_stale_gradients_shared",
    ],
}
FUSING = ("conditional", "sparse", "drop_stale")
_BY_NAME = {c.name: c for c in CASES}
MATRIX = [(_BY_NAME[name], "alone") for name in ALONE] + [
    (_BY_NAME[name], wrapper) for wrapper, names in CONTEXT_CASES.items() for name in names
]


@pytest.mark.parametrize(("case", "wrapper"), MATRIX, ids=[f"{c.name}-{w}" for c, w in MATRIX])
def test_apply_gradients_matches_the_canonical_step(case, wrapper):
    """Wherever the step fuses (alone, last in a chain, inside inject_hyperparams), a
    held or dropped step of the fused run also leaves the params bit for bit as they
    were (checked on this run: it needs no compile of its own)."""
    tx = WRAPPERS[wrapper](case.make("replicas" if case.needs_axis else None))
    canonical, fused = _run(case, tx)
    for i, (want, got) in enumerate(zip(canonical, fused, strict=True)):
        try:
            _assert_close(got, want)
        except AssertionError as e:
            raise AssertionError(f"step {i}: {e}") from None
    if wrapper != "followed_by_scale":
        _assert_held_steps_keep_params_bit_for_bit(case, fused)


def test_the_matrix_runs_every_case_and_every_fusing_family_in_every_context():
    assert sorted({c.name for c, _ in MATRIX}) == sorted(CASE_IDS)
    families = ("conditional", "sparse", "agn", "cross_shard", "drop_stale")
    assert all(c.name.startswith(families) for c in CASES)
    for wrapper in WRAPPERS:
        names = [c.name for c, w in MATRIX if w == wrapper]
        wanted = families if wrapper in ("alone", "inject_hyperparams") else FUSING
        assert all(any(n.startswith(f) for n in names) for f in wanted), wrapper
    # Every fusing case fuses somewhere: alone, last in a chain or in inject_hyperparams.
    fusing_where = {c.name for c, w in MATRIX if w != "followed_by_scale"}
    assert {c.name for c in CASES if c.name.startswith(FUSING)} <= fusing_where
    fused = [(c, w) for c, w in MATRIX if w in ("last_in_chain", "inject_hyperparams")]
    for family in FUSING:  # with and without an axis, over the fused contexts
        assert {c.needs_axis for c, _ in fused if c.name.startswith(family)} == {True, False}
    for wrapper in ("last_in_chain", "inject_hyperparams"):  # and in each of them
        assert {c.needs_axis for c, w in fused if w == wrapper and c.name.startswith(FUSING)} == {
            True,
            False,
        }


def _assert_held_steps_keep_params_bit_for_bit(case, history):
    params = [case.params()] + [p for p, _ in history]
    held = [i for i in range(STEPS) if case.hold_step(i) or case.drop_step(i)]
    for i in held:
        for before, after in zip(
            jax.tree.leaves(params[i]), jax.tree.leaves(params[i + 1]), strict=True
        ):
            np.testing.assert_array_equal(
                np.asarray(before), np.asarray(after), err_msg=f"held step {i}"
            )


def test_apply_gradients_of_a_plain_optax_optimizer_is_the_optax_step():
    tx = optax.adam(0.1)
    params = {"w": jnp.arange(3.0)}
    grads = {"w": jnp.array([0.5, -1.0, 2.0])}
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):
        want_updates, want_state = tx.update(grads, state, params)
        got_params, got_state = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p))(
            grads, state, params
        )
    _assert_close((got_params, got_state), (optax.apply_updates(params, want_updates), want_state))


def test_extra_args_reach_the_transform():
    tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
    params = jnp.zeros(2)
    state = optax_accum.set_global_step(tx.init(params), 3)
    # One compiled step for both calls (eager, every op and branch compiled on its own).
    step = jax.jit(lambda g, s, p, tag: optax_accum.apply_gradients(tx, g, s, p, local_step=tag))
    params, state = step(jnp.ones(2), state, params, 2)
    assert int(state.num_dropped) == 1 and not bool(optax_accum.has_updated(state))
    params, state = step(jnp.ones(2), state, params, 3)
    np.testing.assert_array_equal(np.asarray(params), [-1.0, -1.0])


def test_the_fused_step_reads_and_writes_no_params_when_it_holds():
    """In the compiled CPU program, the params reach no computation outside the
    releasing branch: a held step neither reads nor writes them."""
    tx = optax_accum.conditional_accumulator(optax.sgd(0.1, momentum=0.9), num_required=4)
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}
    state = tx.init(params)

    def train_step(params, state, grads):
        return optax_accum.apply_gradients(tx, grads, state, params)

    hlo = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, params).as_text()
    entry = hlo[hlo.index("func.func public @main") :]
    entry = entry[: entry.index("\n  }\n")]
    # %arg0 and %arg1 are params["b"] and params["w"]: used only as loop operands.
    for arg in ("%arg0", "%arg1"):
        uses = [line for line in entry.splitlines()[1:] if re.search(rf"{arg}\b", line)]
        assert uses and all("stablehlo.while" in u or "stablehlo.case" in u for u in uses), uses


FUSABLE = [c for c in CASES if c.name.startswith(FUSING)]


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("case", FUSABLE, ids=lambda c: c.name)
def test_the_release_branch_applies_the_updates_of_a_transform_given_directly(case, wrapper):
    """apply_gradients asks an optax_accum transform it is given directly to apply its
    updates inside its release branch (the step protocol's `Call(apply=True)`); a chain
    or inject_hyperparams around it hides its step, and the canonical step runs (the
    matrix above checks that both give the same values)."""
    tx = WRAPPERS[wrapper](case.make("replicas" if case.needs_axis else None))
    found = []

    def probe(params, grads):
        step = _protocol.step_of(tx)
        if step is None:
            found.append(False)
            return None
        call = _protocol.Call(apply=True)
        result = step(grads, tx.init(params), params, call, **case.extra_args(0))
        found.append(result.params is not None)
        return result.params

    if case.needs_axis:
        params = stack([case.params()] * REPLICAS)
        jax.eval_shape(jax.vmap(probe, axis_name="replicas"), params, step_inputs(case, 0, ()))
    else:
        jax.eval_shape(probe, case.params(), step_inputs(case, 0, ()))
    assert found == [wrapper == "alone"]


# --------------------------------------------------------------------------- donated steps


def _readme_loop(tx, train_step, params, opt_state):
    """README.md's Quick start loop: TF1's `local_step=global_step`, every third stale."""
    x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
    for i in range(10):
        local_step = optax_accum.global_step(opt_state)  # TF1: local_step=global_step
        if i % 3 == 2:  # a straggler's gradient, computed one step earlier: dropped
            local_step -= 1
        params, opt_state = train_step(params, opt_state, x, y, local_step)
    return params, opt_state


def _readme_loss(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)


def _apply_gradients_step(tx):
    def train_step(params, opt_state, x, y, local_step):
        grads = jax.grad(_readme_loss)(params, x, y)
        return optax_accum.apply_gradients(tx, grads, opt_state, params, local_step=local_step)

    return train_step


def _canonical_step(tx):
    def train_step(params, opt_state, x, y, local_step):
        grads = jax.grad(_readme_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, local_step=local_step)
        return optax.apply_updates(params, updates), opt_state

    return train_step


@pytest.mark.parametrize("make_step", [_apply_gradients_step, _canonical_step])
def test_the_readme_donated_step_takes_global_step_as_the_tag(make_step):
    """README.md's Quick start: params and state donated, each gradient tagged with
    `optax_accum.global_step(opt_state)`. The tag must not be a buffer of the donated
    state ("Attempt to use a buffer that was previously donated"), and the donated run
    ends where an undonated one does."""
    tx = optax_accum.conditional_accumulator(optax.adam(1e-2), num_required=4)
    step = make_step(tx)
    ends = []
    with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict-clean
        for donate in ((0, 1), ()):
            params = {"w": jnp.zeros((3, 1))}
            train_step = jax.jit(step, donate_argnums=donate)
            ends.append(_readme_loop(tx, train_step, params, tx.init(params)))
    (params, opt_state), (want_params, want_state) = ends
    assert int(optax_accum.global_step(opt_state)) == 1 and int(opt_state.num_dropped) == 3
    _assert_close((params, opt_state), (want_params, want_state))
    assert float(params["w"][0, 0]) != 0.0  # the release moved the params
