"""`optax_accum.ray.SparseConditionalAccumulator`: the sparse host accumulator in a
Ray actor."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from optax_accum.ray import _payload
from optax_accum.ray._handle import RayAccumulator


def _indexed_slices() -> type:
    from optax_accum.indexed_slices import IndexedSlices

    return IndexedSlices


class SparseConditionalAccumulator(RayAccumulator):
    """TF's `SparseConditionalAccumulator`, shared by the processes of a Ray cluster.

    The sparse sibling of `optax_accum.ray.ConditionalAccumulator` (same actor,
    ownership, sharing, identities, queue and payload rules): its checks, row-wise
    MEAN and answers (sorted unique indices) are the in-process
    `optax_accum.SparseConditionalAccumulator`'s. One actor can hold a tree of
    tables: `shape` a tree of table shapes (with one dtype, or a matching tree of
    dtypes), or `dtype` a tree of arrays or `jax.ShapeDtypeStruct`s; its gradients
    are then trees of `IndexedSlices` (or of indices and of values), and a take
    returns the whole tree.

    Args:
      dtype: float16, bfloat16, float32 or float64; or a tree (see above).
      shape: the dense shape of the gradients; None dims (or -1) are unknown; or a
        tree of them.
      shared_name: as for `optax_accum.ray.ConditionalAccumulator`.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: as for the in-process object.
      namespace: as for `optax_accum.ray.ConditionalAccumulator`.
      checkpoint_dir: as for `optax_accum.ray.ConditionalAccumulator`.
      max_restarts: as for `optax_accum.ray.ConditionalAccumulator`.
      lifetime: as for `optax_accum.ray.ConditionalAccumulator`.

    Raises:
      TypeError / ValueError / OSError: as for `optax_accum.ray.ConditionalAccumulator`.

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
      >>> acc.kill()
    """

    _kind = "sparse"

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
        max_restarts: int | None = None,
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

    def _apply_rows(self, local_step: Any, weight: Any, rows: list) -> bool:
        """Sends each leaf's `(indices, values, shape)`, in turn."""
        payload = []
        for indices, values, shape in rows:
            payload += [_payload.send(indices), _payload.send(values), _payload.to_host(shape)]
        return self._apply(local_step, weight, payload)

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

        Checked in the actor as the in-process `apply_grad` checks it; safe to call
        again after an ambiguous failure (it counts once).

        Args:
          grad_indices: an integer vector of row ids (NumPy, JAX or a list); for a
            tree of tables, a tree of them.
          grad_values: `[len(grad_indices), ...]` rows of the accumulator's dtype;
            for a tree, a tree of them.
          grad_shape: the gradient's dense shape, or None; for a tree, None or a
            tree of them.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError / ValueError: as the in-process `apply_grad`; nothing changes.
          OSError: if the checkpoint could not be written; nothing was counted.
          AccumulatorUnavailableError: if the actor died.
        """
        treedef = self._treedef
        indices = _payload.leaves_of(treedef, grad_indices, "grad_indices")
        values = _payload.leaves_of(treedef, grad_values, "grad_values")
        if grad_shape is None:
            shapes = [None] * len(indices)
        else:
            shapes = _payload.leaves_of(treedef, grad_shape, "grad_shape")
        return self._apply_rows(local_step, weight, list(zip(indices, values, shapes, strict=True)))

    def apply_indexed_slices_grad(
        self, grad: Any, local_step: int = 0, *, weight: Any = None
    ) -> bool:
        """`apply_grad` for an `IndexedSlices` gradient (padding rows left out), or a
        tree of them.

        Args:
          grad: the gradient.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError: if `grad` is not an `IndexedSlices`; otherwise as `apply_grad`.
        """
        cls = _indexed_slices()
        treedef = self._treedef
        leaves = [grad] if treedef is None else treedef.flatten_up_to(grad)
        rows = []
        for leaf in leaves:
            if not isinstance(leaf, cls):
                raise TypeError(
                    f"grad must be an optax_accum.IndexedSlices, got {type(leaf).__name__}"
                )
            indices, values = _payload.to_host(leaf.indices), _payload.to_host(leaf.values)
            if hasattr(indices, "shape") and len(indices.shape) == 1:
                keep = np.asarray(indices) != leaf.padding_index
                if not keep.all():
                    indices, values = np.asarray(indices)[keep], np.asarray(values)[keep]
            rows.append((indices, values, leaf.dense_shape))
        return self._apply_rows(local_step, weight, rows)

    def take_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> Any:
        """Blocks until `num_required` gradients are in; returns their aggregate rows.

        Args:
          num_required: a positive int, or a 0-d integer array.
          timeout: seconds to wait for the `num_required` gradients at most.
          grace_period: as for `optax_accum.ray.ConditionalAccumulator.take_grad`.

        Returns:
          `(indices, values, shape)` as the in-process `take_grad` returns them; for a
          tree of tables, a tree of them.

        Raises:
          As `optax_accum.ray.ConditionalAccumulator.take_grad`.
        """
        leaves = self._take(num_required, timeout, grace_period)
        return self._tree(
            [
                (_payload.from_host(indices), _payload.from_host(values), shape)
                for indices, values, shape in leaves
            ]
        )

    def take_indexed_slices_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> Any:
        """`take_grad`, returning an `IndexedSlices` (or a tree of them).

        Args:
          num_required: a positive int, or a 0-d integer array.
          timeout: seconds to wait for the `num_required` gradients at most.
          grace_period: as for `take_grad`.

        Returns:
          `IndexedSlices(indices, values, shape)` as `take_grad` returns them.

        Raises:
          As `take_grad`.
        """
        cls = _indexed_slices()
        leaves = self._take(num_required, timeout, grace_period)
        return self._tree(
            [
                cls(_payload.from_host(indices), _payload.from_host(values), shape)
                for indices, values, shape in leaves
            ]
        )
