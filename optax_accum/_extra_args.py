"""Extra arguments (`local_step`, `weight`, ...): which an `update` takes, and the warnings.

optax passes a chain's extra arguments to every member, and `optax.with_extra_args_support`
drops them for anything that is not a `GradientTransformationExtraArgs`, including
`optax.MultiSteps`, whose `update` takes `**extra_args` and passes them on. optax_accum
calls an `inner` it did not build with the extra arguments its `update` takes
(`taken_by`): all of them when it is a `GradientTransformationExtraArgs` or its `update`
has `**kwargs`, the keywords it names otherwise, and none to an `update` that takes none
(as `optax.chain` does). The train steps (`apply_gradients`, `TrainState`,
`NNXOptimizer`) call `tx.update` directly instead, as the canonical step does, so a `tx`
that cannot take an extra argument raises the same TypeError there.

optax cannot refuse an extra argument a transform does not know (another member of a
chain may take it), so a misspelled one would be ignored silently; `warn_misspelled`
warns, at trace time, about a name close to one optax_accum transforms take. An
optax_accum transform called by another through the step protocol does not warn again
(`_protocol.Call.checked`). One reached through a transform from elsewhere does, and
`optax.MultiSteps` traces its inner `update` twice (once for the step, once under
`jax.eval_shape` for the shape of its zeros): the warning is then issued more than once,
always from the same line of this module, so Python's default warning filter shows it
once.

In the same way, `weight` passed to a transform that does not weight gradients
(`drop_stale_gradients`, `cross_shard_optimizer`, `agn`) would be ignored silently unless
something inside it weights them: `warn_if_weight_unread` warns when nothing read it. An
optax_accum inner says whether it read the weight (`_protocol.Result.read_weight`); for
another one, `reads_weight` traces its update once more (nothing runs) and looks whether
its result depends on the weight.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

# The extra arguments optax_accum transforms take.
KNOWN = ("local_step", "weight")


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


def taken_by(tx: Any, extra_args: Mapping[str, Any]) -> dict[str, Any]:
    """The extra arguments that `tx.update` takes (see the module docstring)."""
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return dict(extra_args)
    taken = _taken_names(tx.update)
    if taken is None:
        return dict(extra_args)
    return {k: v for k, v in extra_args.items() if k in taken}


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

    Called by each transform's `update` unless its caller checked already, so under
    `jit` it warns when the step is traced, not on every step.
    """
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
            stacklevel=1,  # one line for every transform: the default filter shows it once
        )


def reads_weight(update: Callable[[Any], Any], weight: Any) -> bool:
    """Whether the result of `update(weight)` depends on `weight`.

    `update` is traced once more (`jax.make_jaxpr`; nothing is compiled or run), and
    the weight's variable is looked for among the inputs of the traced equations and
    the outputs (a weight that reaches a nested jitted function counts as read).
    """
    jaxpr = jax.make_jaxpr(update)(weight).jaxpr
    (variable,) = jaxpr.invars
    inputs = [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars)
    return any(v == variable for v in inputs)  # literals are never the weight


def warn_if_weight_unread(
    name: str, weight: Any, read: bool | None, update: Callable[[Any], Any]
) -> None:
    """Warns that the `weight` given to `name` (a transform that does not weight
    gradients) is ignored, when nothing inside it read it: `read` says so for optax_accum
    inners (None: unknown), and `update(weight)`, the inner's update as a function of
    the weight, is probed otherwise (`reads_weight`)."""
    if weight is None or read or (read is None and reads_weight(update, weight)):
        return
    warnings.warn(
        f"extra argument 'weight' reaches {name}, which does not weight "
        f"gradients, and nothing inside it does: the weight is ignored. Weighted "
        f"means come from conditional_accumulator and "
        f"sparse_conditional_accumulator (put one inside {name}, or around it). If "
        f"another transform in your optimizer takes 'weight', silence this warning "
        f"with warnings.filterwarnings.",
        UserWarning,
        stacklevel=1,  # one line for every transform: the default filter shows it once
    )


__all__ = [
    "KNOWN",
    "reads_weight",
    "taken_by",
    "warn_if_weight_unread",
    "warn_misspelled",
]
