"""Who is calling: enough to tell, inside the actor, whether a blocked take's caller
is still alive, so that a take whose caller died never consumes a gradient."""

from __future__ import annotations

import os
import time
from typing import NamedTuple

import psutil
import ray

# A caller on another node renews its take's lease every RENEW_EVERY seconds while it
# waits; a take whose lease is LEASE seconds old is withdrawn.
RENEW_EVERY = 0.25
LEASE = 10.0


class Caller(NamedTuple):
    """A calling process: its Ray node, its pid and the pid's start time (a pid that
    was reused by another process does not pass for the caller)."""

    node_id: str
    pid: int
    started: float

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


class Liveness:
    """Tells whether a take's caller is alive: on the actor's node by its process,
    exactly; on another node by its lease, renewed while it waits."""

    def __init__(self) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()

    def alive(self, caller: Caller, renewed: float) -> bool:
        if caller.node_id == self.node_id:
            return process_alive(caller)
        return time.monotonic() - renewed < LEASE
