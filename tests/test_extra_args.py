"""Extra arguments reach every `update` that takes them, through every entry point.

- The train steps (`apply_gradients`, `TrainState.apply_gradients`,
  `NNXOptimizer.update`) call `tx.update` as the canonical optax step does: `local_step`
  reaches an optax_accum transform inside `optax.MultiSteps`, its
  `.gradient_transformation()`, `optax.inject_hyperparams` and `optax.chain`; a `tx`
  whose `update` cannot take it (`optax.lookahead`) raises the canonical step's
  TypeError instead of dropping the tag.
- Every optax_accum transform passes extra arguments on to an `inner` (and `agn`'s
  `outer`) whose `update` takes them (`MultiSteps`' `**extra_args`, a named keyword),
  and none to an `update` that takes none, as `optax.chain` does.
- A misspelled extra argument (`local_steps`, `localstep`, `weights`) warns once at
  trace time, naming the intended one, inside every wrapper (`optax.MultiSteps` traces
  its inner `update` twice, once under `jax.eval_shape`); optax's own extra arguments
  stay silent.
- `weight` given to a transform that does not weight gradients (`drop_stale_gradients`,
  `cross_shard_optimizer`, `agn`) warns once at trace time, unless an accumulator nested
  inside it reads the weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _matrix import pairwise

import optax_accum

PARAMS = jnp.zeros(2)
GRAD = jnp.array([1.0, 2.0])


class _MultiSteps(optax.MultiSteps):
    """optax.MultiSteps, traced under standard dtype promotion (it is not strict-clean:
    see the top-level conftest.py); its `update` keeps MultiSteps' `**extra_args`."""

    def update(self, updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return super().update(updates, state, params, **extra_args)


def _acc(learning_rate: float = 1.0) -> optax.GradientTransformationExtraArgs:
    return optax_accum.conditional_accumulator(optax.sgd(learning_rate), num_required=1)


# The optimizers a user wraps an optax_accum transform in; each passes `local_step` on.
WRAPPERS: dict[str, Callable[[], Any]] = {
    "MultiSteps": lambda: _MultiSteps(_acc(), every_k_schedule=1, use_grad_mean=False),
    "MultiSteps.gradient_transformation": lambda: _MultiSteps(
        _acc(), every_k_schedule=1, use_grad_mean=False
    ).gradient_transformation(),
    "inject_hyperparams": lambda: optax.inject_hyperparams(_acc)(learning_rate=1.0),
    "chain": lambda: optax.chain(optax.identity(), _acc()),
    "bare": _acc,
}


# --------------------------------------------------------------------------- entry points


def _canonical(tx, grads, opt_state, params, **extra):
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state


def _apply_gradients(tx, grads, opt_state, params, **extra):
    return optax_accum.apply_gradients(tx, grads, opt_state, params, **extra)


def _train_state(tx, grads, opt_state, params, **extra):
    state = optax_accum.TrainState(
        step=jnp.int32(0), apply_fn=None, params=params, tx=tx, opt_state=opt_state
    )
    state = state.apply_gradients(grads=grads, **extra)
    return state.params, state.opt_state


FUNCTIONAL = {
    "canonical": _canonical,
    "apply_gradients": _apply_gradients,
    "TrainState": _train_state,
}


def _run_functional(entry: str, tx: Any, tags: list[int]) -> tuple[np.ndarray, Any]:
    """Applies GRAD once per tag under jit; returns the params and the state."""
    step = jax.jit(lambda g, s, p, tag: FUNCTIONAL[entry](tx, g, s, p, local_step=tag))
    params, opt_state = PARAMS, tx.init(PARAMS)
    for tag in tags:
        params, opt_state = step(GRAD, opt_state, params, tag)
    return np.asarray(params), opt_state


def _run_nnx(tx: Any, tags: list[int]) -> tuple[np.ndarray, Any]:
    from flax import nnx  # the extra: these cases are marked `flax`

    class Weights(nnx.Module):
        def __init__(self, w: jax.Array) -> None:
            self.w = nnx.Param(w)

    model = Weights(PARAMS)
    optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tag):
        grads = nnx.grad(lambda m: jnp.sum(m.w[...] * GRAD))(model)
        optimizer.update(model, grads, local_step=tag)

    for tag in tags:
        step(model, optimizer, tag)
    return np.asarray(model.w[...]), optimizer.opt_state


def _run(entry: str, tx: Any, tags: list[int]) -> tuple[np.ndarray, Any]:
    return _run_nnx(tx, tags) if entry == "NNXOptimizer" else _run_functional(entry, tx, tags)


