"""A Flax linen `TrainState` whose `apply_gradients` forwards extra args to the optimizer.

`flax.training.train_state.TrainState.apply_gradients` calls `tx.update(grads,
opt_state, params)` and nothing more, so the step tag `local_step` (or any other extra
argument of an `optax.GradientTransformationExtraArgs`) cannot reach an optax_accum
transform. `TrainState` is a drop-in subclass that forwards them. Flax NNX needs no
such help: `nnx.Optimizer.update(model, grads, **kwargs)` already forwards them.
"""

from __future__ import annotations

from typing import Any

from flax.training import train_state

from optax_accum.indexed_slices import apply_updates


class TrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` that forwards extra args to `tx.update`.

    Use it exactly like Flax's `TrainState`; the difference is in `apply_gradients`:
    a keyword argument that names one of the state's fields replaces that field (as in
    Flax), and every other keyword argument, such as `local_step`, is passed to
    `tx.update`. Updates are applied with `optax_accum.apply_updates`, so row-sparse
    `IndexedSlices` updates (from `sparse_conditional_accumulator`) work too. Flax's
    own class passes no extra arguments, so an optax_accum transform inside it would
    treat every gradient as up to date.

    `step` counts `apply_gradients` calls (offered gradients). The number of updates
    the optimizer actually released is `optax_accum.global_step(state.opt_state)`,
    TF's global step. There is no TF original: in TF1 the session ran
    `apply_gradients` ops directly.

    Attributes:
      step: int, the number of `apply_gradients` calls so far.
      apply_fn: usually the model's `apply` (not a pytree node).
      params: the parameters `tx` updates.
      tx: the optimizer, typically an optax_accum transform (not a pytree node).
      opt_state: the state of `tx`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> import flax.linen as nn
      >>> model = nn.Dense(1)
      >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), num_required=2)
      >>> state = optax_accum.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> state = state.apply_gradients(grads=grads, local_step=0)
      >>> state = state.apply_gradients(grads=grads, local_step=-1)  # stale: dropped
      >>> state = state.apply_gradients(grads=grads, local_step=0)  # releases
      >>> int(state.step), int(optax_accum.global_step(state.opt_state))
      (3, 1)
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Applies `grads` with `tx`, forwarding extra args; returns the new state.

        Args:
          grads: gradients with the structure of `params` (as in Flax, a
            `{"params": ..., "_overwrite_with_gradient": ...}` split is honoured).
          **kwargs: keywords naming a field of this state replace that field; all
            others (e.g. `local_step`) are passed to `tx.update`.

        Returns:
          A new state with `step` incremented, `params` and `opt_state` updated, and
          the named fields replaced.

        Example:
          >>> import jax.numpy as jnp, optax, optax_accum
          >>> tx = optax_accum.conditional_accumulator(optax.sgd(1.0), num_required=1)
          >>> state = optax_accum.TrainState.create(
          ...     apply_fn=None, params=jnp.zeros(2), tx=tx)
          >>> state = state.apply_gradients(grads=jnp.ones(2), local_step=0)
          >>> state.params
          Array([-1., -1.], dtype=float32)
        """
        fields = set(self.__dataclass_fields__)
        replace = {k: v for k, v in kwargs.items() if k in fields}
        extra_args = {k: v for k, v in kwargs.items() if k not in fields}
        split = isinstance(grads, dict) and train_state.OVERWRITE_WITH_GRADIENT in grads
        params = self.params["params"] if split else self.params
        updates, opt_state = self.tx.update(
            grads["params"] if split else grads, self.opt_state, params, **extra_args
        )
        new_params = apply_updates(params, updates)
        if split:
            new_params = {
                "params": new_params,
                train_state.OVERWRITE_WITH_GRADIENT: grads[train_state.OVERWRITE_WITH_GRADIENT],
            }
        return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **replace)


__all__ = ["TrainState"]
