"""What the dense and sparse handles of `optax_accum.ray` share: creating or finding
the accumulator's actor, calls that raise the in-process errors, takes that wait with
a lease, the counters and attributes."""

from __future__ import annotations

import functools
import os
import time
import uuid
import warnings
from typing import Any

import jax
import ray

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


class RayAccumulator:
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
            _payload.to_host(timeout),
            _payload.to_host(grace_period),
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


def _rebuild(cls: type, actor: Any, spec: Spec, name: str) -> RayAccumulator:
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
