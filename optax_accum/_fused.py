"""The fused train step: updates applied inside the branch that releases them.

`fused_step(tx, grads, opt_state, params)` is `tx.update` then `apply_updates`. When
`tx` is an optax_accum transform, its step is asked to apply its updates to `params`
inside its release branch (`_protocol.Call(apply=True)`) and gives back the new params
(`_protocol.Result.params`), so a step that releases nothing never reads or writes them.
Any other `tx` (an `optax.chain` around an optax_accum transform too) runs the canonical
step, which gives the same values.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_accum import _checks, _protocol
from optax_accum.indexed_slices import apply_updates


def fused_step(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState, optax.Updates]:
    """`tx.update` then `apply_updates`, fused; returns `(params, opt_state, updates)`."""
    tx = _checks.require_transformation("tx", tx)
    step = _protocol.step_of(tx)
    if step is None:  # as the canonical step: a `tx` that cannot take extra arguments raises
        updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
        return apply_updates(params, updates), opt_state, updates
    result = step(grads, opt_state, params, _protocol.Call(apply=True), **extra_args)
    updates = result.made()
    if result.params is None:  # the step did not apply them in a branch
        return apply_updates(params, updates), result.state, updates
    return result.params, result.state, updates