# The Flax wrappers' cases need the extra: the oldest-versions run leaves them out.
_FLAX = pytest.mark.flax
FUNCTIONAL_ENTRIES = [
    "canonical",
    "apply_gradients",
    pytest.param("TrainState", marks=_FLAX),
]
ENTRIES = [*FUNCTIONAL_ENTRIES, pytest.param("NNXOptimizer", marks=_FLAX)]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_local_step_reaches_the_accumulator_through_every_entry_point(entry, wrapper):
    """Two gradients tagged 0: the first releases (global step 0 -> 1), the second is
    stale and dropped. A lost tag would apply both."""
    params, opt_state = _run(entry, WRAPPERS[wrapper](), [0, 0])
    np.testing.assert_allclose(params, -np.asarray(GRAD, np.float64))
    assert int(optax_accum.global_step(opt_state)) == 1


@pytest.mark.parametrize("entry", FUNCTIONAL_ENTRIES)
def test_a_tag_behind_a_global_step_of_5_is_dropped_inside_multisteps(entry):
    tx = _MultiSteps(_acc(), every_k_schedule=1, use_grad_mean=False)
    step = jax.jit(lambda g, s, p: FUNCTIONAL[entry](tx, g, s, p, local_step=0))
    opt_state = optax_accum.set_global_step(tx.init(PARAMS), 5)
    params, opt_state = step(GRAD, opt_state, PARAMS)
    np.testing.assert_array_equal(np.asarray(params), [0.0, 0.0])
    assert int(optax_accum.global_step(opt_state)) == 5
    assert int(optax_accum.num_accumulated(opt_state)) == 0


def _lookahead() -> Any:
    return optax.lookahead(_acc(), sync_period=2, slow_step_size=0.5)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_tx_that_takes_no_extra_args_raises_as_the_canonical_step_does(entry):
    """optax.lookahead's update takes no extra arguments: the canonical step raises
    TypeError, and so does every train step, instead of silently dropping the tag."""
    tx = _lookahead()
    params = optax.LookaheadParams.init_synced(PARAMS)
    with pytest.raises(TypeError, match="local_step"):
        _canonical(tx, GRAD, tx.init(params), params, local_step=0)
    with pytest.raises(TypeError, match="local_step"):
        if entry == "NNXOptimizer":
            _run_nnx(tx, [0])
        else:
            FUNCTIONAL[entry](tx, GRAD, tx.init(params), params, local_step=0)


@pytest.mark.parametrize("entry", FUNCTIONAL_ENTRIES)
def test_a_tx_that_takes_no_extra_args_still_steps_without_them(entry):
    tx = _lookahead()
    params = optax.LookaheadParams.init_synced(PARAMS)
    step = jax.jit(lambda g, s, p: FUNCTIONAL[entry](tx, g, s, p))
    with jax.numpy_dtype_promotion("standard"):  # lookahead is not strict-clean
        params, _ = step(GRAD, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(params.fast), -np.asarray(GRAD, np.float64))


# --------------------------------------------------------------------------- as inner


