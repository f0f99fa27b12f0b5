"""The registry of exported transforms that the cross-cutting suites run over.

Each `Case` builds one optax_accum transform at a small size with a deterministic
gradient stream, so the contract, Flax, Orbax and preemption suites can test every
transform the same way. A module that exports a transform adds its case(s) here.

Conventions:
- `make(axis_name)` returns the transform; `axis_name` is None, or the name of a
  mapped axis the harness binds (with `jax.vmap(axis_name=...)`, `REPLICAS` wide)
  when `needs_axis` is True.
- `grads(i)` is the gradient tree offered at step i (same structure as `params()`);
  under an axis, `replica_grads(i, r)` lets replicas differ (default: grads(i) * (r+1)).
- `extra_args(i)` returns the extra keyword arguments for step i (e.g. local_step);
  `hold_step(i)` is True when step i holds (no release) and `drop_step(i)` when the
  gradient at step i is dropped, used by the non-finite tests.
- `apply_updates` is how updates are applied (optax_accum.apply_updates for sparse).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum

REPLICAS = 2


def _holds_sum(x: Any) -> bool:
    return isinstance(x, optax_accum.ConditionalAccumulatorState | optax_accum.AGNState)


def spent_as_zeros(tree: Any) -> Any:
    """`tree` with the `storage` of every `conditional_accumulator` and `agn` state
    in it (nested ones too) read through `optax_accum.accumulated`: a release leaves the
    field's values unspecified (the canonical step carries its updates in it), so two
    runs that agree compare equal only this way."""

    def read(x: Any) -> Any:
        if not _holds_sum(x):
            return x
        nested = {"inner_state": spent_as_zeros(x.inner_state)}
        if isinstance(x, optax_accum.AGNState):
            nested["outer_state"] = spent_as_zeros(x.outer_state)
        x = x._replace(**nested)
        return x._replace(storage=optax_accum.accumulated(x))

    return jax.tree.map(read, tree, is_leaf=_holds_sum)


def lenient(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`inner` traced under standard dtype promotion.

    The suite runs with strict promotion so optax_accum's own code cannot up-cast
    silently, but optax's Adam computes `decay ** count` (float ** int32), which
    strict mode rejects. Wrapping a third-party optimizer in `lenient` keeps our code
    strict and theirs as they ship it.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        with jax.numpy_dtype_promotion("standard"):
            return inner.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam(learning_rate: float = 0.1, **kw) -> optax.GradientTransformationExtraArgs:
    """optax.adam under `lenient` promotion."""
    return lenient(optax.adam(learning_rate, **kw))


def _params() -> dict:
    return {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3), "b": jnp.zeros(3)}


def _grads(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Any], optax.GradientTransformationExtraArgs]
    params: Callable[[], Any] = _params
    grads: Callable[[int], Any] = _grads
    extra_args: Callable[[int], dict] = lambda i: {}
    needs_axis: bool = False
    needs_params: bool = False
    hold_step: Callable[[int], bool] = lambda i: False
    drop_step: Callable[[int], bool] = lambda i: False
    apply_updates: Callable[[Any, Any], Any] = optax.apply_updates

    def replica_grads(self, i: int, r: int) -> Any:
        def scale(g: Any) -> Any:  # IndexedSlices: scale the rows, never the ids
            if isinstance(g, optax_accum.IndexedSlices):
                return optax_accum.IndexedSlices(g.indices, g.values * (r + 1), g.dense_shape)
            return g * (r + 1)

        return jax.tree.map(scale, self.grads(i), is_leaf=_is_slices)


def _is_slices(x: Any) -> bool:
    return isinstance(x, optax_accum.IndexedSlices)


def _stale_every_third(i: int) -> dict:
    # Steps 0,1 | 3,4 | ... are fresh; step 2, 5, ... are tagged one step behind.
    return {"local_step": jnp.int32(-1 if i % 3 == 2 else i // 3)}


def _stale_drop_every_third(i: int) -> dict:
    # drop_stale_gradients(staleness=1): steps 2, 5, ... lag 2 behind (dropped); the
    # rest are up to date. The global step before step i is i - (i + 1) // 3.
    step = i - (i + 1) // 3
    return {"local_step": jnp.int32(step - 2 if i % 3 == 2 else step)}


def _sparse_params() -> dict:
    return {"emb": jnp.linspace(-1.0, 1.0, 36, dtype=jnp.float32).reshape(12, 3), "b": jnp.zeros(3)}


def _sparse_grads(i: int) -> dict:
    # Four ids per gradient: one duplicate pair and one padding row (id 12).
    rng = np.random.default_rng(100 + i)
    ids = rng.choice(12, size=3, replace=False)
    ids = np.array([ids[0], ids[1], ids[0], 12 if i % 2 else ids[2]], np.int32)
    return {
        "emb": optax_accum.IndexedSlices(
            jnp.asarray(ids), jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), (12, 3)
        ),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


def _sparse_accumulator(axis: Any, **kw: Any) -> optax.GradientTransformationExtraArgs:
    return optax_accum.sparse_conditional_accumulator(
        optax.chain(optax_accum.densify(), adam(0.1)),
        sparse={"emb": True, "b": False},
        axis_name=axis,
        **kw,
    )


CASES: list[Case] = [
    Case(
        name="conditional_accumulator",
        make=lambda axis: optax_accum.conditional_accumulator(
            adam(0.1), num_required=2, axis_name=axis
        ),
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
    Case(
        name="conditional_accumulator_sum_schedule",
        make=lambda axis: optax_accum.conditional_accumulator(
            optax.sgd(0.1, momentum=0.9),
            num_required=lambda step: 2 + step % 2,
            reduction="SUM",
            axis_name=axis,
        ),
        hold_step=lambda i: i == 0,
    ),
    Case(
        name="conditional_accumulator_shared",
        make=lambda axis: optax_accum.conditional_accumulator(
            adam(0.1), num_required=2 * REPLICAS, axis_name=axis or "replicas"
        ),
        needs_axis=True,
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
    Case(
        name="sparse_conditional_accumulator",
        make=lambda axis: _sparse_accumulator(axis, num_required=2, capacity=8),
        params=_sparse_params,
        grads=_sparse_grads,
        apply_updates=optax_accum.apply_updates,
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
    Case(
        name="sparse_conditional_accumulator_shared",
        make=lambda axis: _sparse_accumulator(
            axis or "replicas", num_required=2 * REPLICAS, capacity=12
        ),
        params=_sparse_params,
        grads=_sparse_grads,
        apply_updates=optax_accum.apply_updates,
        needs_axis=True,
        extra_args=_stale_every_third,
        hold_step=lambda i: i % 3 == 0,
        drop_step=lambda i: i % 3 == 2,
    ),
    # agn updates the local params on every step (nothing is held or dropped).
    Case(
        name="agn",
        make=lambda axis: optax_accum.agn(adam(0.1), 3, axis_name=axis),
        needs_params=True,
    ),
    Case(
        name="agn_delta_shared",
        make=lambda axis: optax_accum.agn(
            optax.sgd(0.1, momentum=0.9),
            2,
            axis_name=axis or "replicas",
            outer=optax.sgd(1.0, momentum=0.5, nesterov=True),
            commit="delta",
        ),
        needs_axis=True,
        needs_params=True,
    ),
    # cross_shard is stateless and holds nothing; replicas see grads(i) * (r + 1).
    Case(
        name="cross_shard_packed",
        make=lambda axis: optax_accum.cross_shard(axis or "replicas", pack=True),
        needs_axis=True,
    ),
    Case(
        name="cross_shard_optimizer_groups_sum",
        make=lambda axis: optax_accum.cross_shard_optimizer(
            adam(0.1), axis or "replicas", reduction="sum", group_assignment=[[1, 0]]
        ),
        needs_axis=True,
    ),
    Case(
        name="drop_stale_gradients",
        make=lambda axis: optax_accum.drop_stale_gradients(adam(0.1), 1, axis_name=axis),
        extra_args=_stale_drop_every_third,
        hold_step=lambda i: i % 3 == 2,
        drop_step=lambda i: i % 3 == 2,
    ),
    Case(
        name="drop_stale_gradients_shared",
        make=lambda axis: optax_accum.drop_stale_gradients(
            optax_accum.cross_shard_optimizer(adam(0.1), axis or "replicas"),
            1,
            axis_name=axis or "replicas",
        ),
        needs_axis=True,
        extra_args=_stale_drop_every_third,
        hold_step=lambda i: i % 3 == 2,
        drop_step=lambda i: i % 3 == 2,
    ),
]

CASE_IDS = [c.name for c in CASES]


def stack(trees: list) -> Any:
    """The trees stacked leafwise along a new leading (replica) axis."""
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def first(tree: Any) -> Any:
    """Replica 0 of a stacked tree."""
    return jax.tree.map(lambda x: x[0], tree)


def _nan_like(tree: Any) -> Any:
    return jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), tree)


def step_inputs(case: Case, i: int, poison: frozenset[int]) -> Any:
    """The gradient offered at step i (all replicas stacked under an axis)."""
    if case.needs_axis:
        grads = stack([case.replica_grads(i, r) for r in range(REPLICAS)])
    else:
        grads = case.grads(i)
    return _nan_like(grads) if i in poison else grads


@functools.cache
def _cached_step(case: Case, tx: Any, axis: str | None) -> tuple[Any, Callable]:
    tx = tx if tx is not None else case.make(axis)

    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return case.apply_updates(params, updates), state, updates

    if case.needs_axis:
        return tx, jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None), axis_name=axis))
    return tx, jax.jit(step)


def _jitted_step(case: Case, tx: Any, axis: str) -> tuple[Any, Callable]:
    """(tx, its jitted step) for `case`: `case.make(...)` when `tx` is None.

    One per (case, tx, axis) in a test process, so the many trajectories the suites
    run of one case (any length, poisoned or clean) share one compiled program.
    """
    axis = axis if case.needs_axis else None
    try:
        return _cached_step(case, tx, axis)
    except TypeError:  # an unhashable tx: compiled for this trajectory alone
        return _cached_step.__wrapped__(case, tx, axis)


def trajectory(
    case: Case,
    steps: int,
    *,
    tx: Any = None,
    poison: frozenset[int] = frozenset(),
    axis: str = "replicas",
) -> tuple[Any, Any, list]:
    """Runs `steps` jitted updates of `case` from scratch.

    Returns (params, state, updates per step). Steps in `poison` get all-NaN
    gradients. Under `needs_axis`, `REPLICAS` replicas run under
    `jax.vmap(axis_name=axis)`, and replica 0's params, state and updates come back.
    """
    tx, fn = _jitted_step(case, tx, axis)
    params = case.params()
    if case.needs_axis:
        params = stack([params] * REPLICAS)
        state = jax.vmap(tx.init)(params)
    else:
        state = tx.init(params)
    history = []
    for i in range(steps):
        params, state, updates = fn(params, state, step_inputs(case, i, poison), case.extra_args(i))
        history.append(first(updates) if case.needs_axis else updates)
    if case.needs_axis:
        return first(params), first(state), history
    return params, state, history


def run(case: Case, steps: int, *, tx: Any = None) -> tuple[Any, Any]:
    """(params, state) after `steps` jitted updates of `case` from scratch."""
    params, state, _ = trajectory(case, steps, tx=tx)
    return params, state


def scan_run(case: Case, steps: int, *, tx: Any = None, axis: str = "replicas") -> tuple:
    """The same run as `run`, but all steps inside one `jax.lax.scan`."""
    tx = tx if tx is not None else case.make(axis if case.needs_axis else None)
    grads = stack([step_inputs(case, i, frozenset()) for i in range(steps)])
    extras = stack([case.extra_args(i) for i in range(steps)])

    def many(params, grads, extras):
        def body(carry, xs):
            params, state = carry
            g, extra = xs
            updates, state = tx.update(g, state, params, **extra)
            return (case.apply_updates(params, updates), state), None

        (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), (grads, extras))
        return params, state

    params = case.params()
    if case.needs_axis:
        params = stack([params] * REPLICAS)
        grads = jax.tree.map(lambda g: jnp.swapaxes(g, 0, 1), grads)
        fn = jax.vmap(many, in_axes=(0, 0, None), axis_name=axis)
        params, state = jax.jit(fn)(params, grads, extras)
        return first(params), first(state)
    return jax.jit(many)(params, grads, extras)


def examples(thorough: int) -> int:
    """A property test's Hypothesis example count under the profile in use.

    `thorough` under `--hypothesis-profile thorough` (100 examples by default), a
    quarter of it under "ci", the default profile (25), at least 4: the profiles
    (conftest.py) set how many, each test how many relative to the others.
    """
    return max(4, round(thorough * hypothesis.settings.default.max_examples / 100))
