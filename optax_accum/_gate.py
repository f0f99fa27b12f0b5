"""Whether an accumulator takes a gradient: fresh, finite, kept by the rules, passed.

`judged` is the accumulators' gate: why a gradient is taken, or counted as stale,
non-finite or skipped. A wrapper's verdict (`_protocol.Call.verdict`: whether
`drop_stale_gradients` accepts the gradient) joins it, so that a wrapper around an
accumulator need not branch around it: a gradient the verdict drops counts nowhere.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from optax_accum import _sums


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
