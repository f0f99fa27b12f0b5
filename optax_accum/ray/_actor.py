"""The Ray actor that holds one accumulator: an in-process `ConditionalAccumulator` or
`SparseConditionalAccumulator`, called from the actor's threads.

Gradients are checked, accepted or dropped, summed and reduced by the in-process
object, so those rules are its own. The actor keeps the queue of takes itself, because
a caller that dies while its take is blocked must not have that take served later (Ray
lets an actor task run on when its caller dies): every remote take waits here, first
come, first served, as a ticket, and only when the head ticket's count is reached (or
its grace window has passed) does the actor hand it over, by letting its thread call
the in-process `take_grad`, which is then served at once. Handing over happens with
the accumulator's lock held (the one applies take), after checking that the head's
caller is alive, and the lock is released only once the in-process take has been
served: so a take completes inside the apply that brings its count, as in-process, and
never for a dead caller. A caller on the actor's node is checked by its process
(exactly); one on another node by a lease it renews while it waits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import functools
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from optax_accum.host import ConditionalAccumulator, SparseConditionalAccumulator, _args
from optax_accum.indexed_slices import IndexedSlices
from optax_accum.ray._callers import Caller, Liveness
from optax_accum.ray._checkpoint import Checkpoint, Entry

_WATCH_EVERY = 0.05  # seconds between the watchdog's checks for dead callers
_SERVED_POLL = 1e-4  # seconds between checks that a handed take was served
_SERVE_BOUND = 60.0  # seconds a handed in-process take may take to be served

_KINDS = {"dense": ConditionalAccumulator, "sparse": SparseConditionalAccumulator}

# Errors of the in-process object (and of the actor's own checks) that reach the
# caller as themselves, not wrapped in a RayTaskError.
PASSED_ERRORS = (TypeError, ValueError, TimeoutError, concurrent.futures.CancelledError)


class Spec(NamedTuple):
    """What an accumulator is; two objects under one `shared_name` must agree on it."""

    kind: str  # "dense" or "sparse"
    dtype: str
    shape: tuple | None
    reduction_type: str
    skip_nonfinite: bool

    def build(self) -> Any:
        """A fresh in-process accumulator of this spec."""
        return _KINDS[self.kind](
            self.dtype,
            self.shape,
            None,
            reduction_type=self.reduction_type,
            skip_nonfinite=self.skip_nonfinite,
        )

    def describe(self) -> str:
        shape = _args.fmt(self.shape)
        return (
            f"{_KINDS[self.kind].__name__}(dtype={self.dtype}, shape={shape}, "
            f"reduction_type={self.reduction_type}, skip_nonfinite={self.skip_nonfinite})"
        )


class Outcome(NamedTuple):
    """An actor method's answer: its value, or the error to raise in the caller."""

    value: Any
    error: BaseException | None


def answers(method: Callable) -> Callable:
    """Returns `method`'s errors among `PASSED_ERRORS` as an `Outcome`, so the caller
    raises the same TypeError, ValueError, TimeoutError or CancelledError."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Outcome:
        try:
            return Outcome(method(*args, **kwargs), None)
        except PASSED_ERRORS as error:
            return Outcome(None, error)

    return wrapper


class _State(enum.Enum):
    WAITING = "waiting"  # in the queue
    HANDED = "handed"  # its thread may take the batch
    CANCELLED = "cancelled"  # by cancel_waiting_takes
    ABANDONED = "abandoned"  # its caller died or withdrew it


class _Ticket:
    """One remote take, waiting in the actor's queue."""

    def __init__(self, num_required: int, deadline: float | None, grace: float, caller: Caller):
        self.num_required = num_required
        self.deadline = deadline
        self.grace = grace
        self.caller = caller
        self.renewed = time.monotonic()
        self.quorum_at: float | None = None  # when the count reached num_required
        self.state = _State.WAITING
        self.wake = threading.Event()
        self.served = threading.Event()  # its in-process take returned (or failed)
        self.saved = threading.Event()  # the checkpoint after it was written
        self.taken = False  # its own thread took it (no one else waits for it)
        self.result: Any = None

    def set_state(self, state: _State) -> None:
        self.state = state
        self.wake.set()


