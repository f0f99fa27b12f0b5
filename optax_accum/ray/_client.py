"""The public objects of `optax_accum.ray`: handles on an accumulator that lives in a
(named) Ray actor, with the in-process classes' constructors and methods."""

from __future__ import annotations

import functools
import os
import time
import uuid
import warnings
from typing import Any

import jax
import ray

from optax_accum.host import ConditionalAccumulator as _InProcessDense
from optax_accum.host import SparseConditionalAccumulator as _InProcessSparse
from optax_accum.indexed_slices import IndexedSlices
from optax_accum.ray import _payload
from optax_accum.ray._actor import AccumulatorActor, Spec
from optax_accum.ray._callers import RENEW_EVERY, Caller

_TAKE_THREADS = 64  # blocked takes the actor can hold at once
_CALL_THREADS = 16  # applies and queries running at once (they serialize on one lock)
# A blocked call that gets no answer this long after its own timeout (and grace) has
# passed reports the actor unreachable.
_ANSWER_SLACK = 30.0


class AccumulatorUnavailableError(RuntimeError):
    """The accumulator's Ray actor died or cannot be reached.

    Raised by every call, blocked or later, once Ray reports the actor dead (or
    restarting), and by a take that gets no answer well past its timeout. With
    `max_restarts` and a `checkpoint_dir`, a restarted actor answers again.
    """


@functools.cache
def _actor_class() -> Any:
    return ray.remote(concurrency_groups={"takes": _TAKE_THREADS})(AccumulatorActor)


def _check_options(
    shared_name: Any, namespace: Any, checkpoint_dir: Any, max_restarts: Any, lifetime: Any
) -> None:
    for arg, value in (("shared_name", shared_name), ("namespace", namespace)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{arg} must be None or a str, got {value!r}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, str | os.PathLike):
        raise TypeError(f"checkpoint_dir must be None or a path, got {checkpoint_dir!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1 (-1: forever), got {max_restarts!r}")
    if lifetime not in (None, "detached"):
        raise ValueError(f'lifetime must be None or "detached", got {lifetime!r}')


