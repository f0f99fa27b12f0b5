"""The Ray actor that holds one accumulator: the host accumulators' core, summing in
NumPy (`_kinds`), behind a thin actor.

The actor process imports no JAX: its arithmetic is NumPy, its checks, rules and take
queue are the in-process objects' (`optax_accum.host._core`, `_takes`, `_args`). It is
an asyncio actor with three concurrency groups, each on its own thread: "applies" (one
at a time, as the core's lock serializes them anyway), "takes" (coroutines: a waiting
take holds no Ray thread, so any number can wait), and the default group (counters,
lease renewals, cancellation), which a long apply never holds up.

A take waits in the core's own queue, first come, first served, in a thread of its
own, exactly as an in-process `take_grad` waits in its caller's thread. The queue asks
each take's `Lease` (`_callers`) before handing it a batch: a take whose caller died,
or whose lease from another node lapsed, is dropped instead, consuming nothing (Ray
lets an actor task run on when its caller dies). The answer of each client's last
take is kept until that client takes again: a take that comes again (its answer lost
with a restarted actor, or in transit) gets the same answer, not a second batch.

Methods return `Outcome`s: the value, or the error to raise in the caller as itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, NamedTuple

import ray

from optax_accum.host import _args
from optax_accum.host._takes import Take
from optax_accum.ray._callers import Caller, Lease
from optax_accum.ray._checkpoint import Log
from optax_accum.ray._kinds import ActorCore, core_for
from optax_accum.ray._spec import Options, Spec

# Errors of the accumulator (and of its checkpoint) that reach the caller as
# themselves, not wrapped in a RayTaskError.
PASSED_ERRORS = (
    TypeError,
    ValueError,
    TimeoutError,
    OSError,
    RuntimeError,
    concurrent.futures.CancelledError,
)
CONCURRENCY_GROUPS = {"applies": 1, "takes": 1_000_000}


class Outcome(NamedTuple):
    """An actor method's answer: its value, or the error to raise in the caller."""

    value: Any
    error: BaseException | None


