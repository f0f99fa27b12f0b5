"""The step protocol: what an optax_accum transform takes from its caller and gives back.

optax passes a transform what it needs as arguments (`updates`, `state`, `params`,
`**extra_args`) and takes back `(updates, state)`. optax_accum's transforms need a little
more from one another, and say so the same way, in arguments and return values:

- a wrapper's verdict (`Call.verdict`): `drop_stale_gradients` around an accumulator
  passes whether it accepts the gradient instead of branching around the accumulator,
  which drops what it is told to drop, in its own branch;
- the params to update in place (`Call.apply`, `Result.params`): `apply_gradients` asks
  the transform to apply its updates inside the branch that releases them, so a held
  step reads and writes no parameter;
- updates not yet made (`Call.defer`, `Result.selection`): an accumulator inside an
  enclosing branch returns its updates as a `Selection` (`where(pred, buffers, 0)`, the
  buffers in its state), and the enclosing branch selects once, after itself;
- whether the extra arguments were checked already (`Call.checked`), and whether
  anything read the `weight` (`Result.read_weight`).

A transform built with `transformation(init, step)` is an ordinary
`optax.GradientTransformationExtraArgs` whose `update` calls `step` with the default
`Call()`; optax_accum code that holds such a transform calls its `step` directly
(`step_of`, `call_inner`). A transform from elsewhere (an `optax.chain` around an
accumulator, say) hides the step: it is called through its `update`, as optax would,
and gets the default behaviour. Nothing is passed through context variables, found by
identity, or read from Python frames.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import optax

from optax_accum import _extra_args, _sums


class Call(NamedTuple):
    """What a caller asks of an optax_accum `step`, beyond optax's arguments.

    Attributes:
      verdict: a bool scalar, or None: a wrapper's acceptance of this gradient. A
        gradient it does not accept counts nowhere and cannot release: the update
        leaves the state as the wrapper's own drop would.
      apply: apply the updates to `params` inside the branch that releases them and
        return the new params in `Result.params` (None where the step did not).
      defer: the caller can take the updates as a `Selection` (it holds the state
        the selection reads, and selects after its own branch).
      checked: the extra arguments were checked (and warned about) by the caller.
    """

    verdict: jax.Array | None = None
    apply: bool = False
    defer: bool = False
    checked: bool = False


class Selection(NamedTuple):
    """Updates not made yet: `where(pred, take(state), 0)`, leaf by leaf, each cast to
    the dtype of the same leaf of `like` (the updates' abstract values).

    `take` reads the buffers out of the state that holds them; `pred` is a bool scalar.
    """

    pred: jax.Array
    take: Callable[[Any], Any]
    like: Any

    def made(self, state: Any) -> Any:
        """The updates, selected from `state`'s buffers (leaf by leaf: the buffers may
        sit in another container type than the updates)."""
        like, treedef = jax.tree.flatten(self.like)
        buffers = jax.tree.leaves(self.take(state))
        return treedef.unflatten(
            [
                _sums.zeros_unless(self.pred, b).astype(u.dtype)
                for b, u in zip(buffers, like, strict=True)
            ]
        )

    def within(self, part: Callable[[Any], Any]) -> Selection:
        """The same selection read from a state that holds this one's at `part(state)`."""
        take = self.take
        return self._replace(take=lambda state: take(part(state)))


class Result(NamedTuple):
    """What a `step` gives back.

    Attributes:
      updates: the updates, or None when `selection` says how to make them.
      state: the new state.
      params: the new params when the call asked to apply the updates and the step
        did; None otherwise (the caller applies `updates`).
      selection: the updates as a `Selection` of `state`'s buffers, when the call
        allowed it (`Call.defer`); None otherwise.
      read_weight: whether an `update` in the step read the `weight` extra argument
        (None: unknown, a transform from elsewhere ran).
    """

    updates: Any
    state: Any
    params: Any = None
    selection: Selection | None = None
    read_weight: bool | None = False

    def made(self) -> Any:
        """The updates, made from the selection if they are one."""
        return self.updates if self.selection is None else self.selection.made(self.state)


