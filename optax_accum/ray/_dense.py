"""`optax_accum.ray.ConditionalAccumulator`: the dense host accumulator in a Ray actor."""

from __future__ import annotations

import os
from typing import Any

from optax_accum.ray import _payload
from optax_accum.ray._handle import RayAccumulator


class ConditionalAccumulator(RayAccumulator):
    """TF's `ConditionalAccumulator`, shared by the processes of a Ray cluster.

    The accumulator lives in a Ray actor; this object is a handle on it. Every
    handle built with the same `shared_name` (in the same Ray namespace), in any
    process of the cluster, reaches the same accumulator: the first creates the
    actor, the others find it; a different dtype, shape, reduction or
    `skip_nonfinite` under that name is a ValueError, and so are options
    (`checkpoint_dir`, `max_restarts`, `lifetime`) other than the live actor's.
    Handles also pickle, so they can be passed to Ray tasks and actors.

    Who owns it: a named accumulator is a detached actor, owned by no process: it
    lives until `kill()` (from any handle) or the cluster's end, so dropping any
    handle, or killing any worker or the chief, loses no accepted gradient and not
    the global step. Create it from the driver (or any process), and `kill()` it
    when the job is done. An unnamed accumulator belongs to the process that built
    it and ends with it.

    The rules are the in-process object's, and so are its checks, take queue and
    arithmetic (NumPy in the actor, which imports no JAX): a gradient is accepted
    iff `local_step >= global_step`; takes queue first come, first served, across
    processes; a take completes inside the apply that brings its count; every
    accepted gradient is taken exactly once; a take that times out, is cancelled, or
    whose caller died or was interrupted consumes nothing. Every apply carries an
    identity (the handle in its thread, and a number), so an apply repeated after an
    ambiguous failure, by the handle or by Ray, counts once. Gradients travel as
    host NumPy (a `jax.Array` is copied to the host once; large arrays go through
    Ray's object store by reference); `take_grad` returns a `jax.Array` on the
    caller's default device, as the in-process object does.

    One actor can hold a model's whole gradient: give `dtype` as a tree of arrays or
    `jax.ShapeDtypeStruct`s (the params, or `jax.eval_shape` of them), or as a tree
    of dtypes with `shape` a matching tree of shapes (or one dtype and a tree of
    shapes). Gradients are then trees of that structure, counted once each, and a
    take returns the whole tree, atomically.

    Args:
      dtype: float16, bfloat16, float32 or float64; or a tree (see above).
      shape: the gradients' shape; None dims (or -1) are unknown, and `shape=None`
        means any shape; or a tree of shapes.
      shared_name: if non-empty, the name of the Ray actor that holds the
        accumulator, shared by every handle built with it; otherwise a new,
        unnamed actor.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: as for the in-process object.
      namespace: the Ray namespace of the `shared_name` (None: "optax_accum", shared
        by every job of the cluster). A handle that would start a new accumulator
        where another namespace holds one of that name warns.
      checkpoint_dir: if set, a directory (on the actor's machine) of this
        accumulator alone, where the actor logs its global step and the gradients
        accepted since the last take, each written atomically before the call that
        changed it returns; an actor restarted by Ray (`max_restarts`) resumes from
        it. Costs a file write per accepted gradient. None: the live actor's, or none.
      max_restarts: how many times Ray restarts the actor if its process dies (-1:
        forever; needs a `checkpoint_dir`). Calls in flight wait for the restarted
        actor, which answers each once. None: the live actor's, or 0.
      lifetime: "detached" (the default with a `shared_name`: until `kill()`) or
        "non_detached" (the default without: it ends with the process that created
        it). None: the live actor's, or the default.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; ValueError when
        `shared_name` is in use by an accumulator of another kind, dtype, shape,
        reduction or `skip_nonfinite`, or created with other options, and when the
        `checkpoint_dir` is in use by another accumulator or holds another's
        checkpoint; OSError when the `checkpoint_dir` cannot be used.

    Example:
      >>> import numpy as np, ray, optax_accum.ray
      >>> _ = ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
      >>> acc = optax_accum.ray.ConditionalAccumulator(np.float32, shape=(2,))
      >>> @ray.remote
      ... def worker(acc, x):  # another process
      ...     return acc.apply_grad(np.full(2, x, np.float32), local_step=0)
      >>> ray.get([worker.remote(acc, x) for x in (1.0, 2.0, 6.0)])
      [True, True, True]
      >>> acc.take_grad(3, timeout=60.0)
      Array([3., 3.], dtype=float32)
      >>> acc.apply_grad(np.ones(2, np.float32), local_step=0)  # stale now: dropped
      False
      >>> acc.global_step, acc.num_accumulated()
      (1, 0)
      >>> acc.kill()
    """

    _kind = "dense"

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
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

    def apply_grad(self, grad: Any, local_step: int = 0, *, weight: Any = None) -> bool:
        """Offers a gradient computed at `local_step`; returns whether it was accepted.

        As the in-process `apply_grad`: a stale gradient is dropped (False), and the
        apply that brings the oldest waiting take's count completes it. Safe to call
        again after an ambiguous failure (`AccumulatorUnavailableError` while the
        actor restarts): it counts once.

        Args:
          grad: a NumPy or JAX array of the accumulator's dtype (or Python numbers),
            or a tree of them of the accumulator's structure; sent as host NumPy,
            never kept.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean (for example the tokens
            it saw), as the in-process `apply_grad` takes it; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError / ValueError: as the in-process `apply_grad`; nothing changes.
          OSError: if the checkpoint could not be written; nothing was counted.
          AccumulatorUnavailableError: if the actor died.
        """
        leaves = _payload.leaves_of(self._treedef, grad, "grad")
        return self._apply(local_step, weight, [_payload.send(x) for x in leaves])

    def take_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> Any:
        """Blocks until `num_required` gradients are in, then returns their aggregate.

        Takes from every process are served in the order they reached the actor.

        Args:
          num_required: a positive int, or a 0-d integer array.
          timeout: seconds to wait for the `num_required` gradients at most; None or
            `float("inf")` waits forever.
          grace_period: once `num_required` gradients are in, wait this many seconds
            more and take every gradient that arrived by then (a quorum and a grace
            window); None takes at once.

        Returns:
          A `jax.Array` of the accumulator's dtype, or a tree of them.

        Raises:
          ValueError / TypeError: for a bad argument (no change).
          TimeoutError: when `timeout` passed first, or when this caller, on another
            node, renewed no lease for 10 s (paused or cut off) when its gradients
            were ready; nothing was taken.
          concurrent.futures.CancelledError: if `cancel_waiting_takes` was called.
          AccumulatorUnavailableError: if the actor died, or never answered.
        """
        leaves = self._take(num_required, timeout, grace_period)
        return self._tree([_payload.from_host(x) for x in leaves])
