"""A fixture's result computed once per test session, shared by pytest-xdist's workers."""

from __future__ import annotations

import fcntl
import os
import pathlib
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import pytest


def once(
    tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[pathlib.Path], Any]
) -> Any:
    """`compute(root)` once per session, in a fresh temporary directory `root`.

    pytest-xdist gives each worker its own module fixtures, so without this every worker
    that runs one of the module's tests would compute the result again. Under xdist, the
    first worker to take the lock computes it and leaves it (pickled) in the session's
    shared temporary directory; the others wait for the lock and read it.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by workers
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        result = shared / f"{name}_result.pkl"
        if not result.exists():
            root = pathlib.Path(tempfile.mkdtemp(prefix=name, dir=shared))
            result.write_bytes(pickle.dumps(compute(root)))
        return pickle.loads(result.read_bytes())