def _scale_by_extra_kwargs() -> optax.GradientTransformation:
    """A plain GradientTransformation whose update takes **kwargs: it scales the
    updates by the extra argument `scale` (1 when it does not arrive)."""

    def update(updates, state, params=None, **extra):
        return jax.tree.map(lambda u: u * extra.get("scale", 1.0), updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _scale_by_keyword() -> optax.GradientTransformation:
    """A plain GradientTransformation whose update names `scale` as a keyword."""

    def update(updates, state, params=None, *, scale=1.0):
        return jax.tree.map(lambda u: u * scale, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _scale_extra_args() -> optax.GradientTransformationExtraArgs:
    t = _scale_by_extra_kwargs()
    return optax.GradientTransformationExtraArgs(t.init, t.update)


# Inner optimizers that take `scale`; each ends in sgd(1.0), so the update is -scale * g.
INNERS: dict[str, Callable[[], Any]] = {
    "MultiSteps": lambda: _MultiSteps(
        optax.chain(_scale_extra_args(), optax.sgd(1.0)), every_k_schedule=1, use_grad_mean=False
    ),
    "MultiSteps.gradient_transformation": lambda: _MultiSteps(
        optax.chain(_scale_extra_args(), optax.sgd(1.0)), every_k_schedule=1, use_grad_mean=False
    ).gradient_transformation(),
    "update-with-kwargs": lambda: _then_sgd(_scale_by_extra_kwargs()),
    "update-with-keyword": lambda: _then_sgd(_scale_by_keyword(), keyword=True),
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        lambda learning_rate: optax.chain(_scale_extra_args(), optax.sgd(learning_rate))
    )(learning_rate=1.0),
}


def _then_sgd(first: optax.GradientTransformation, *, keyword: bool = False) -> Any:
    """`first` then sgd(1.0), as a plain GradientTransformation whose update takes
    `**extra` (or, with `keyword`, only the keyword `scale`) and passes it to `first`."""
    sgd = optax.sgd(1.0)

    def init(params):
        return first.init(params), sgd.init(params)

    def update(updates, state, params=None, **extra):
        updates, s0 = first.update(updates, state[0], params, **extra)
        updates, s1 = sgd.update(updates, state[1], params)
        return updates, (s0, s1)

    def update_keyword(updates, state, params=None, *, scale=1.0):
        return update(updates, state, params, scale=scale)

    return optax.GradientTransformation(init, update_keyword if keyword else update)


AXIS = "replicas"

# Each optax_accum transform around an inner, so that one update releases the inner's.
TRANSFORMS: dict[str, Callable[[Any], Any]] = {
    "conditional_accumulator": lambda inner: optax_accum.conditional_accumulator(inner, 1),
    "sparse_conditional_accumulator": lambda inner: optax_accum.sparse_conditional_accumulator(
        inner, 1, capacity=2
    ),
    "drop_stale_gradients": lambda inner: optax_accum.drop_stale_gradients(inner, 0),
    # TF's AGN sums the raw gradients; the delta commit carries the inner's updates.
    "agn": lambda inner: optax_accum.agn(inner, 1, commit="delta"),
    "agn-outer": lambda inner: optax_accum.agn(optax.sgd(1.0), 1, outer=inner),
    "cross_shard_optimizer": lambda inner: optax_accum.cross_shard_optimizer(inner, AXIS),
}


def _step_once(transform: str, tx: Any, entry: str, **extra: Any) -> np.ndarray:
    """One jitted step from PARAMS with gradient GRAD; returns the new params."""

    def step(g, p):
        return FUNCTIONAL[entry](tx, g, tx.init(p), p, **extra)[0]

    if transform == "cross_shard_optimizer":  # two replicas, same gradient
        stacked = jnp.stack([GRAD, GRAD]), jnp.stack([PARAMS, PARAMS])
        return np.asarray(jax.jit(jax.vmap(step, axis_name=AXIS))(*stacked)[0])
    return np.asarray(jax.jit(step)(GRAD, PARAMS))


# Every transform with every inner (how each forwards to each kind of inner), each of
# them through both entry points: pairwise, not the 60 of the full product.
REACH = pairwise(list(TRANSFORMS), list(INNERS), ["canonical", "apply_gradients"])


@pytest.mark.parametrize(("transform", "inner", "entry"), REACH, ids=["-".join(r) for r in REACH])
def test_extra_args_reach_an_inner_that_takes_them(transform, inner, entry):
    tx = TRANSFORMS[transform](INNERS[inner]())
    params = _step_once(transform, tx, entry, scale=3.0, local_step=0)
    # agn with one local step per round: the outer applies the mean of the round's
    # gradients; either way the result is -3 * GRAD.
    np.testing.assert_allclose(params, -3.0 * np.asarray(GRAD, np.float64), rtol=1e-6)


def _plain_sgd() -> optax.GradientTransformation:
    sgd = optax.sgd(1.0)
    return optax.GradientTransformation(sgd.init, lambda u, s, p=None: sgd.update(u, s, p))


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_an_inner_that_takes_no_extra_args_gets_none(transform):
    """As optax.chain does: `conditional_accumulator(plain_tx)` works with local_step."""
    tx = TRANSFORMS[transform](_plain_sgd())
    params = _step_once(transform, tx, "apply_gradients", scale=3.0, local_step=0)
    np.testing.assert_allclose(params, -np.asarray(GRAD, np.float64), rtol=1e-6)


def test_extra_args_reach_polyak_sgd_inside_an_accumulator():
    """optax's own extra argument `value` (polyak_sgd requires it) reaches the inner,
    and stays silent."""
    tx = optax_accum.conditional_accumulator(optax.polyak_sgd(max_learning_rate=10.0), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p, value=2.5))
        params, _ = step(GRAD, tx.init(PARAMS), PARAMS)
    # Polyak step size: value / |g|^2 (capped at 10), f* = 0.
    lr = min(2.5 / float(np.sum(np.asarray(GRAD, np.float64) ** 2)), 10.0)
    np.testing.assert_allclose(np.asarray(params), -lr * np.asarray(GRAD, np.float64), rtol=1e-6)


