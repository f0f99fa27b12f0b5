"""`optax_accum.ray.SparseConditionalAccumulator`: the sparse host accumulator in a
Ray actor."""

from __future__ import annotations

import os
from typing import Any

import jax

from optax_accum.host import SparseConditionalAccumulator as _InProcess
from optax_accum.indexed_slices import IndexedSlices
from optax_accum.ray import _payload
from optax_accum.ray._handle import RayAccumulator


class SparseConditionalAccumulator(RayAccumulator):
    """TF's `SparseConditionalAccumulator`, shared by the processes of a Ray cluster.

    The sparse sibling of `optax_accum.ray.ConditionalAccumulator` (same actor,
    sharing, queue and payload rules), holding an in-process
    `optax_accum.SparseConditionalAccumulator`: its checks, row-wise MEAN and
    answers (sorted unique indices) are that object's.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the dense shape of the gradients; None dims (or -1) are unknown.
      shared_name: as for `optax_accum.ray.ConditionalAccumulator`.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: as for the in-process object.
      namespace: the Ray namespace of the `shared_name` (None: the job's namespace,
        which only the job's own tasks and actors share; name one to share across
        drivers).
      checkpoint_dir: if set, a directory (on the actor's machine) where the actor
        keeps its global step and the gradients accepted since the last take, each
        written atomically before the call that changed it returns; an actor
        restarted by Ray (`max_restarts`) resumes from it. Costs a file write per
        accepted gradient.
      max_restarts: how many times Ray restarts the actor if its process dies (-1:
        forever). Calls in flight when it dies raise `AccumulatorUnavailableError`.
      lifetime: None (the actor ends with the process that created it) or
        "detached" (it outlives it, until `kill()` or the cluster ends).
    Raises:
      TypeError / ValueError: as for `optax_accum.ray.ConditionalAccumulator`.

    Example:
      >>> import numpy as np, ray, optax_accum.ray
      >>> _ = ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
      >>> acc = optax_accum.ray.SparseConditionalAccumulator(np.float32, shape=(4, 2))
      >>> acc.apply_grad([0, 1], np.array([[1, 0], [0, 2]], np.float32))
      True
      >>> acc.apply_grad([2, 0], np.array([[3, 0], [0, 1]], np.float32))
      True
      >>> indices, values, shape = acc.take_grad(2, timeout=60.0)
      >>> indices.tolist(), values.tolist(), shape
      ([0, 1, 2], [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]], (4, 2))
    """

    _kind = "sparse"
    _in_process = _InProcess

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        skip_nonfinite: bool = False,
        namespace: str | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        max_restarts: int = 0,
        lifetime: str | None = None,
    ) -> None:
        super().__init__(
            dtype,
            shape,
            shared_name,
            name,
            reduction_type,
            skip_nonfinite,
            namespace,
            checkpoint_dir,
            max_restarts,
            lifetime,
        )

    def apply_grad(
        self,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Any = None,
        local_step: int = 0,
        *,
        weight: Any = None,
    ) -> bool:
        """Offers a sparse gradient computed at `local_step`; returns whether accepted.

        Checked in the actor as the in-process `apply_grad` checks it.

        Args:
          grad_indices: an integer vector of row ids (NumPy, JAX or a list).
          grad_values: `[len(grad_indices), ...]` rows of the accumulator's dtype.
          grad_shape: the gradient's dense shape, or None.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError / ValueError: as the in-process `apply_grad`; nothing changes.
          AccumulatorUnavailableError: if the actor died.
        """
        return self._apply(
            "apply_grad",
            local_step,
            weight,
            grad_indices,
            grad_values,
            _payload.to_host(grad_shape),
        )

    def apply_indexed_slices_grad(
        self, grad: IndexedSlices, local_step: int = 0, *, weight: Any = None
    ) -> bool:
        """`apply_grad` for an `IndexedSlices` gradient (padding rows left out).

        Args:
          grad: the gradient.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError: if `grad` is not an `IndexedSlices`; otherwise as `apply_grad`.
        """
        if not isinstance(grad, IndexedSlices):
            raise TypeError(f"grad must be an optax_accum.IndexedSlices, got {type(grad).__name__}")
        return self._apply(
            "apply_indexed_slices_grad",
            local_step,
            weight,
            grad.indices,
            grad.values,
            grad.dense_shape,
        )

    def take_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        """Blocks until `num_required` gradients are in; returns their aggregate rows.

        Args:
          num_required: a positive int, or a 0-d integer array.
          timeout: seconds to wait for the `num_required` gradients at most.
          grace_period: as for `optax_accum.ray.ConditionalAccumulator.take_grad`.

        Returns:
          `(indices, values, shape)` as the in-process `take_grad` returns them.

        Raises:
          As `optax_accum.ray.ConditionalAccumulator.take_grad`.
        """
        indices, values, shape = self._take(num_required, timeout, grace_period)
        return _payload.from_host(indices), _payload.from_host(values), shape

    def take_indexed_slices_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> IndexedSlices:
        """`take_grad`, returning an `IndexedSlices`.

        Args:
          num_required: a positive int, or a 0-d integer array.
          timeout: seconds to wait for the `num_required` gradients at most.
          grace_period: as for `take_grad`.

        Returns:
          `IndexedSlices(indices, values, shape)` as `take_grad` returns them.

        Raises:
          As `take_grad`.
        """
        return IndexedSlices(*self.take_grad(num_required, timeout, grace_period=grace_period))
