"""A wrapper's verdict passed into the accumulator it wraps, instead of a branch.

`drop_stale_gradients(inner)` runs `inner` only on the updates it accepts, in a branch
(`_branch.update_if`). When `inner` is an optax_accum accumulator, that branch holds a
whole step of the accumulator, which adds its own branch inside: every level of a nest
costs XLA:CPU loop bookkeeping and compile time, for work the accumulator already
knows how to skip (it drops stale gradients itself). So the wrapper calls such an
`inner` directly, inside `passing(accept)`, and the accumulator takes the verdict with
`take()`: a gradient not accepted leaves its state as a drop of its own would, and a
release needs the verdict too. Nothing else sees it: `take()` clears it for whatever
the accumulator calls in turn.

The transforms that take a verdict mark their `update` with `takes_verdict`; a wrapper
asks `takes_verdict(inner)` before passing one (anything else wrapped around the
accumulator, an `optax.chain` say, hides the mark, and the wrapper branches as before).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

_MARK = "_optax_accum_takes_verdict"


@dataclasses.dataclass
class _Verdict:
    accept: jax.Array
    taken: bool = False


_VERDICT: contextvars.ContextVar[_Verdict | None] = contextvars.ContextVar("_VERDICT", default=None)


def marked(update: Callable) -> Callable:
    """`update`, marked as taking a verdict with `take()`."""
    setattr(update, _MARK, True)
    return update


def takes_verdict(tx: Any) -> bool:
    """Whether `tx.update` takes a wrapper's verdict (see the module docstring)."""
    return getattr(getattr(tx, "update", None), _MARK, False)


@contextlib.contextmanager
def passing(accept: jax.Array) -> Iterator[None]:
    """While active, the next `take()` returns `accept` (a bool scalar)."""
    verdict = _Verdict(accept)
    token = _VERDICT.set(verdict)
    try:
        yield
    finally:
        _VERDICT.reset(token)
    if not verdict.taken:
        raise RuntimeError("optax_accum: a verdict was passed to an update that did not take it")


def take() -> jax.Array | None:
    """The verdict passed to this update (None when there is none), cleared for the
    updates it calls in turn."""
    verdict = _VERDICT.get()
    if verdict is None:
        return None
    verdict.taken = True
    _VERDICT.set(None)
    return verdict.accept
