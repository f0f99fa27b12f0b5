"""The train step: `tx.update` and `apply_updates` in one call, fused.

`apply_gradients(tx, grads, opt_state, params)` gives what the canonical optax step
gives (`updates, opt_state = tx.update(grads, opt_state, params); params =
apply_updates(params, updates)`), but an optax_accum transform applies its updates
inside the branch that releases them, so a micro-step that releases nothing reads and
writes neither the parameters nor the inner optimizer's state.
"""

from __future__ import annotations

from typing import Any

import optax

from optax_accum import _fused


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One train step: `tx.update`, then the updates applied to `params`.

    The result is that of `updates, opt_state = tx.update(grads, opt_state, params,
    **extra_args)` followed by `optax_accum.apply_updates(params, updates)`, for any
    optax transformation (also `optax.chain` and `optax.inject_hyperparams` around
    optax_accum transforms, and row-sparse `IndexedSlices` updates). When the updates
    come straight from an optax_accum transform (`conditional_accumulator`,
    `sparse_conditional_accumulator`, `drop_stale_gradients`, last in a chain if
    chained), they are applied inside the branch that releases them: a step that
    releases nothing then costs about one pass that adds the gradient to the
    accumulator, and the parameters and the inner optimizer's state are not touched.
    There is no TF counterpart: in TF1 a session ran `apply_gradients` ops directly.

    Jit it with `params` and `opt_state` donated, and return them in that order:

        step = jax.jit(functools.partial(optax_accum.apply_gradients, tx),
                       donate_argnums=(1, 2))  # (grads, opt_state, params)

    Args:
      tx: the optimizer, typically an optax_accum transform.
      grads: the gradients, with the structure of `params`.
      opt_state: the state of `tx`.
      params: the parameters.
      **extra_args: passed to `tx.update`, e.g. `local_step`, as the canonical step
        passes them: through `optax.MultiSteps`, `optax.chain` and
        `optax.inject_hyperparams` to every optax_accum transform inside.

    Returns:
      The pair `(params, opt_state)` after the step.

    Raises:
      TypeError: when `tx` is not an optax transformation, or (as in the canonical
        step) when its `update` takes no extra arguments and some are given (e.g.
        `optax.lookahead`'s); otherwise what `tx.update` raises for bad gradients.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=2)
      >>> params = jnp.zeros(2)
      >>> opt_state = tx.init(params)
      >>> step = jax.jit(lambda g, s, p: optax_accum.apply_gradients(tx, g, s, p))
      >>> params, opt_state = step(jnp.array([1.0, 2.0]), opt_state, params)  # held
      >>> params, opt_state = step(jnp.array([3.0, 4.0]), opt_state, params)
      >>> params  # minus the mean of the two gradients
      Array([-2., -3.], dtype=float32)
    """
    new_params, opt_state, _ = _fused.fused_step(tx, grads, opt_state, params, **extra_args)
    return new_params, opt_state


__all__ = ["apply_gradients"]
