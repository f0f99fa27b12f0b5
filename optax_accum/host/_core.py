"""What the dense and sparse host accumulators share: the step and counters under one
lock, the hand-off of a batch to the head take, the shared-name registry, and the
public base object.

A batch holds everything accumulated since the last take (the count, the aggregate
and its bookkeeping). Applies change it in one assignment at the end, after any
device work, so an exception (KeyboardInterrupt included) leaves the count and the
aggregate consistent. When the head take's count is reached, the whole batch is
handed to that take and replaced by an empty one, and the global step advances: a
few assignments under the lock, repaired if interrupted. The taker reduces the batch
in its own thread, outside the lock, while appliers go on filling the next one.

NumPy and Python only, as `_takes` and `_args`: the kinds that keep their aggregate
on a JAX device (`_dense`, `_sparse`) bring JAX; the Ray actor's kinds, which sum in
NumPy, share this module, its rules and its take queue without importing JAX.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_accum.host import _args
from optax_accum.host._takes import Take, TakeQueue


class Batch:
    """The gradients accepted since the last take; kinds add their aggregate's fields."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Core:
    """Step, counters, the current batch and the take queue of one accumulator; shared
    by every object built with one shared_name. Fields are guarded by `lock`.

    Kinds implement `new_batch` and `reduce` (a batch to the take's answer, run by the
    taker without the lock), and their own `apply`.
    """

    kind = "accumulator"

    def __init__(self, dtype: Any, shape: Any, mean: bool, skip_nonfinite: bool) -> None:
        self.dtype = dtype
        self.shape = shape
        self.mean = mean
        self.skip_nonfinite = skip_nonfinite
        self.lock = threading.Lock()
        self.takes = TakeQueue(self.lock, self.serve)
        self.batch = self.new_batch()
        self.global_step = 0
        self.num_dropped = 0
        self.num_nonfinite = 0

    def signature(self) -> tuple:
        return (type(self), self.dtype, self.shape, self.mean, self.skip_nonfinite)

    def describe(self) -> str:
        return (
            f"{self.kind}(dtype={self.dtype.name}, shape={_args.fmt(self.shape)}, "
            f"reduction_type={'MEAN' if self.mean else 'SUM'}, "
            f"skip_nonfinite={self.skip_nonfinite})"
        )

    def new_batch(self) -> Batch:
        raise NotImplementedError

    def reduce(self, batch: Batch) -> Any:
        raise NotImplementedError

    def handing(self, take: Take, new_step: int) -> BaseException | None:
        """Called just before `take` is handed the batch and the step becomes
        `new_step` (lock held, nothing changed yet): an error returned fails the take
        instead, consuming nothing (the Ray actor's checkpoint could not be written)."""
        return None

    def seal(self, batch: Batch, take: Take) -> None:
        """Called as `batch` is handed to `take` (lock held): kinds may start its
        reduction here, on the device ahead of the next batch's work. Any failure must
        be left for `reduce` to meet again, in the taker's thread."""

    # ------------------------------------------------------------------ apply

    def admit(self, local_step: int, finite: bool) -> bool:
        """Whether a validated gradient is accepted; counts a refused one (lock held)."""
        if local_step < self.global_step:
            self.num_dropped += 1
            return False
        if not finite:
            self.num_nonfinite += 1
            return False
        return True

    def discard_if_consumed(self, batch: Batch, *arrays: Any) -> None:
        """After an interrupted update: if a kernel consumed (donated) one of the batch's
        `arrays` and its result was lost, the batch cannot be read any more; it is
        replaced by an empty one, so the count still matches the aggregate (lock held)."""
        if self.batch is batch and any(a is not None and a.is_deleted() for a in arrays):
            self.batch = self.new_batch()

    # ------------------------------------------------------------------ take

    def serve(self) -> None:
        """Hands the batch to the head take if it has enough gradients and no grace
        period left to wait (lock held). A take whose caller is gone (see `take`) is
        dropped instead, and the one behind it considered."""
        head = self.takes.head()
        while head is not None and head.gone is not None and self.batch.count >= head.num_required:
            if not self.takes.drop_if_gone(head):
                break
            head = self.takes.head()
        if head is None or self.batch.count < head.num_required:
            return
        batch = self.batch
        try:
            if not head.due():  # in its grace period (interrupted: its thread is woken)
                return
            step, empty = self.global_step, self.new_batch()
            error = self.handing(head, step + 1)
            if error is not None:  # the take fails, consuming nothing
                self.takes.pop_head()
                head.fail(error)
                return
            self.takes.pop_head()
            self.batch, self.global_step = empty, step + 1  # one step: no interruption inside
            self.seal(batch, head)  # the batch is the take's alone now
            head.hand(batch)
        except BaseException:  # e.g. KeyboardInterrupt: finish or undo, never half
            if self.batch is batch:  # not handed: put the take back, let its thread serve
                self.takes.restore_head(head)
                self.takes.wake_head()
            else:
                head.hand(batch)
            raise

    def take(
        self,
        num_required: Any,
        timeout: Any,
        grace_period: Any = None,
        gone: Callable[[], BaseException | None] | None = None,
        queued: Callable[[Take], None] | None = None,
    ) -> Any:
        """Waits in the queue until handed a batch, then reduces it (the taker's thread).

        `gone`, if given, is asked (lock held) before the take is handed a batch: if it
        returns an error (its caller died, say), the take is dropped with that error
        instead, consuming nothing. `queued` is called with the take before it waits.
        """
        take = Take(_args.check_num_required(num_required))
        timeout = _args.check_timeout(timeout)
        take.grace = _args.check_grace_period(grace_period)
        take.gone = gone
        if queued is not None:
            queued(take)
        if not self.takes.wait(take, timeout):
            raise TimeoutError(
                f"take_grad({take.num_required}) timed out after {timeout} s with "
                f"{self.num_accumulated()} gradient(s) accumulated; nothing was taken"
            )
        if take.error is not None:
            raise take.error
        with self.reducing():
            return self.reduce(take.batch)

    def reducing(self) -> contextlib.AbstractContextManager:
        """The context a batch is reduced in (kinds on a device: its precision)."""
        return contextlib.nullcontext()

    def drop(self, take: Take, error: BaseException) -> bool:
        """Withdraws a waiting `take` from another thread: it fails with `error`,
        consuming nothing. Returns False if it was served (or ended) already."""
        with self.lock:
            return self.takes.drop(take, error)

    def drop_gone(self) -> None:
        """Drops every waiting take whose caller is gone (see `take`)."""
        with self.lock:
            self.takes.drop_gone()

    def cancel_waiting_takes(self) -> int:
        def cancelled(take: Take) -> BaseException:
            return concurrent.futures.CancelledError(
                f"take_grad({take.num_required}) was cancelled while waiting"
            )

        with self.lock:
            return self.takes.cancel_all(cancelled)

    def num_waiting_takes(self) -> int:
        with self.lock:
            return len(self.takes)

    def num_accumulated(self) -> int:
        with self.lock:
            return self.batch.count

    def set_global_step(self, new_global_step: Any) -> None:
        step = _args.check_step("new_global_step", new_global_step)
        with self.lock:
            if step < self.global_step:
                warnings.warn(
                    f"set_global_step({step}) lowers the accumulator's global step from "
                    f"{self.global_step}",
                    stacklevel=3,
                )
            self.global_step = step