def result_of(
    updates: Any,
    state: Any,
    call: Call,
    *,
    part: Callable[[Any], Any] = lambda state: state,
    params: Any = None,
    read_weight: bool | None = False,
) -> Result:
    """A step's `Result`, from the updates its branch gave: arrays, or a `Selection` of
    the branch's operand, which sits at `part(state)` in the new `state`. A selection
    is passed on when the call allows it (`Call.defer`), and made otherwise."""
    if isinstance(updates, Selection):
        selection = updates.within(part)
        if call.defer:
            return Result(None, state, selection=selection, read_weight=read_weight)
        updates = selection.made(state)
    return Result(updates, state, params=params, read_weight=read_weight)


def watch_weight(
    name: str,
    call: Call,
    read: bool | None,
    inner: Any,
    updates: Any,
    state: Any,
    params: Any,
    extra_args: dict[str, Any],
) -> None:
    """For `name`, a transform that does not weight gradients, called by no other
    optax_accum transform: warns when a `weight` was given and nothing inside read it
    (`read`, from `inner`'s `Result`; for an `inner` from elsewhere, its update is
    probed, `_extra_args.reads_weight`)."""
    if call.checked:  # the outermost transform of a nest watches for the whole nest
        return

    def update(weight: Any) -> Any:
        with_weight = {**extra_args, "weight": weight}
        result = call_inner(inner, updates, state, params, Call(), **with_weight)
        return result.updates, result.state

    _extra_args.warn_if_weight_unread(name, extra_args.get("weight"), read, update)


class Step(Protocol):
    def __call__(
        self, updates: Any, state: Any, params: Any, call: Call, **extra_args: Any
    ) -> Result: ...


_STEP = "optax_accum_step"
_TAKES_VERDICT = "optax_accum_takes_verdict"


def transformation(
    init: Callable, step: Step, *, takes_verdict: bool = False
) -> optax.GradientTransformationExtraArgs:
    """The optax transformation whose `update` is `step` with the default `Call()`.

    `takes_verdict` says that `step` honours `Call.verdict` (the accumulators do).
    """

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        result = step(updates, state, params, Call(), **extra_args)
        return result.made(), result.state

    setattr(update, _STEP, step)
    setattr(update, _TAKES_VERDICT, takes_verdict)
    return optax.GradientTransformationExtraArgs(init, update)


def step_of(tx: Any) -> Step | None:
    """The `step` of a transform built with `transformation`, else None."""
    return getattr(getattr(tx, "update", None), _STEP, None)


def takes_verdict(tx: Any) -> bool:
    """Whether `tx`'s step honours a wrapper's verdict (`Call.verdict`)."""
    return getattr(getattr(tx, "update", None), _TAKES_VERDICT, False)


def call_inner(
    inner: Any, updates: Any, state: Any, params: Any, call: Call, **extra_args: Any
) -> Result:
    """`inner`'s update as the caller asks: its `step` when it has one (the extra
    arguments marked checked), else its `update` with the extra arguments it takes
    (`_extra_args.taken_by`); such an inner gets no verdict (the caller branches)."""
    if call.verdict is not None and not takes_verdict(inner):
        raise TypeError("optax_accum: a verdict can only be passed to a step that takes one")
    step = step_of(inner)
    if step is not None:
        return step(updates, state, params, call._replace(checked=True), **extra_args)
    taken = _extra_args.taken_by(inner, extra_args)
    new_updates, new_state = inner.update(updates, state, params, **taken)
    return Result(new_updates, new_state, read_weight=None if "weight" in taken else False)


__all__ = [
    "Call",
    "Result",
    "Selection",
    "call_inner",
    "result_of",
    "step_of",
    "takes_verdict",
    "transformation",
    "watch_weight",
]
