"""Who is calling: enough to tell, inside the actor, whether a waiting take's caller is
still alive, so that a take whose caller died never consumes a gradient.

A caller on the actor's node is checked through its process (exact); one on another
node renews a lease while it waits, and a take whose lease has lapsed when its batch
is ready is dropped with a TimeoutError that says nothing was taken (the caller, if
only paused, gets it when it resumes).
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import psutil
import ray

# A caller on another node renews its take's lease every RENEW_EVERY seconds while it
# waits; a take whose lease is LEASE seconds old is dropped when its batch is ready.
RENEW_EVERY = 0.25
LEASE = 10.0


class Caller(NamedTuple):
    """A calling process: its Ray node, its pid and the pid's start time (a pid that
    was reused by another process does not pass for the caller), and the seconds its
    lease lasts without renewal."""

    node_id: str
    pid: int
    started: float
    lease: float = LEASE

    @classmethod
    def this_process(cls) -> Caller:
        pid = os.getpid()
        return cls(ray.get_runtime_context().get_node_id(), pid, psutil.Process(pid).create_time())


def process_alive(caller: Caller) -> bool:
    """Whether the calling process still runs (on this node): it exists, is the same
    process (same start time) and is not a zombie."""
    try:
        process = psutil.Process(caller.pid)
        return process.create_time() == caller.started and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Lease:
    """One waiting take's caller, asked before the take is handed its batch."""

    def __init__(self, caller: Caller, node_id: str, num_required: int) -> None:
        self.caller = caller
        self.local = caller.node_id == node_id
        self.renewed = time.monotonic()
        self.num_required = num_required

    def renew(self) -> None:
        self.renewed = time.monotonic()

    def gone(self) -> BaseException | None:
        """None while the caller lives; else the error its take is dropped with."""
        if self.local:
            if process_alive(self.caller):
                return None
            return RuntimeError(f"take_grad({self.num_required})'s caller died")
        silent = time.monotonic() - self.renewed
        if silent < self.caller.lease:
            return None
        return TimeoutError(
            f"take_grad({self.num_required}) was dropped: its caller, on another node, "
            f"renewed its lease last {silent:.1f} s ago, past the {self.caller.lease:g} s "
            f"lease (it was paused, or cut off from the cluster); nothing was taken"
        )
