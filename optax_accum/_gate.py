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

`judged` is the accumulators' own gate, the verdict included: why a gradient is taken,
or counted as stale, non-finite or skipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from optax_accum import _sums

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


class Judged(NamedTuple):
    """What becomes of one offered gradient. With a wrapper's verdict that drops it,
    every flag is False: the gradient counts nowhere."""

    offered: jax.Array  # fresh, finite, kept by the rules and passed: to be summed
    stale: jax.Array
    nonfinite: jax.Array  # fresh, but holds a NaN or Inf (`skip_nonfinite`)
    skipped: jax.Array  # fresh and finite, but skipped by a rule or a bad weight
    verdict: jax.Array | None

    def passed(self, flag: jax.Array) -> jax.Array:
        """`flag`, and False where the wrapper's verdict dropped the gradient."""
        return flag if self.verdict is None else flag & self.verdict

    def emitted(self, emit: jax.Array, before: jax.Array) -> jax.Array:
        """The state's `emitted` after this update: as it was when the verdict
        dropped the gradient (the update did not happen, for the wrapper)."""
        return emit if self.verdict is None else _sums.select(self.verdict, emit, before)


def judged(
    verdict: jax.Array | None,
    *,
    fresh: jax.Array,
    finite: jax.Array,
    weight_ok: jax.Array,
    rule: jax.Array | None,
) -> Judged:
    """The accumulators' gate: a gradient is summed iff it is `fresh`, `finite`, has a
    good weight, is not skipped by the `rule` (None: no rule) and is passed by the
    `verdict` (from `take()`; None: no wrapper's verdict)."""
    kept = weight_ok if rule is None else weight_ok & ~rule
    flags = (fresh & finite & kept, ~fresh, fresh & ~finite, fresh & finite & ~kept)
    if verdict is not None:
        flags = tuple(flag & verdict for flag in flags)
    return Judged(*flags, verdict)
