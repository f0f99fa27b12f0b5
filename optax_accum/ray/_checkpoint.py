"""The actor's checkpoint: a log of its accepted gradients and of its takes, on disk, so
that an actor restarted by Ray resumes where it died, and a take whose answer was lost
with it is answered again.

The directory holds:

- `lock`: locked (`flock`) by the live actor that uses the directory: a second
  accumulator given the same directory is refused while the first lives;
- `spec.json`: the accumulator's name and spec: an accumulator of another name or
  spec is refused even when the first is gone;
- `state.json`: the global step, the number of the current batch's first gradient,
  the last push of each client heard since the save before (so a retried push is not
  counted twice after a restart), and each client's last take (its number and the
  gradients it was handed);
- `grad-<n>.pkl`: accepted gradient n (its client, number, weight and arrays).

Every file is written whole to a temporary name, synced, then renamed: a crash leaves
the old file or the new one, never half of one. A gradient's file is written before
it is counted (a write that fails counts nothing), and the state after a take before
the take is handed its batch (a write that fails fails the take, consuming nothing).
A restarted actor replays the current batch's gradients, in order, into a fresh
accumulator at the saved step: the same adds in the same order, so the same sums. The
files of a take's batch are kept until that client takes again, so a take retried
after a restart gets the same answer, rebuilt from them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import pickle
import time
from typing import Any, NamedTuple

from optax_accum.ray._spec import Leaf, Spec

_STATE, _SPEC, _LOCK = "state.json", "spec.json", "lock"
_PREFIX, _SUFFIX = "grad-", ".pkl"
# Seconds an actor waits for the lock of a predecessor that is still exiting: one that
# Ray restarted, and one built right after a kill().
_LOCK_WAIT = {"restarted": 10.0, "new": 2.0}


class Entry(NamedTuple):
    """One accepted gradient: who pushed it, its weight, and its checked arrays."""

    client: str
    seq: int
    weight: Any
    grad: tuple


class Restored(NamedTuple):
    global_step: int
    entries: list  # the current batch's gradients, in order
    served: dict  # client -> (take number, that take's gradients)
    clients: dict  # client -> [last push number, its answer]


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class Log:
    """The checkpoint in `directory` (created if missing), for the accumulator named
    `name` (None: unnamed) of `spec`, in an actor Ray `restarted` or a new one.
    Raises ValueError if another live accumulator uses it, or it holds another
    accumulator's checkpoint; OSError if it cannot be used at all."""

    def __init__(self, directory: str, spec: Spec, name: str | None, restarted: bool) -> None:
        self.directory = pathlib.Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise type(error)(
                f"checkpoint_dir {directory!r} cannot be used as a directory: {error}"
            ) from None
        self._lock_file = self._lock(name, restarted)
        self._check_spec(spec, name)
        self.first = 0  # number of the current batch's first gradient
        self.next = 0  # number of the next accepted gradient
        self.served: dict[str, tuple[int, int, int]] = {}  # client -> (take, first, next)

    def _lock(self, name: str | None, restarted: bool) -> Any:
        lock_file = open(self.directory / _LOCK, "a+")  # noqa: SIM115 (held while alive)
        deadline = time.monotonic() + _LOCK_WAIT["restarted" if restarted else "new"]
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock_file.seek(0)
                    holder = lock_file.read().strip() or "another process"
                    lock_file.close()
                    raise ValueError(
                        f"checkpoint_dir {str(self.directory)!r} is in use by another live "
                        f"accumulator ({holder}): give each accumulator its own checkpoint_dir"
                    ) from None
                time.sleep(0.05)
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"accumulator {name!r}, pid {os.getpid()}")
        lock_file.flush()
        return lock_file

    def _check_spec(self, spec: Spec, name: str | None) -> None:
        ours = {"name": name, "spec": json.loads(json.dumps(spec))}
        path = self.directory / _SPEC
        if path.exists():
            theirs = json.loads(path.read_text())
            if theirs != ours:
                theirs_spec = Spec(*theirs["spec"])
                raise ValueError(
                    f"checkpoint_dir {str(self.directory)!r} holds the checkpoint of the "
                    f"accumulator {theirs['name']!r}, a {_describe(theirs_spec)}; this one "
                    f"is {name!r}, a {spec.describe()}: give each accumulator its own "
                    f"checkpoint_dir (or empty this one)"
                )
        else:
            _write_atomically(path, json.dumps(ours).encode())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._lock_file.close()

    # ------------------------------------------------------------------ files

    def _grad_path(self, n: int) -> pathlib.Path:
        return self.directory / f"{_PREFIX}{n:012d}{_SUFFIX}"

    def _saved(self) -> list[int]:
        names = (p.name for p in self.directory.glob(f"{_PREFIX}*{_SUFFIX}"))
        return sorted(int(n[len(_PREFIX) : -len(_SUFFIX)]) for n in names)

    def _read(self, numbers: list[int]) -> list[Entry]:
        return [Entry(*pickle.loads(self._grad_path(n).read_bytes())) for n in numbers]

    def _forget(self, numbers: Any) -> None:
        for n in numbers:
            self._grad_path(n).unlink(missing_ok=True)

    # ------------------------------------------------------------------ restore

    def restore(self) -> Restored:
        """The saved step, the current batch, the takes not yet acknowledged and the
        clients' last pushes (step 0 and nothing for an empty directory)."""
        state_path = self.directory / _STATE
        state: dict[str, Any] = {"global_step": 0, "first": 0, "served": {}, "clients": {}}
        if state_path.exists():
            state.update(json.loads(state_path.read_text()))
        self.first = int(state["first"])
        saved = self._saved()
        served, keep = {}, set()
        for client, (take, first, nxt) in state["served"].items():
            numbers = [n for n in saved if first <= n < nxt]
            if len(numbers) == nxt - first:  # all there: it can be answered again
                self.served[client] = (int(take), int(first), int(nxt))
                served[client] = (int(take), self._read(numbers))
                keep.update(numbers)
        current = [n for n in saved if n >= self.first]
        self._forget(n for n in saved if n < self.first and n not in keep)
        self.next = (current[-1] + 1) if current else self.first
        return Restored(int(state["global_step"]), self._read(current), served, state["clients"])

    # ------------------------------------------------------------------ writes

    def record(self, client: str, seq: int, weight: Any, grad: tuple) -> None:
        """Saves an accepted gradient before it is counted."""
        data = pickle.dumps(tuple(Entry(client, seq, weight, grad)), protocol=5)
        _write_atomically(self._grad_path(self.next), data)
        self.next += 1

    def _save(self, global_step: int, clients: Any) -> None:
        state = {
            "global_step": global_step,
            "first": self.first,
            "served": {c: list(s) for c, s in self.served.items()},
            "clients": clients.state(),
        }
        _write_atomically(self.directory / _STATE, json.dumps(state).encode())
        clients.saved()

    def taken(self, new_step: int, owner: tuple[str, int] | None, clients: Any) -> None:
        """Saves the step after a take, and which gradients the take's client was
        handed (kept until it takes again); the next batch starts at the next
        gradient. A failed write changes nothing."""
        before = dict(self.served), self.first
        if owner is not None:
            self.served[owner[0]] = (owner[1], self.first, self.next)
        self.first = self.next
        try:
            self._save(new_step, clients)
        except BaseException:
            self.served, self.first = before
            raise
        if owner is not None and owner[0] in before[0]:  # its previous take: acknowledged
            _, first, nxt = before[0][owner[0]]
            self._forget(range(first, nxt))

    def save_step(self, global_step: int, clients: Any) -> None:
        """Saves a step set by `set_global_step` (the batch is kept)."""
        self._save(global_step, clients)


def _describe(spec: Spec) -> str:
    """`spec.describe()` for a spec read back from JSON (its leaves as lists)."""
    leaves = tuple(Leaf(d, None if s is None else tuple(s), p) for d, s, p in spec.leaves)
    return spec._replace(leaves=leaves).describe()