class AccumulatorActor:
    """The body of the Ray actor: one in-process accumulator and its queue of takes.

    Methods return `Outcome`s (see `answers`). `_lock` serializes everything that
    changes the accumulator (applies, `set_global_step`, handing a batch over);
    `_tickets_lock` guards the queue and the tickets' states, and is taken inside
    `_lock` when both are needed, never the other way round.
    """

    def __init__(self, spec: Spec, checkpoint_dir: str | None) -> None:
        self._spec = spec
        self._acc = spec.build()
        self._lock = threading.Lock()
        self._tickets_lock = threading.Lock()
        self._queue: deque[_Ticket] = deque()
        self._tickets: dict[str, _Ticket] = {}
        self._liveness = Liveness()
        self._checkpoint = None if checkpoint_dir is None else Checkpoint(checkpoint_dir)
        if self._checkpoint is not None:
            self._restore()
        watchdog = threading.Thread(target=self._watch, name="optax_accum.ray watchdog")
        watchdog.daemon = True
        watchdog.start()

    # ------------------------------------------------------------------ checkpoint

    def _restore(self) -> None:
        """Replays the checkpoint's batch into the fresh accumulator, at its step."""
        global_step, entries = self._checkpoint.restore()
        self._acc.set_global_step(global_step)
        for entry in entries:
            kwargs = {} if entry.weight is None else {"weight": entry.weight}
            method = getattr(self._acc, entry.method)
            if not method(*entry.payload, local_step=global_step, **kwargs):
                raise RuntimeError("a checkpointed gradient was not accepted on replay")

    # ------------------------------------------------------------------ queries

    @answers
    def spec(self) -> Spec:
        return self._spec

    @answers
    def pid(self) -> int:
        return os.getpid()

    @answers
    def counters(self) -> dict[str, int]:
        """global_step, num_accumulated, num_dropped, num_nonfinite, num_waiting_takes."""
        acc = self._acc
        with self._tickets_lock:
            waiting = len(self._queue)
        return {
            "global_step": acc.global_step,
            "num_accumulated": acc.num_accumulated(),
            "num_dropped": acc.num_dropped,
            "num_nonfinite": acc.num_nonfinite,
            "num_waiting_takes": waiting,
        }

    # ------------------------------------------------------------------ changes

    @answers
    def apply(self, method: str, local_step: Any, weight: Any, *payload: Any) -> bool:
        """The in-process `method` (an apply) on `payload`; saved before it returns."""
        if method not in ("apply_grad", "apply_indexed_slices_grad"):
            raise ValueError(f"unknown apply method {method!r}")
        if method == "apply_indexed_slices_grad":
            payload = (IndexedSlices(*payload),)
        kwargs = {} if weight is None else {"weight": weight}
        with self._lock:
            accepted = getattr(self._acc, method)(*payload, local_step=local_step, **kwargs)
            if accepted:
                if self._checkpoint is not None:
                    self._checkpoint.record(Entry(method, payload, weight))
                self._serve()
        return accepted

    @answers
    def set_global_step(self, new_global_step: Any) -> bool:
        """Sets the step; returns whether it lowered it (the caller warns)."""
        with self._lock:
            lowered = _args.check_step("new_global_step", new_global_step) < self._acc.global_step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._acc.set_global_step(new_global_step)
            if self._checkpoint is not None:
                self._checkpoint.save_step(self._acc.global_step, taken=False)
        return lowered

    # ------------------------------------------------------------------ takes

    @answers
    def take(
        self,
        ticket_id: str,
        num_required: Any,
        timeout: Any,
        grace_period: Any,
        caller: Caller,
    ) -> Any:
        """A take, queued here until handed over, then the in-process `take_grad`;
        the answer as host NumPy."""
        num_required = _args.check_num_required(num_required)
        timeout = _args.check_timeout(timeout)
        grace = _args.check_grace_period(grace_period) or 0.0
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = _Ticket(num_required, deadline, grace, caller)
        with self._lock:
            with self._tickets_lock:
                self._queue.append(ticket)
                self._tickets[ticket_id] = ticket
            self._serve(own=ticket)
        try:
            if not ticket.taken and not self._await_turn(ticket, timeout):
                return None  # abandoned: no one to answer
            if not ticket.taken:  # handed by a thread that holds the lock until served
                try:
                    ticket.result = self._acc.take_grad(num_required, timeout=_SERVE_BOUND)
                finally:
                    ticket.served.set()
                ticket.saved.wait()
        finally:
            with self._tickets_lock:
                self._tickets.pop(ticket_id, None)
        if self._spec.kind == "dense":
            return np.asarray(ticket.result)
        indices, values, shape = ticket.result
        return np.asarray(indices), np.asarray(values), shape

    def _await_turn(self, ticket: _Ticket, timeout: float | None) -> bool:
        """Waits until `ticket` is handed over (True) or abandoned (False); raises
        TimeoutError (the ticket withdrawn) or CancelledError."""
        while True:
            ticket.wake.clear()
            if ticket.state is _State.HANDED:
                return True
            with self._tickets_lock:
                state, now = ticket.state, time.monotonic()
                expired = ticket.deadline is not None and now >= ticket.deadline
                if state is _State.WAITING and ticket.quorum_at is None and expired:
                    self._queue.remove(ticket)
                    count = self._acc.num_accumulated()
                    raise TimeoutError(
                        f"take_grad({ticket.num_required}) timed out after {timeout} s "
                        f"with {count} gradient(s) accumulated; nothing was taken"
                    )
            if state is _State.HANDED:
                return True
            if state is _State.CANCELLED:
                raise concurrent.futures.CancelledError(
                    f"take_grad({ticket.num_required}) was cancelled while waiting"
                )
            if state is _State.ABANDONED:
                return False
            if ticket.quorum_at is not None:
                wait = ticket.quorum_at + ticket.grace - now
                if wait <= 0:  # the grace window has passed: serve it, unless a
                    # thread holding the lock is at it (and may be handing it over)
                    if self._lock.acquire(blocking=False):
                        try:
                            self._serve(own=ticket)
                        finally:
                            self._lock.release()
                        if ticket.taken:
                            return True
                        continue
                    wait = _WATCH_EVERY / 10
            else:
                wait = None if ticket.deadline is None else ticket.deadline - now
            ticket.wake.wait(wait)

    def _serve(self, own: _Ticket | None = None) -> None:
        """Hands the head ticket over if its count is reached and its grace window has
        passed, dropping dead callers' tickets on the way (`_lock` held). The calling
        thread's `own` ticket it takes at once, itself."""
        while True:
            with self._tickets_lock:
                if not self._queue:
                    return
                head = self._queue[0]
                if not self._alive(head):
                    self._queue.popleft()
                    head.set_state(_State.ABANDONED)
                    continue
                if self._acc.num_accumulated() < head.num_required:
                    return
                now = time.monotonic()
                if head.grace:
                    if head.quorum_at is None:
                        head.quorum_at = now
                        head.wake.set()  # it times its grace window now
                    if now < head.quorum_at + head.grace:
                        return
                self._queue.popleft()
                step = self._acc.global_step
                head.set_state(_State.HANDED)
            if head is own:
                self._take_now(own, step)
            else:
                self._await_served(head, step)
            return

    def _take_now(self, ticket: _Ticket, step: int) -> None:
        """The calling thread's own handed ticket: its in-process take, served at once,
        and the checkpoint after it (`_lock` held)."""
        ticket.taken = True
        try:
            ticket.result = self._acc.take_grad(ticket.num_required, timeout=_SERVE_BOUND)
        finally:
            ticket.served.set()
            self._save_taken(step)
            ticket.saved.set()

    def _await_served(self, ticket: _Ticket, step: int) -> None:
        """Holds `_lock` (no apply comes in between) until the handed ticket's
        in-process take was served, then checkpoints the new step."""
        try:
            while self._acc.global_step == step and not ticket.served.is_set():
                time.sleep(_SERVED_POLL)
            self._save_taken(step)
        finally:
            ticket.saved.set()

    def _save_taken(self, step: int) -> None:
        """Checkpoints the step after a take that was served (the step advanced)."""
        if self._checkpoint is not None and self._acc.global_step != step:
            self._checkpoint.save_step(self._acc.global_step, taken=True)

    def _alive(self, ticket: _Ticket) -> bool:
        return self._liveness.alive(ticket.caller, ticket.renewed)

    @answers
    def renew(self, ticket_id: str) -> None:
        """The caller of a waiting take is alive: extends its lease."""
        with self._tickets_lock:
            ticket = self._tickets.get(ticket_id)
            if ticket is not None:
                ticket.renewed = time.monotonic()

    @answers
    def withdraw(self, ticket_id: str) -> None:
        """The caller gave up (interrupted) a waiting take: it leaves the queue."""
        with self._lock, self._tickets_lock:
            ticket = self._tickets.get(ticket_id)
            if ticket is not None and ticket.state is _State.WAITING:
                self._queue.remove(ticket)
                ticket.set_state(_State.ABANDONED)

    @answers
    def cancel_waiting_takes(self) -> int:
        with self._tickets_lock:
            cancelled = len(self._queue)
            while self._queue:
                self._queue.popleft().set_state(_State.CANCELLED)
        return cancelled

    def _watch(self) -> None:
        """Every few milliseconds: drops waiting takes whose caller died, and serves
        the head if its grace window has passed."""
        while True:
            time.sleep(_WATCH_EVERY)
            with contextlib.suppress(Exception), self._lock:
                with self._tickets_lock:
                    for ticket in [t for t in self._queue if not self._alive(t)]:
                        self._queue.remove(ticket)
                        ticket.set_state(_State.ABANDONED)
                self._serve()