# --------------------------------------------------------------------------- misspellings


@pytest.mark.parametrize(
    "name, intended",
    [
        ("local_steps", "local_step"),
        ("localstep", "local_step"),
        ("localStep", "local_step"),
        ("global_step", "local_step"),
        ("weights", "weight"),
    ],
)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_misspelled_extra_argument_warns_once_at_trace_time(transform, name, intended):
    tx = TRANSFORMS[transform](optax.sgd(1.0))
    with pytest.warns(UserWarning, match=rf"{name!r}.*did you mean {intended!r}") as record:
        _step_once(transform, tx, "apply_gradients", **{name: 0})
    assert len([w for w in record if name in str(w.message)]) == 1


def test_a_misspelling_warns_once_through_nested_transforms_and_only_when_traced():
    """optax_accum transforms nested in one another check the extra arguments once:
    the outermost warns, the inner ones are called through the step protocol."""
    tx = optax_accum.drop_stale_gradients(
        optax_accum.conditional_accumulator(
            optax_accum.conditional_accumulator(optax.sgd(1.0), 2), 2
        ),
        5,
    )
    step = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p, local_steps=0))
    params, opt_state = PARAMS, tx.init(PARAMS)
    with pytest.warns(UserWarning, match="did you mean 'local_step'") as record:
        params, opt_state = step(GRAD, opt_state, params)
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the traced step runs again without a warning
        params, opt_state = step(GRAD, opt_state, params)


def _messages(make_step, action: str) -> list[str]:
    """The warnings one traced step gives under the warning filter `action`."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter(action)
        make_step()
    return [str(w.message).split("?")[0] for w in record]


MISSPELLED = (
    "extra argument 'local_steps' is not one optax_accum transforms take: did you mean 'local_step'"
)
# Transforms from elsewhere that reach an optax_accum transform, and how many times its
# update is traced through them in one step: optax.MultiSteps traces it twice (for the
# step, and under jax.eval_shape for the zeros of its skip branch), so each of those
# traces warns; drop_stale_gradients around it warns once more.
THROUGH_OTHERS = {
    **{name: (make, 2 if name.startswith("MultiSteps") else 1) for name, make in WRAPPERS.items()},
    "drop_stale_gradients(MultiSteps)": (
        lambda: optax_accum.drop_stale_gradients(
            _MultiSteps(optax_accum.conditional_accumulator(optax.sgd(1.0), 2), 1),
            5,
        ),
        3,
    ),
}


@pytest.mark.parametrize("wrapper", list(THROUGH_OTHERS))
def test_a_misspelling_is_shown_once_through_transforms_from_elsewhere(wrapper):
    """An optax_accum transform reached through a transform from elsewhere checks the
    extra arguments itself, once per trace of its update; every such warning comes from
    one line, so Python's default warning filter shows it once."""
    make, traces = THROUGH_OTHERS[wrapper]
    tx = make()
    step = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p, local_steps=0))
    run = lambda: step(GRAD, tx.init(PARAMS), PARAMS)  # noqa: E731
    assert _messages(run, "always") == [MISSPELLED] * traces
    step = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p, local_steps=0))
    assert _messages(run, "default") == [MISSPELLED]


