"""One XLA compile per program: setups that lower to the same program share it."""

from __future__ import annotations

from typing import Any

import jax

# Compiled executables by program: (StableHLO text, input tree, output tree).
_PROGRAMS: dict[tuple, Any] = {}


def compiled_once(fn: Any, *args: Any) -> Any:
    """`jax.jit(fn)` compiled for `args`. Tracing and lowering are cheap, XLA's compile
    is not: calls whose programs lower to the same text (and trees) share one compile,
    so setups that differ only where the code never looks run one executable."""
    lowered = jax.jit(fn).lower(*args)
    program = (lowered.as_text(), lowered.in_tree, lowered.out_tree)
    if program not in _PROGRAMS:
        _PROGRAMS[program] = lowered.compile()
    return _PROGRAMS[program]