class AccumulatorActor:
    """The body of the Ray actor: one accumulator, its checkpoint and its takes.

    If the accumulator cannot be built (its checkpoint_dir is unusable, in use, or
    holds another accumulator's checkpoint), the actor still starts, and every call
    answers with that error, so the handle can raise it and end the actor.
    """

    def __init__(self, spec: Spec, options: Options) -> None:
        self._spec, self._options = spec, options
        self._node = ray.get_runtime_context().get_node_id()
        self._leases: dict[str, Lease] = {}  # ticket -> its caller, while it waits
        self._waiting: dict[str, Take] = {}  # ticket -> its take, while it waits
        self._answers: dict[str, tuple[int, Outcome]] = {}  # client -> its last take
        self._restored: dict[str, tuple[int, list]] = {}  # client -> take, gradients
        self._running: dict[tuple[str, int], asyncio.Future] = {}
        self._failed: BaseException | None = None
        try:
            self._core: ActorCore = core_for(spec)
            if options.checkpoint_dir is not None:
                restarted = ray.get_runtime_context().was_current_actor_reconstructed
                self._restore(Log(options.checkpoint_dir, spec, options.shared_name, restarted))
        except (ValueError, OSError) as error:
            self._failed = error

    def _restore(self, log: Log) -> None:
        """Replays the checkpoint's batch into the fresh accumulator, at its step."""
        core = self._core
        restored = log.restore()
        core.global_step = restored.global_step
        core.clients.load(restored.clients)
        core.batch = core.replay(restored.entries)
        for entry in restored.entries:
            core.clients.remember(entry.client, entry.seq, True)
        self._restored = restored.served
        core.log = log

    def _answer(self, method: Any, *args: Any) -> Outcome:
        if self._failed is not None:
            return Outcome(None, self._failed)
        try:
            return Outcome(method(*args), None)
        except PASSED_ERRORS as error:
            return Outcome(None, error)

    # ------------------------------------------------------------------ queries

    def hello(self) -> Outcome:
        """What the actor is: (spec, options, pid); or why it failed to start."""
        return self._answer(lambda: (self._spec, self._options, os.getpid()))

    def counters(self) -> Outcome:
        """global_step, num_accumulated, num_dropped, num_nonfinite, num_waiting_takes."""

        def read() -> dict[str, int]:
            core = self._core
            core.drop_gone()  # a dead caller's take does not count as waiting
            with core.lock:
                return {
                    "global_step": core.global_step,
                    "num_accumulated": core.batch.count,
                    "num_dropped": core.num_dropped,
                    "num_nonfinite": core.num_nonfinite,
                    "num_waiting_takes": len(core.takes),
                }

        return self._answer(read)

    # ------------------------------------------------------------------ changes

    @ray.method(concurrency_group="applies")
    def apply(self, client: str, seq: int, local_step: Any, weight: Any, *payload: Any) -> Outcome:
        """Offers one gradient, identified by `(client, seq)`: its leaves (dense), or
        each leaf's indices, values and shape in turn (sparse)."""
        if self._spec.kind == "sparse":
            payload = tuple(zip(payload[0::3], payload[1::3], payload[2::3], strict=True))
        return self._answer(self._core.apply, client, seq, local_step, weight, payload)

    def set_global_step(self, new_global_step: Any) -> Outcome:
        """Sets (and saves) the step; returns whether it lowered it (the caller warns)."""

        def set_step() -> bool:
            step = _args.check_step("new_global_step", new_global_step)
            core = self._core
            with core.lock:
                lowered = step < core.global_step
                if core.log is not None:
                    core.log.save_step(step, core.clients)  # a failed write changes nothing
                core.global_step = step
            return lowered

        return self._answer(set_step)

    def cancel_waiting_takes(self) -> Outcome:
        return self._answer(self._core.cancel_waiting_takes)

    # ------------------------------------------------------------------ takes

    @ray.method(concurrency_group="takes")
    async def take(
        self,
        client: str,
        seq: int,
        ticket: str,
        num_required: Any,
        timeout: Any,
        grace_period: Any,
        caller: Caller,
    ) -> Outcome:
        """A take, identified by `(client, seq)`, waiting in the accumulator's queue;
        the answer (host NumPy) of a take seen before is given again."""
        if self._failed is not None:
            return Outcome(None, self._failed)
        known = self._known_answer(client, seq)
        if known is not None:
            return known
        running = self._running.get((client, seq))
        if running is None:  # not a second arrival of a take still waiting
            loop = asyncio.get_running_loop()
            running = self._running[(client, seq)] = loop.create_future()
            args = (client, seq, ticket, num_required, timeout, grace_period, caller)
            thread = threading.Thread(
                target=self._take, args=(loop, running, *args), name="optax_accum.ray take"
            )
            thread.daemon = True
            thread.start()
        return await asyncio.shield(running)

    def _known_answer(self, client: str, seq: int) -> Outcome | None:
        """The answer of `client`'s take `seq` if it was served before (rebuilt from the
        checkpoint after a restart); forgets the client's older answers."""
        restored = self._restored.get(client)
        if restored is not None and restored[0] == seq:
            batch = self._core.replay(restored[1])
            self._answers[client] = (seq, self._answer(self._core.reduce, batch))
        if restored is not None:
            del self._restored[client]
        last = self._answers.get(client)
        if last is None or last[0] > seq:
            return None
        if last[0] == seq:
            return last[1]
        del self._answers[client]  # it takes again: it has its previous answer
        return None

    def _take(
        self,
        loop: asyncio.AbstractEventLoop,
        running: asyncio.Future,
        client: str,
        seq: int,
        ticket: str,
        num_required: Any,
        timeout: Any,
        grace_period: Any,
        caller: Caller,
    ) -> None:
        """The waiting take's own thread: the in-process `take` on the core."""
        core, taken = self._core, []

        def queued(take: Take) -> None:
            taken.append(take)
            core.owners[take] = (client, seq)
            self._waiting[ticket] = take

        def wait() -> Any:
            lease = self._leases[ticket] = Lease(caller, self._node, num_required)
            answer = core.take(num_required, timeout, grace_period, lease.gone, queued)
            self._answers[client] = (seq, Outcome(answer, None))
            return answer

        try:
            outcome = self._answer(wait)
        finally:
            self._leases.pop(ticket, None)
            self._waiting.pop(ticket, None)
            for take in taken:
                core.owners.pop(take, None)
        loop.call_soon_threadsafe(self._finish, client, seq, running, outcome)

    def _finish(self, client: str, seq: int, running: asyncio.Future, outcome: Outcome) -> None:
        self._running.pop((client, seq), None)
        if not running.done():
            running.set_result(outcome)

    def renew(self, ticket: str) -> None:
        """The caller of a waiting take is alive: extends its lease."""
        lease = self._leases.get(ticket)
        if lease is not None:
            lease.renew()

    def withdraw(self, ticket: str) -> None:
        """The caller gave up (interrupted) a waiting take: it leaves the queue,
        consuming nothing (unless it was handed its batch already)."""
        take = self._waiting.get(ticket)
        if take is not None:
            self._core.drop(take, concurrent.futures.CancelledError("withdrawn by its caller"))

    def pid(self) -> Outcome:
        return Outcome(os.getpid(), None)