# --------------------------------------------------------------------------- shared_name

_registry: weakref.WeakValueDictionary[str, Core] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def core_for(shared_name: Any, make: Any) -> Core:
    """A new core, or the live one registered under a non-empty `shared_name`."""
    if shared_name is not None and not isinstance(shared_name, str):
        raise TypeError(f"shared_name must be None or a str, got {shared_name!r}")
    core = make()
    if not shared_name:
        return core
    with _registry_lock:
        existing = _registry.get(shared_name)
        if existing is None:
            _registry[shared_name] = core
            return core
    if existing.signature() != core.signature():
        raise ValueError(
            f"shared_name {shared_name!r} is already used by a {existing.describe()}; "
            f"got a {core.describe()}"
        )
    return existing


# --------------------------------------------------------------------------- public base


class HostAccumulator:
    """What the dense and sparse objects share: construction, takes, steps, counters."""

    _core_type: type[Core]

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str,
        reduction_type: str,
        skip_nonfinite: bool,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        dtype = _args.check_dtype(dtype)
        shape = _args.check_shape(shape)
        mean = _args.check_reduction(reduction_type)
        skip_nonfinite = _args.check_bool("skip_nonfinite", skip_nonfinite)
        self._core = core_for(
            shared_name, lambda: self._core_type(dtype, shape, mean, skip_nonfinite)
        )
        self._name = name

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the gradients accumulated (and of the taken aggregates)."""
        return self._core.dtype

    @property
    def shape(self) -> _args.Shape | None:
        """The accumulator's shape: a tuple with None for unknown dims, or None."""
        return self._core.shape

    @property
    def name(self) -> str:
        """The name given at construction."""
        return self._name

    @property
    def reduction_type(self) -> str:
        """ "MEAN" or "SUM"."""
        return "MEAN" if self._core.mean else "SUM"

    @property
    def accumulator_ref(self) -> Any:
        """The underlying accumulator, shared by every object with this `shared_name`."""
        return self._core

    @property
    def global_step(self) -> int:
        """The accumulator's global step (not in TF, which only sets it)."""
        with self._core.lock:
            return self._core.global_step

    @property
    def num_dropped(self) -> int:
        """Stale gradients dropped so far (not in TF)."""
        with self._core.lock:
            return self._core.num_dropped

    @property
    def num_nonfinite(self) -> int:
        """Gradients skipped for holding NaN or Inf (only with `skip_nonfinite=True`)."""
        with self._core.lock:
            return self._core.num_nonfinite

    def num_accumulated(self) -> int:
        """The number of gradients accepted since the last take."""
        return self._core.num_accumulated()

    def set_global_step(self, new_global_step: int) -> None:
        """Sets the global step; a lower value is allowed and warns, as in TF.

        It changes neither the counter nor the aggregate.

        Raises:
          TypeError: if `new_global_step` is not an int.
        """
        self._core.set_global_step(new_global_step)

    def num_waiting_takes(self) -> int:
        """How many `take_grad` calls are blocked right now (not in TF)."""
        return self._core.num_waiting_takes()

    def cancel_waiting_takes(self) -> int:
        """Cancels every waiting take, as closing TF's session does.

        Each blocked `take_grad` raises `concurrent.futures.CancelledError` in its
        thread and consumes nothing. Gradients already accumulated stay, and the
        accumulator remains usable.

        Returns:
          The number of takes cancelled.
        """
        return self._core.cancel_waiting_takes()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dtype={self.dtype.name}, shape={_args.fmt(self.shape)}, "
            f"name={self.name!r}, reduction_type={self.reduction_type!r})"
        )
