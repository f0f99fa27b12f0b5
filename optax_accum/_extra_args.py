"""Extra arguments (`local_step`, `weight`, ...): passed on to every `update` that takes them.

optax passes a chain's extra arguments to every member, and `optax.with_extra_args_support`
drops them for anything that is not a `GradientTransformationExtraArgs`, including
`optax.MultiSteps`, whose `update` takes `**extra_args` and passes them on. optax_accum
calls an `inner` it did not build through `forward_to`, which passes the extra
arguments its `update` takes: all of them when it is a `GradientTransformationExtraArgs`
or its `update` has `**kwargs`, the keywords it names otherwise, and none to an `update`
that takes none (as `optax.chain` does). The train steps (`apply_gradients`,
`TrainState`, `NNXOptimizer`) call `tx.update` directly instead, as the canonical step
does, so a `tx` that cannot take an extra argument raises the same TypeError there.

optax cannot refuse an extra argument a transform does not know (another member of a
chain may take it), so a misspelled one would be ignored silently; `warn_misspelled`
warns, at trace time, about a name close to one optax_accum transforms take. In the same
way, `weight` passed to a transform that does not weight gradients (`drop_stale_gradients`,
`cross_shard_optimizer`, `agn`) would be ignored silently unless something inside it
weights them: `warning_on_unread_weight` wraps such a transform and warns when nothing
in its nest called `read_weight` (as the accumulators do) while its update ran.

`optax.MultiSteps` traces its inner `update` twice per step: once for the step, and once
under `jax.eval_shape` for the shape of the zeros it returns on a skipped step. A
shape-only evaluation like that one does not warn, so a step warns once.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import inspect
import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import optax

from optax_accum import _checks

# The extra arguments optax_accum transforms take.
KNOWN = ("local_step", "weight")

# Set while `forward_to`'s wrapper runs an inner `update`: the outermost optax_accum
# transform has checked the extra arguments already, so the inner ones stay quiet and a
# misspelled name warns once per trace, not once per level of nesting.
_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("_CHECKED", default=False)


# Set while the update of a transform wrapped by `warning_on_unread_weight` runs, when a
# `weight` was passed: one flag, raised by `read_weight` in any update nested inside.
_WEIGHT_READ: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "_WEIGHT_READ", default=None
)


@contextlib.contextmanager
def _checked() -> Iterator[None]:
    """Marks the extra arguments as checked while an inner `update` runs."""
    token = _CHECKED.set(True)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def _taken_names(update: Any) -> frozenset[str] | None:
    """The extra-argument names `update` takes by keyword; None when it takes **kwargs."""
    try:
        parameters = list(inspect.signature(update).parameters.values())
    except (TypeError, ValueError):  # no signature to read: pass nothing
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    # The first three positional parameters are (updates, state, params).
    positional = [p for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    named = positional[3:] + [p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return frozenset(p.name for p in named if p.kind is not inspect.Parameter.POSITIONAL_ONLY)


def forward_to(name: str, inner: Any) -> optax.GradientTransformationExtraArgs:
    """`inner` (checked to be a transformation) as one that takes any extra arguments
    and passes on those its `update` takes (see the module docstring)."""
    inner = _checks.require_transformation(name, inner)
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        taken = None
    else:
        taken = _taken_names(inner.update)

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if taken is not None:
            extra_args = {k: v for k, v in extra_args.items() if k in taken}
        with _checked():
            return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _normalised(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _intended(name: str) -> str | None:
    """The known extra argument `name` looks like a misspelling of, if any."""
    if name in KNOWN:
        return None
    key = _normalised(name)
    for known in KNOWN:
        if difflib.SequenceMatcher(None, key, _normalised(known)).ratio() >= 0.8:
            return known
    return None


def _for_shapes_only(update_frame: types.FrameType) -> bool:
    """Whether the `update` running in `update_frame` was called by `jax.eval_shape`
    directly (only JAX's own frames between them), as `optax.MultiSteps` does to learn
    the shapes of its updates: its caller runs the same `update` for the step too."""
    frame = update_frame.f_back
    while frame is not None and frame.f_globals.get("__name__", "").startswith("jax."):
        if frame.f_code.co_name == "eval_shape":
            return True
        frame = frame.f_back
    return False


def warn_misspelled(extra_args: Mapping[str, Any]) -> None:
    """Warns about each extra argument whose name is close to, but not, one that
    optax_accum transforms take (`local_steps` for `local_step`, `weights` for `weight`).

    Called at the top of each transform's `update`, so under `jit` it warns when the
    step is traced, not on every step; an inner transform does not repeat the warning,
    nor does a shape-only evaluation of the update (see the module docstring).
    """
    if _CHECKED.get():
        return
    misspelled = [(name, _intended(name)) for name in extra_args if _intended(name) is not None]
    if not misspelled or _for_shapes_only(sys._getframe(1)):
        return
    for name, intended in misspelled:
        hint = ""
        if _normalised(name) == "globalstep":
            hint = (
                " The global step is kept in the state (optax_accum.global_step(state)); "
                "local_step tags a gradient with the step it was computed at."
            )
        warnings.warn(
            f"extra argument {name!r} is not one optax_accum transforms take: did you mean "
            f"{intended!r}? optax passes it on to the transforms that take it and "
            f"optax_accum ignores it.{hint} If another transform in your optimizer takes "
            f"{name!r}, silence this warning with warnings.filterwarnings.",
            UserWarning,
            stacklevel=3,
        )


def read_weight() -> None:
    """Records that an update read the `weight` it was given (see
    `warning_on_unread_weight`). Called by the transforms that weight gradients."""
    read = _WEIGHT_READ.get()
    if read is not None:
        read[0] = True


# The closure `warning_on_unread_weight` returns reaches `_WEIGHT_READ` only through
# these module-level functions: cloudpickle (Ray) pickles a closure's globals by value,
# and a ContextVar cannot be pickled, while a module's functions go by reference.


def _weight_watched() -> bool:
    """Whether an enclosing update already watches for a read of `weight`."""
    return _WEIGHT_READ.get() is not None


@contextlib.contextmanager
def _watching_weight() -> Iterator[list[bool]]:
    """Watches for `read_weight` while the block runs; the flag says whether it came."""
    read = [False]
    token = _WEIGHT_READ.set(read)
    try:
        yield read
    finally:
        _WEIGHT_READ.reset(token)


def warning_on_unread_weight(
    name: str, tx: optax.GradientTransformationExtraArgs
) -> optax.GradientTransformationExtraArgs:
    """`tx` (the transform `name` builds, which does not weight gradients itself) with
    an `update` that warns, when the step is traced, if it is given `weight` and no
    transform nested inside it reads it (`read_weight`): the weight would be ignored.

    The outermost such transform of a nest watches for the whole nest, so
    `drop_stale_gradients(conditional_accumulator(...))` stays silent, and
    `drop_stale_gradients(cross_shard_optimizer(adam))` warns once.
    """

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if extra_args.get("weight") is None or _weight_watched():
            return tx.update(updates, state, params, **extra_args)
        with _watching_weight() as read:
            result = tx.update(updates, state, params, **extra_args)
        if not read[0] and not _for_shapes_only(sys._getframe(0)):
            warnings.warn(
                f"extra argument 'weight' reaches {name}, which does not weight "
                f"gradients, and nothing inside it does: the weight is ignored. Weighted "
                f"means come from conditional_accumulator and "
                f"sparse_conditional_accumulator (put one inside {name}, or around it). If "
                f"another transform in your optimizer takes 'weight', silence this warning "
                f"with warnings.filterwarnings.",
                UserWarning,
                stacklevel=2,
            )
        return result

    return optax.GradientTransformationExtraArgs(tx.init, update)