class _RayAccumulator:
    """What the dense and sparse handles share: the actor, takes, steps, counters."""

    _kind: str
    _in_process: type

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str,
        reduction_type: str,
        skip_nonfinite: bool,
        namespace: str | None,
        checkpoint_dir: str | os.PathLike | None,
        max_restarts: int,
        lifetime: str | None,
    ) -> None:
        # The in-process constructor checks every argument, with its errors.
        local = self._in_process(
            dtype, shape, None, name, reduction_type, skip_nonfinite=skip_nonfinite
        )
        _check_options(shared_name, namespace, checkpoint_dir, max_restarts, lifetime)
        spec = Spec(self._kind, local.dtype.name, local.shape, local.reduction_type, skip_nonfinite)
        options: dict[str, Any] = {
            "max_concurrency": _CALL_THREADS,
            "max_restarts": max_restarts,
            "num_cpus": 0,
            "lifetime": lifetime,
        }
        if shared_name:
            options.update(name=shared_name, namespace=namespace, get_if_exists=True)
        directory = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self._actor = _actor_class().options(**options).remote(spec, directory)
        theirs = self._call("spec")
        if theirs != spec:
            raise ValueError(
                f"shared_name {shared_name!r} is already used by a {theirs.describe()}; "
                f"got a {spec.describe()}"
            )
        self._spec = spec
        self._name = name

    def __reduce__(self) -> tuple:
        """Pickles as a handle on the same actor (to pass to Ray tasks and actors)."""
        return (_rebuild, (type(self), self._actor, self._spec, self._name))

    # ------------------------------------------------------------------ calls

    def _get(self, ref: ray.ObjectRef, timeout: float | None = None) -> Any:
        try:
            outcome = ray.get(ref, timeout=timeout)
        except ray.exceptions.RayActorError as error:
            raise AccumulatorUnavailableError(
                f"the Ray actor holding {self!r} died or is unreachable: {error}"
            ) from error
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def _call(self, method: str, *args: Any) -> Any:
        return self._get(getattr(self._actor, method).remote(*args))

    def _apply(self, method: str, local_step: Any, weight: Any, *payload: Any) -> bool:
        payload = tuple(_payload.send(p) for p in payload)
        return self._call(
            "apply", method, _payload.to_host(local_step), _payload.to_host(weight), *payload
        )

    def _take(self, num_required: Any, timeout: Any, grace_period: Any) -> Any:
        """Queues a take in the actor and waits for it, renewing its lease; an
        interrupted wait withdraws it."""
        ticket = uuid.uuid4().hex
        ref = self._actor.take.options(concurrency_group="takes").remote(
            ticket,
            _payload.to_host(num_required),
            timeout,
            grace_period,
            Caller.this_process(),
        )
        limit = _answer_limit(timeout, grace_period)
        try:
            while True:
                try:
                    return self._get(ref, timeout=RENEW_EVERY)
                except ray.exceptions.GetTimeoutError:
                    if limit is not None and time.monotonic() > limit:
                        raise AccumulatorUnavailableError(
                            f"the Ray actor holding {self!r} did not answer a take within "
                            f"{_ANSWER_SLACK} s of its timeout"
                        ) from None
                    self._actor.renew.remote(ticket)
        except BaseException as error:
            if not isinstance(error, AccumulatorUnavailableError):
                self._actor.withdraw.remote(ticket)
            raise

    # ------------------------------------------------------------------ attributes

    @property
    def dtype(self) -> Any:
        """The dtype of the gradients accumulated (and of the taken aggregates)."""
        return jax.numpy.dtype(self._spec.dtype)

    @property
    def shape(self) -> tuple | None:
        """The accumulator's shape: a tuple with None for unknown dims, or None."""
        return self._spec.shape

    @property
    def name(self) -> str:
        """The name given at construction."""
        return self._name

    @property
    def reduction_type(self) -> str:
        """ "MEAN" or "SUM"."""
        return self._spec.reduction_type

    @property
    def accumulator_ref(self) -> Any:
        """The Ray actor handle of the accumulator, shared by every object built with
        this `shared_name` (and namespace)."""
        return self._actor

    @property
    def global_step(self) -> int:
        """The accumulator's global step."""
        return self._call("counters")["global_step"]

    @property
    def num_dropped(self) -> int:
        """Stale gradients dropped so far."""
        return self._call("counters")["num_dropped"]

    @property
    def num_nonfinite(self) -> int:
        """Gradients skipped for holding NaN or Inf (only with `skip_nonfinite=True`)."""
        return self._call("counters")["num_nonfinite"]

    def num_accumulated(self) -> int:
        """The number of gradients accepted since the last take."""
        return self._call("counters")["num_accumulated"]

    def num_waiting_takes(self) -> int:
        """How many takes are blocked in the actor right now, from every process."""
        return self._call("counters")["num_waiting_takes"]

    def set_global_step(self, new_global_step: int) -> None:
        """Sets the global step; a lower value is allowed and warns, as in TF.

        Raises:
          TypeError: if `new_global_step` is not an int.
        """
        if self._call("set_global_step", _payload.to_host(new_global_step)):
            warnings.warn(
                f"set_global_step({new_global_step}) lowered the accumulator's global step",
                stacklevel=2,
            )

    def cancel_waiting_takes(self) -> int:
        """Cancels every waiting take, in every process: each raises
        `concurrent.futures.CancelledError` and consumes nothing.

        Returns:
          The number of takes cancelled.
        """
        return self._call("cancel_waiting_takes")

    def kill(self) -> None:
        """Ends the actor (and the accumulator, for every process sharing it)."""
        ray.kill(self._actor, no_restart=True)

    def __repr__(self) -> str:
        shape = "unknown" if self.shape is None else self.shape
        return (
            f"optax_accum.ray.{type(self).__name__}(dtype={self._spec.dtype}, shape={shape}, "
            f"name={self.name!r}, reduction_type={self.reduction_type!r})"
        )