@pytest.mark.parametrize(
    "extra",
    [
        {"local_step": 0},
        {"value": 1.0},  # optax's polyak_sgd, reduce_on_plateau
        {"grad": GRAD, "value_fn": None},  # optax's linesearches
        {"step": 3, "learning_rate": 0.1, "key": 0, "rng": 0, "loss": 1.0, "mask": 1},
    ],
    ids=["local_step", "value", "linesearch", "others"],
)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_legitimate_extra_arguments_stay_silent(transform, extra):
    tx = TRANSFORMS[transform](optax.sgd(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step_once(transform, tx, "canonical", **extra)


# --------------------------------------------------------------------------- unread weights


def _weighted_step(tx: Any, *, replicas: bool = False) -> np.ndarray:
    """One jitted step with weight=2 (two replicas under vmap when `replicas`)."""

    def step(g, p):
        return optax_accum.apply_gradients(tx, g, tx.init(p), p, weight=2.0)[0]

    if replicas:
        stacked = jnp.stack([GRAD, GRAD]), jnp.stack([PARAMS, PARAMS])
        return np.asarray(jax.jit(jax.vmap(step, axis_name=AXIS))(*stacked)[0])
    return np.asarray(jax.jit(step)(GRAD, PARAMS))


# Transforms that do not weight gradients, around nests in which nothing does.
UNWEIGHTED: dict[str, tuple[str, Callable[[], Any], bool]] = {
    "drop_stale_gradients(sgd)": (
        "drop_stale_gradients",
        lambda: optax_accum.drop_stale_gradients(optax.sgd(1.0), 0),
        False,
    ),
    "cross_shard_optimizer(sgd)": (
        "cross_shard_optimizer",
        lambda: optax_accum.cross_shard_optimizer(optax.sgd(1.0), AXIS),
        True,
    ),
    "agn(sgd)": ("agn", lambda: optax_accum.agn(optax.sgd(1.0), 1), False),
    "drop_stale_gradients(cross_shard_optimizer(sgd))": (  # the outermost warns, once
        "drop_stale_gradients",
        lambda: optax_accum.drop_stale_gradients(
            optax_accum.cross_shard_optimizer(optax.sgd(1.0), AXIS), 0
        ),
        True,
    ),
    "MultiSteps(drop_stale_gradients(sgd))": (  # traced twice by MultiSteps, warns once
        "drop_stale_gradients",
        lambda: _MultiSteps(
            optax_accum.drop_stale_gradients(optax.sgd(1.0), 0), 1, use_grad_mean=False
        ),
        False,
    ),
}


@pytest.mark.parametrize("case", list(UNWEIGHTED))
def test_a_weight_nothing_reads_warns_once(case):
    """The outermost optax_accum transform warns, once per trace of its update (twice
    under optax.MultiSteps, which traces it twice), always from one line, so Python's
    default warning filter shows it once."""
    name, make, replicas = UNWEIGHTED[case]
    traces = 2 if case.startswith("MultiSteps") else 1
    for action, times in (("always", traces), ("default", 1)):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter(action)
            params = _weighted_step(make(), replicas=replicas)
        assert [str(w.message).split(":")[0] for w in record] == [
            f"extra argument 'weight' reaches {name}, which does not weight gradients, and "
            "nothing inside it does"
        ] * times
        assert np.all(np.isfinite(params))  # the step still runs, unweighted


def _weighing_acc() -> Any:
    return optax_accum.conditional_accumulator(optax.sgd(1.0), 2, reduction="sum")


# Nests in which an accumulator reads the weight: a release of one gradient, weighted 2.
WEIGHTED: dict[str, tuple[Callable[[], Any], bool]] = {
    "conditional_accumulator": (_weighing_acc, False),
    "sparse_conditional_accumulator": (
        lambda: optax_accum.sparse_conditional_accumulator(
            optax.sgd(1.0), 2, capacity=2, reduction="sum"
        ),
        False,
    ),
    "drop_stale_gradients(conditional_accumulator)": (
        lambda: optax_accum.drop_stale_gradients(_weighing_acc(), 0),
        False,
    ),
    "drop_stale_gradients(chain(identity, conditional_accumulator))": (
        lambda: optax_accum.drop_stale_gradients(optax.chain(optax.identity(), _weighing_acc()), 0),
        False,
    ),
    "drop_stale_gradients(MultiSteps(conditional_accumulator))": (
        lambda: optax_accum.drop_stale_gradients(
            _MultiSteps(_weighing_acc(), 1, use_grad_mean=False), 0
        ),
        False,
    ),
    "cross_shard_optimizer(conditional_accumulator)": (
        lambda: optax_accum.cross_shard_optimizer(_weighing_acc(), AXIS),
        True,
    ),
    "chain(cross_shard, conditional_accumulator)": (  # the guide's multi-slice chain
        lambda: optax.chain(optax_accum.cross_shard(AXIS), _weighing_acc()),
        True,
    ),
}


@pytest.mark.parametrize("case", list(WEIGHTED))
def test_a_weight_an_accumulator_reads_stays_silent(case):
    make, replicas = WEIGHTED[case]
    tx = make()
    step = jax.jit(
        lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p, weight=2.0),
    )
    if replicas:
        step = jax.jit(jax.vmap(step, axis_name=AXIS))
    grads = jnp.stack([GRAD, GRAD]) if replicas else GRAD
    params = jnp.stack([PARAMS, PARAMS]) if replicas else PARAMS
    opt_state = jax.vmap(tx.init)(params) if replicas else tx.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the second gradient releases the sum of both, each weighed 2
            params, opt_state = step(grads, opt_state, params)
    expected = -4.0 * np.asarray(GRAD, np.float64)
    np.testing.assert_allclose(np.asarray(params).reshape(-1, 2)[0], expected, rtol=1e-6)
