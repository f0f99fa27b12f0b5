"""Flax: a linen `TrainState` and an NNX `Optimizer` that step with `apply_gradients`.

`flax.training.train_state.TrainState.apply_gradients` calls `tx.update(grads,
opt_state, params)` and nothing more, so the step tag `local_step` (or any other extra
argument of an `optax.GradientTransformationExtraArgs`) cannot reach an optax_accum
transform, and it applies zero updates to every parameter on every held step.
`TrainState` is a drop-in subclass that forwards extra arguments and steps with
`optax_accum.apply_gradients`. `NNXOptimizer` does the same for `flax.nnx.Optimizer`.
Both pass the extra arguments to `tx.update` as the canonical optax step does: a `tx`
whose `update` cannot take them raises that step's TypeError.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.training import train_state

from optax_accum import _checks, _fused


class TrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` that forwards extra args to `tx.update`.

    Use it exactly like Flax's `TrainState`; the difference is in `apply_gradients`:
    a keyword argument that names one of the state's fields replaces that field (as in
    Flax), and every other keyword argument, such as `local_step`, is passed to
    `tx.update`. The step is `optax_accum.apply_gradients`: a held micro-step leaves
    the parameters and the inner optimizer's state untouched, and row-sparse
    `IndexedSlices` updates (from `sparse_conditional_accumulator`) work too. Flax's
    own class passes no extra arguments, so an optax_accum transform inside it would
    treat every gradient as up to date. Jit the train step with the state donated.

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
            others (e.g. `local_step`) are passed to `tx.update`, as the canonical
            step passes them (a `tx` whose `update` takes none raises TypeError).

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
        new_params, opt_state, _ = _fused.fused_step(
            self.tx, grads["params"] if split else grads, self.opt_state, params, **extra_args
        )
        if split:
            new_params = {
                "params": new_params,
                train_state.OVERWRITE_WITH_GRADIENT: grads[train_state.OVERWRITE_WITH_GRADIENT],
            }
        return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **replace)


class NNXOptimizer(nnx.Optimizer):
    """`flax.nnx.Optimizer` whose `update` steps with `optax_accum.apply_gradients`.

    Use it exactly like `nnx.Optimizer` (`NNXOptimizer(model, tx, wrt=nnx.Param)`,
    then `optimizer.update(model, grads, local_step=...)` inside `nnx.jit`). Extra
    keyword arguments reach `tx.update`, as in Flax; the difference is the step: a
    held micro-step of an optax_accum transform leaves the model's parameters and the
    inner optimizer's state untouched, where `nnx.Optimizer` adds zero updates to
    every parameter. `step` counts `update` calls; the number of released updates is
    `optax_accum.global_step(optimizer.opt_state)`. There is no TF original.
    NNX variables hold arrays, so row-sparse `IndexedSlices` gradients need the
    functional loop (`nnx.split`, then `optax_accum.apply_gradients`).

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> from flax import nnx
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> tx = optax_accum.conditional_accumulator(optax.sgd(0.1), num_required=2)
      >>> optimizer = optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)
      >>> loss = lambda m: (m(jnp.ones((1, 2))) ** 2).mean()
      >>> for local_step in (0, -1, 0):  # the middle gradient is stale: dropped
      ...     _ = optimizer.update(model, nnx.grad(loss)(model), local_step=local_step)
      >>> int(optimizer.step[...]), int(optax_accum.global_step(optimizer.opt_state))
      (3, 1)
    """

    def __init__(self, model: Any, tx: Any, **kwargs: Any) -> None:
        super().__init__(model, _checks.require_transformation("tx", tx), **kwargs)

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """Applies `grads` to `model` with `tx` (extra keywords go to `tx.update`).

        Returns:
          The updates `tx` returned (zeros on a held step).
        """
        graph = {"graph": self.graph} if hasattr(self, "graph") else {}
        params = nnx.as_pure(nnx.state(model, self.wrt, **graph))
        grads = nnx.as_pure(nnx.state(grads, self.wrt, **graph))
        new_params, opt_state, updates = _fused.fused_step(
            self.tx, grads, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
        )
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(opt_state, **graph))
        self.step[...] += 1
        return updates


__all__ = ["NNXOptimizer", "TrainState"]