def _rebuild(cls: type, actor: Any, spec: Spec, name: str) -> _RayAccumulator:
    handle = object.__new__(cls)
    handle._actor, handle._spec, handle._name = actor, spec, name
    return handle


def _answer_limit(timeout: Any, grace_period: Any) -> float | None:
    """When a waiting take gives up on the actor (None: never; the actor checks the
    arguments, so odd ones give no limit here)."""
    if not isinstance(timeout, int | float) or timeout == float("inf"):
        return None
    grace = grace_period if isinstance(grace_period, int | float) else 0.0
    return time.monotonic() + max(timeout, 0) + max(grace, 0) + _ANSWER_SLACK


class ConditionalAccumulator(_RayAccumulator):
    """TF's `ConditionalAccumulator`, shared by the processes of a Ray cluster.

    The accumulator lives in a Ray actor that holds an in-process
    `optax_accum.ConditionalAccumulator`; this object is a handle on it. Every
    handle built with the same `shared_name` (in the same Ray namespace), in any
    process of the cluster, reaches the same accumulator: the first creates the
    actor, the others find it; a different dtype, shape, reduction or
    `skip_nonfinite` under that name is a ValueError. Handles also pickle, so they
    can be passed to Ray tasks and actors.

    The rules are the in-process object's: a gradient is accepted iff
    `local_step >= global_step`; takes queue first come, first served, across
    processes; a take completes inside the apply that brings its count; every
    accepted gradient is taken exactly once; a take that times out, is cancelled, or
    whose caller died or was interrupted consumes nothing. Gradients travel as host
    NumPy (a `jax.Array` is copied to the host once; large arrays go through Ray's
    object store by reference); `take_grad` returns a `jax.Array` on the caller's
    default device, as the in-process object does. Bad gradients and steps are
    rejected inside the actor before they touch the sum, with the in-process
    object's TypeError or ValueError, raised in the caller as it is.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the gradients' shape; None dims (or -1) are unknown, and `shape=None`
        means any shape.
      shared_name: if non-empty, the name of the Ray actor that holds the
        accumulator, shared by every handle built with it; otherwise a new,
        unnamed actor.
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
      TypeError / ValueError: for a bad argument, naming it; ValueError when
        `shared_name` is in use by an accumulator of another kind, dtype, shape,
        reduction or `skip_nonfinite`.

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
    """

    _kind = "dense"
    _in_process = _InProcessDense

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

    def apply_grad(self, grad: Any, local_step: int = 0, *, weight: Any = None) -> bool:
        """Offers a gradient computed at `local_step`; returns whether it was accepted.

        As the in-process `apply_grad`: a stale gradient is dropped (False), and the
        apply that brings the oldest waiting take's count completes it.

        Args:
          grad: a NumPy or JAX array of the accumulator's dtype (or Python numbers);
            sent as host NumPy, never kept.
          local_step: the global step the gradient was computed at.
          weight: the gradient's weight in a weighted mean (for example the tokens
            it saw), as the in-process `apply_grad` takes it; None weighs 1.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError / ValueError: as the in-process `apply_grad`; nothing changes.
          AccumulatorUnavailableError: if the actor died.
        """
        return self._apply("apply_grad", local_step, weight, grad)

    def take_grad(
        self, num_required: int, timeout: float | None = None, *, grace_period: float | None = None
    ) -> jax.Array:
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
          A `jax.Array` of the accumulator's dtype.

        Raises:
          ValueError / TypeError: for a bad argument (no change).
          TimeoutError: when `timeout` passed first; nothing was taken.
          concurrent.futures.CancelledError: if `cancel_waiting_takes` was called.
          AccumulatorUnavailableError: if the actor died, or never answered.
        """
        return _payload.from_host(self._take(num_required, timeout, grace_period))


class SparseConditionalAccumulator(_RayAccumulator):
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
    _in_process = _InProcessSparse

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
