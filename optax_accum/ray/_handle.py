"""What the dense and sparse handles of `optax_accum.ray` share: finding or creating the
accumulator's actor, calls that carry an identity and raise the accumulator's errors,
takes that wait with a lease, the counters and attributes.

Who owns the actor: a named accumulator (`shared_name`) is a detached actor in the
namespace "optax_accum" (or the one given): no handle, worker or chief owns it, so
dropping a handle or killing any process loses nothing; it lives until a handle's
`kill()` (or the cluster's end). An unnamed one belongs to the process that built it,
and ends with it. A handle never starts a second accumulator under a name in use: it
finds the live one, and refuses it if it is of another kind, or was created with
other options than those the handle asks for.

Exactly once: each handle, in each thread, is a client with its own identity and
numbers its pushes; the actor counts each push once and answers a repeated push (and
a repeated take) with its first answer. So a handle may retry any call after an
ambiguous failure, and Ray may retry calls on a restarted actor.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
import warnings
from typing import Any

import numpy as np
import ray

from optax_accum.ray import _payload
from optax_accum.ray._actor import CONCURRENCY_GROUPS, AccumulatorActor
from optax_accum.ray._callers import RENEW_EVERY, Caller
from optax_accum.ray._spec import NAMESPACE, Options

# A blocked take that gets no answer this long after its own timeout (and grace) has
# passed reports the actor unreachable.
_ANSWER_SLACK = 30.0
# How long a call is repeated while Ray reports the actor temporarily unavailable.
_RETRY_FOR = 60.0
_KILL_WAIT = 10.0  # seconds `kill()` waits for Ray to report the actor dead
_LIFETIMES = (None, "detached", "non_detached")


class AccumulatorUnavailableError(RuntimeError):
    """The accumulator's Ray actor died or cannot be reached.

    Raised by every call, blocked or later, once Ray reports the actor dead (and not
    restarting), and by a take that gets no answer well past its timeout. With
    `max_restarts` and a `checkpoint_dir`, calls in flight wait for the restarted
    actor instead, which answers them once each.
    """


@functools.cache
def _actor_class() -> Any:
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(AccumulatorActor)


def _check_options(
    shared_name: Any, namespace: Any, checkpoint_dir: Any, max_restarts: Any, lifetime: Any
) -> None:
    for arg, value in (("shared_name", shared_name), ("namespace", namespace)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{arg} must be None or a str, got {value!r}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, str | os.PathLike):
        raise TypeError(f"checkpoint_dir must be None or a path, got {checkpoint_dir!r}")
    if max_restarts is not None and (
        isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1
    ):
        raise ValueError(f"max_restarts must be an int >= -1 (-1: forever), got {max_restarts!r}")
    if lifetime not in _LIFETIMES:
        raise ValueError(f'lifetime must be None, "detached" or "non_detached", got {lifetime!r}')


def _warn_elsewhere(shared_name: str, namespace: str) -> None:
    """Warns if no accumulator is named `shared_name` in `namespace` but one is in
    another namespace: the handle is about to start a second, empty one."""
    try:
        named = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # no list: nothing to warn about
        return
    others = sorted({a["namespace"] for a in named if a["name"] == shared_name} - {namespace})
    if others:
        warnings.warn(
            f"shared_name {shared_name!r} names no accumulator in namespace {namespace!r} but "
            f"names one in {others}: this handle starts a new, empty accumulator in "
            f"{namespace!r}. Pass namespace={others[0]!r} to reach the existing one.",
            stacklevel=5,
        )


class RayAccumulator:
    """What the dense and sparse handles share: the actor, takes, steps, counters."""

    _kind: str

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
        max_restarts: int | None,
        lifetime: str | None,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        spec, treedef = _payload.spec_of(self._kind, dtype, shape, reduction_type, skip_nonfinite)
        _check_options(shared_name, namespace, checkpoint_dir, max_restarts, lifetime)
        self._spec, self._treedef, self._name = spec, treedef, name
        self._local = threading.local()
        directory = None if checkpoint_dir is None else os.path.abspath(checkpoint_dir)
        asked = {"checkpoint_dir": directory, "max_restarts": max_restarts, "lifetime": lifetime}
        options = Options(
            shared_name or None,
            (namespace or NAMESPACE) if shared_name else None,
            directory,
            0 if max_restarts is None else max_restarts,
            lifetime or ("detached" if shared_name else "non_detached"),
        )
        self._actor = self._connect(options)
        theirs, their_options, _ = self._started()
        if theirs != spec:
            raise ValueError(
                f"shared_name {shared_name!r} is already used by a {theirs.describe()}; "
                f"got a {spec.describe()}"
            )
        differences = their_options.differences(asked)
        if differences:
            raise ValueError(
                f"shared_name {shared_name!r} is a live accumulator created with other "
                f"options than this handle asks for: {'; '.join(differences)}. Leave them "
                f"out (None) to use the live accumulator's, or kill() it first"
            )

    def _connect(self, options: Options) -> Any:
        """The live actor named `options.shared_name`, or a new one."""
        if options.shared_name:
            try:
                return ray.get_actor(options.shared_name, namespace=options.namespace)
            except ValueError:  # none by that name: create it (unless another just did)
                _warn_elsewhere(options.shared_name, options.namespace)
        if options.max_restarts != 0 and options.checkpoint_dir is None:
            raise ValueError(
                f"max_restarts={options.max_restarts} needs a checkpoint_dir: a restarted "
                f"actor without one starts empty, losing its global step and gradients"
            )
        if options.lifetime == "detached" and not options.shared_name:
            raise ValueError(
                'lifetime="detached" needs a shared_name: an unnamed detached accumulator '
                "could only be reached, and ended, through its handles"
            )
        ray_options: dict[str, Any] = {
            "max_restarts": options.max_restarts,
            "max_task_retries": -1 if options.max_restarts else 0,
            "num_cpus": 0,
            "lifetime": options.lifetime,
        }
        if options.shared_name:
            ray_options.update(
                name=options.shared_name, namespace=options.namespace, get_if_exists=True
            )
        return _actor_class().options(**ray_options).remote(self._spec, options)

    def _started(self) -> tuple:
        """The actor's spec, options and pid; an actor that could not start is ended
        and its error (for example about its checkpoint_dir) raised here."""
        try:
            return self._call("hello")
        except (ValueError, OSError):
            ray.kill(self._actor, no_restart=True)
            raise

    def __reduce__(self) -> tuple:
        """Pickles as a handle on the same actor (to pass to Ray tasks and actors)."""
        return (_rebuild, (type(self), self._actor, self._spec, self._treedef, self._name))

    # ------------------------------------------------------------------ calls

    def _identity(self) -> tuple[str, int]:
        """This thread's client id and the number of its next push."""
        local = self._local
        if not hasattr(local, "client"):
            local.client, local.seq = uuid.uuid4().hex, 0
        local.seq += 1
        return local.client, local.seq

    def _get(self, ref: ray.ObjectRef, timeout: float | None = None) -> Any:
        try:
            outcome = ray.get(ref, timeout=timeout)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            raise
        except ray.exceptions.RayActorError as error:
            raise AccumulatorUnavailableError(
                f"the Ray actor holding {self!r} died or is unreachable: {error}"
            ) from error
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def _call(self, method: str, *args: Any) -> Any:
        """Calls the actor's `method`, again (the same call) while Ray reports the actor
        temporarily unavailable: every call is safe to repeat."""
        deadline = time.monotonic() + _RETRY_FOR
        while True:
            try:
                return self._get(getattr(self._actor, method).remote(*args))
            except ray.exceptions.ActorUnavailableError as error:
                if time.monotonic() > deadline:
                    raise AccumulatorUnavailableError(
                        f"the Ray actor holding {self!r} was unavailable for {_RETRY_FOR} s"
                    ) from error
                time.sleep(RENEW_EVERY)

    def _apply(self, local_step: Any, weight: Any, payload: list) -> bool:
        client, seq = self._identity()
        step, weight = _payload.to_host(local_step), _payload.to_host(weight)
        return self._call("apply", client, seq, step, weight, *payload)

    def _take(self, num_required: Any, timeout: Any, grace_period: Any) -> Any:
        """Queues a take in the actor and waits for it, renewing its lease; an
        interrupted wait withdraws it."""
        client, seq = self._identity()
        ticket = uuid.uuid4().hex
        args = (
            client,
            seq,
            ticket,
            _payload.to_host(num_required),
            _payload.to_host(timeout),
            _payload.to_host(grace_period),
            Caller.this_process(),
        )
        ref = self._actor.take.remote(*args)
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
                except ray.exceptions.ActorUnavailableError:
                    time.sleep(RENEW_EVERY)
                    ref = self._actor.take.remote(*args)  # the same take: answered once
        except BaseException as error:
            if not isinstance(error, AccumulatorUnavailableError):
                self._actor.withdraw.remote(ticket)
            raise

    def _tree(self, leaves: list) -> Any:
        return leaves[0] if self._treedef is None else self._treedef.unflatten(leaves)

    # ------------------------------------------------------------------ attributes

    @property
    def dtype(self) -> Any:
        """The dtype of the gradients accumulated (a tree of them for a tree)."""
        return self._tree([np.dtype(leaf.dtype) for leaf in self._spec.leaves])

    @property
    def shape(self) -> Any:
        """The accumulator's shape: a tuple with None for unknown dims, or None (a tree
        of them for a tree)."""
        return self._tree([leaf.shape for leaf in self._spec.leaves])

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
        """How many takes are blocked in the actor right now, from every process (a
        take whose caller died is not counted)."""
        return self._call("counters")["num_waiting_takes"]

    def set_global_step(self, new_global_step: int) -> None:
        """Sets the global step; a lower value is allowed and warns, as in TF.

        Raises:
          TypeError: if `new_global_step` is not an int.
          OSError: if the checkpoint could not be written (nothing changed).
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
        """Ends the actor (and the accumulator, for every process sharing it), and waits
        (up to 10 s) until Ray reports it dead, so that its name and checkpoint_dir are
        free when this returns; the checkpoint stays on disk, for a new accumulator
        given the same directory."""
        ray.kill(self._actor, no_restart=True)
        deadline = time.monotonic() + _KILL_WAIT
        while time.monotonic() < deadline:
            try:
                ray.get(self._actor.pid.remote(), timeout=RENEW_EVERY)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:
                return
            time.sleep(0.02)

    def __repr__(self) -> str:
        if self._spec.tree is None:
            leaf = self._spec.leaves[0]
            what = f"dtype={leaf.dtype}, shape={'unknown' if leaf.shape is None else leaf.shape}"
        else:
            what = f"tree={self._spec.tree}"
        return (
            f"optax_accum.ray.{type(self).__name__}({what}, name={self.name!r}, "
            f"reduction_type={self.reduction_type!r})"
        )


def _rebuild(cls: type, actor: Any, spec: Any, treedef: Any, name: str) -> RayAccumulator:
    handle = object.__new__(cls)
    handle._actor, handle._spec, handle._treedef, handle._name = actor, spec, treedef, name
    handle._local = threading.local()
    return handle


def _answer_limit(timeout: Any, grace_period: Any) -> float | None:
    """When a waiting take gives up on the actor (None: never; the actor checks the
    arguments, so odd ones give no limit here)."""
    if not isinstance(timeout, int | float) or timeout == float("inf"):
        return None
    grace = grace_period if isinstance(grace_period, int | float) else 0.0
    return time.monotonic() + max(timeout, 0) + max(grace, 0) + _ANSWER_SLACK
