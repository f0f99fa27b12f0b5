"""The blocking queue of takes: first come, first served, each with its deadline.

A `take_grad` queues a `Take` and sleeps on its own event, outside the accumulator's
lock, so waking it never contends with the appliers. Nor does arriving: a take joins
the queue through a list of arrivals, without the lock (under a stream of applies a
learner would otherwise wait behind every actor for it, while gradients pile up):
the next apply admits and serves it under the lock, or the taker itself, when it
finds the lock free (at once, then every few milliseconds until admitted). Whoever
holds the lock when the head take's count is reached (an applier, or a taker on
arrival) hands it the batch of gradients; the taker then reduces that batch in its
own thread. A take leaves the queue only by being handed its batch, failed
(cancelled) or withdrawn by its own thread (deadline passed, or interrupted), so none
is ever left waiting unserved.

A take may come with a check of its caller (`gone`, the Ray actor's: is the remote
caller still alive?): a take whose caller is gone when its batch is ready is dropped
instead of served, and the next one considered.

A take with a grace period is not handed its batch when its count is reached: it
ripens instead (`grace_ends` is set, under the lock, and its thread woken), stays at
the head of the queue while gradients keep arriving, and is handed the batch once the
grace period has passed, by its own thread or by an apply after that. A ripe take no
longer times out; cancelled or interrupted, it is withdrawn as any other.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class Take:
    """One waiting `take_grad`: it ends handed a batch or failed with an error."""

    __slots__ = (
        "admitted",
        "batch",
        "error",
        "event",
        "gone",
        "grace",
        "grace_ends",
        "num_required",
    )

    def __init__(self, num_required: int, grace: float | None = None) -> None:
        self.num_required = num_required
        self.grace = grace  # seconds to wait on once num_required is reached, or None
        self.grace_ends: float | None = None  # the monotonic time it ends, once ripe
        # Asked before the take is handed a batch: an error if its caller is gone.
        self.gone: Callable[[], BaseException | None] | None = None
        self.event = threading.Event()
        self.admitted = False  # moved from the arrivals into the queue (lock held)
        self.batch: Any = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.batch is not None or self.error is not None

    def due(self) -> bool:
        """Whether the take may be handed its batch now that its count is reached; if
        it has a grace period, the first call starts it and wakes the take's thread to
        wait it out (lock held)."""
        if self.grace is None:
            return True
        if self.grace_ends is None:
            self.event.set()  # first: interrupted after it, the thread starts it itself
            self.grace_ends = time.monotonic() + self.grace
            return False
        return time.monotonic() >= self.grace_ends

    def hand(self, batch: Any) -> None:
        self.batch = batch
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


_ADMIT_POLL = 0.002  # seconds between a not yet admitted take's own tries


class TakeQueue:
    """The FIFO of waiting takes of one accumulator, guarded by that accumulator's `lock`.

    `serve` (called with the lock held) hands the head its batch when there are enough
    gradients; through `head`, it first admits the takes that arrived. Methods other
    than `wait` expect the lock held by the caller; they see arrived takes as queued.
    """

    def __init__(self, lock: threading.Lock, serve: Callable[[], None]) -> None:
        self._lock = lock
        self._serve = serve
        self._takes: deque[Take] = deque()
        self._arrivals: deque[Take] = deque()  # appended to without the lock

    def _admit(self) -> None:
        """Moves arrived takes, in order, to the back of the queue (lock held). Each
        step may be repeated, so an interruption anywhere leaves nothing lost or
        queued twice."""
        while self._arrivals:
            take = self._arrivals[0]
            if take not in self._takes:
                self._takes.append(take)
            take.admitted = True
            self._arrivals.popleft()

    def _serve_arrivals(self) -> None:
        """Admits and serves arrived takes if the lock is free; its holder does if not."""
        if self._arrivals and not self._lock.locked():
            with self._lock:
                self._serve()

    def __len__(self) -> int:
        self._admit()
        return len(self._takes)

    def head(self) -> Take | None:
        self._admit()
        return self._takes[0] if self._takes else None

    def push(self, take: Take) -> None:
        self._takes.append(take)

    def pop_head(self) -> None:
        self._takes.popleft()

    def restore_head(self, take: Take) -> None:
        """Puts `take` back in front if an interrupted hand-off had removed it."""
        if self.head() is not take:
            self._takes.appendleft(take)

    def wake_head(self) -> None:
        """Wakes the head's thread to serve itself (after an interrupted hand-off)."""
        if self._takes:
            self._takes[0].event.set()

    def drop(self, take: Take, error: BaseException) -> bool:
        """Fails a waiting `take` with `error` (its thread raises it), serving the one
        behind it if it was the head; False if it was done already."""
        self._admit()
        if take.done:
            return False
        if take in self._takes:
            was_head = self._takes[0] is take
            self._takes.remove(take)
            if was_head:
                self._serve()
        take.fail(error)
        return True

    def drop_if_gone(self, take: Take) -> bool:
        """Drops `take` if its caller is gone (see `Take.gone`); whether it did."""
        error = take.gone()
        if error is None:
            return False
        self._takes.remove(take)
        take.fail(error)
        return True

    def drop_gone(self) -> None:
        """Drops every take whose caller is gone, then serves the head."""
        self._admit()
        for take in [t for t in self._takes if t.gone is not None]:
            self.drop_if_gone(take)
        self._serve()

    def cancel_all(self, error: Callable[[Take], BaseException]) -> int:
        self._admit()
        cancelled = 0
        while self._takes:
            take = self._takes.popleft()
            take.fail(error(take))
            cancelled += 1
        return cancelled

    def wait(self, take: Take, timeout: float | None) -> bool:
        """Queues `take` and blocks until it is done (True) or `timeout` seconds pass
        before it ripens (False).

        On a timeout or an exception (KeyboardInterrupt included) the take is withdrawn
        unless it was served meanwhile, and the take behind it is served if it can be:
        a withdrawn take leaves no trace. A wake-up that finds the take not done means
        an interrupted hand-off asked its thread to serve itself, or the take ripened.
        Until the take is admitted it wakes every few milliseconds to admit itself if
        the lock is free.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._arrivals.append(take)
            self._serve_arrivals()
            while not take.done:
                if take.grace_ends is not None:  # ripe: no deadline any more
                    self._sit_out_grace(take)
                    continue
                chunk = self._next_wait(take, deadline)
                if chunk is None:
                    if self._withdraw(take, unless_ripe=True):
                        break
                elif take.event.wait(chunk):
                    self._woken(take)
                elif not take.admitted:
                    self._serve_arrivals()
        finally:
            if not take.done:
                self._withdraw(take)
        return take.done

    def _next_wait(self, take: Take, deadline: float | None) -> float | None:
        """Seconds to wait for the take's event, or None once the deadline has passed
        (a take not admitted by then is served first, as if it had waited for the lock)."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            if not take.admitted:
                with self._lock:
                    self._serve()
            return None
        # Event.wait refuses waits beyond TIMEOUT_MAX: wait in chunks.
        if remaining is None or remaining > threading.TIMEOUT_MAX:
            remaining = threading.TIMEOUT_MAX
        return remaining if take.admitted else min(remaining, _ADMIT_POLL)

    def _woken(self, take: Take) -> None:
        """After the take's event is set: if it is not done, an interrupted hand-off
        asked its thread to serve it, or it ripened: it serves, under the lock."""
        if take.done:  # set before the event: no need to contend for the lock
            return
        with self._lock:
            if not take.done:
                take.event.clear()
                self._serve()

    def _sit_out_grace(self, take: Take) -> None:
        """Waits for a ripe take's grace period to end (or for it to be served or
        cancelled meanwhile), then serves it under the lock."""
        remaining = min(take.grace_ends - time.monotonic(), threading.TIMEOUT_MAX)
        if remaining > 0 and take.event.wait(remaining) and take.done:
            return
        self._woken(take)

    def _withdraw(self, take: Take, unless_ripe: bool = False) -> bool:
        """Takes an unserved `take` out of the queue, serving the one behind it if it
        was the head; with `unless_ripe`, a take that has reached its count stays (its
        deadline no longer applies). Returns whether it is out, unserved."""
        with self._lock:
            self._admit()
            if take.done or (unless_ripe and take.grace_ends is not None):
                return False
            if take in self._takes:
                was_head = self.head() is take
                self._takes.remove(take)
                if was_head:
                    self._serve()
            return True
