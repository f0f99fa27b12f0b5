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
warns, at trace time, about a name close to one optax_accum transforms take.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import inspect
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


def warn_misspelled(extra_args: Mapping[str, Any]) -> None:
    """Warns about each extra argument whose name is close to, but not, one that
    optax_accum transforms take (`local_steps` for `local_step`, `weights` for `weight`).

    Called at the top of each transform's `update`, so under `jit` it warns when the
    step is traced, not on every step; an inner transform does not repeat the warning.
    """
    if _CHECKED.get():
        return
    for name in extra_args:
        intended = _intended(name)
        if intended is None:
            continue
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
