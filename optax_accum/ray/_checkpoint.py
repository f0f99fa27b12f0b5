"""The actor's checkpoint: its global step and the gradients accepted since the last
take, on disk, so that an actor restarted by Ray resumes where it died.

The directory holds `state.json` (the global step, and the sequence number of the
first gradient of the current batch) and one file per accepted gradient,
`grad-<seq>.pkl` (the apply's method, payload and weight). Every file is written
whole to a temporary name, synced, then renamed: a crash leaves the old file or the
new one, never half of one. The actor writes a gradient's file before its
`apply_grad` returns True, and the state after a take before that take returns, so
everything acknowledged is on disk. A restarted actor replays the current batch's
gradients, in order, into a fresh in-process accumulator at the saved global step:
the same adds in the same order, so the same sums.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
from typing import Any, NamedTuple

_STATE = "state.json"
_PREFIX = "grad-"
_SUFFIX = ".pkl"


class Entry(NamedTuple):
    """One accepted gradient: the in-process method that took it and its arguments."""

    method: str
    payload: tuple
    weight: Any


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


class Checkpoint:
    """The checkpoint in `directory` (created if missing)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.first = 0  # sequence number of the current batch's first gradient
        self.next = 0  # sequence number of the next accepted gradient

    def _grad_path(self, seq: int) -> pathlib.Path:
        return self.directory / f"{_PREFIX}{seq:012d}{_SUFFIX}"

    def _saved_seqs(self) -> list[int]:
        names = (p.name for p in self.directory.glob(f"{_PREFIX}*{_SUFFIX}"))
        return sorted(int(n[len(_PREFIX) : -len(_SUFFIX)]) for n in names)

    def restore(self) -> tuple[int, list[Entry]]:
        """The saved global step and the current batch's gradients, in order (0 and
        none for an empty directory)."""
        state_path = self.directory / _STATE
        global_step = 0
        if state_path.exists():
            state = json.loads(state_path.read_text())
            global_step, self.first = int(state["global_step"]), int(state["first"])
        seqs = [s for s in self._saved_seqs() if s >= self.first]
        self._forget_before(self.first)
        self.next = (seqs[-1] + 1) if seqs else self.first
        entries = [pickle.loads(self._grad_path(s).read_bytes()) for s in seqs]
        return global_step, entries

    def record(self, entry: Entry) -> None:
        """Saves an accepted gradient (before its apply is acknowledged)."""
        _write_atomically(self._grad_path(self.next), pickle.dumps(entry, protocol=5))
        self.next += 1

    def save_step(self, global_step: int, *, taken: bool) -> None:
        """Saves the global step; after a take (`taken`), the gradients so far left
        with it: the next batch starts at the next gradient."""
        first = self.next if taken else self.first
        state = {"global_step": global_step, "first": first}
        _write_atomically(self.directory / _STATE, json.dumps(state).encode())
        if taken:
            self.first = first
            self._forget_before(first)

    def _forget_before(self, first: int) -> None:
        for seq in self._saved_seqs():
            if seq < first:
                self._grad_path(seq).unlink(missing_ok=True)
