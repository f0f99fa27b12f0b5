"""Training survives SIGKILL: restarted from its Orbax checkpoint, it ends bit-identical.

One real subprocess (tests/preemption_worker.py) trains one Case of tests/_cases.py
per transform family (`preemption_worker.CASE_NAMES`; tests/test_orbax.py restores
these and the cases left out here in a fresh process, and every launch here re-traces
each case it trains), checkpointing params and optimizer state with Orbax after each
step. The test kills it with SIGKILL at seeded random steps after a checkpoint, once
while it waits and once while it is running the next step (possibly mid checkpoint
write), restarts it each time, and lets it finish. Every case's final params and state
must be bit-identical to an uninterrupted run of the same steps (which the first
process runs before training). Every wait on the subprocess is bounded, and it is
killed in `finally`.

The worker processes share a persistent XLA compilation cache in the session's temporary
directory (`orbax_worker.compile_cache_dir`), so a restart does not recompile what the
first process compiled (a restart then costs less than half the CPU), and
tests/test_orbax.py's fresh process reads the same cache for the cases both train.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import queue
import random
import signal
import subprocess
import sys
import threading

import _session
import jax
import orbax_worker
import pytest
from preemption_worker import CASE_NAMES

TOTAL = 8
SEED = 20261122
WAIT = 240.0  # seconds: the bound on any line from the worker (the first one compiles)
WORKER = pathlib.Path(__file__).with_name("preemption_worker.py")


def _kill_plan() -> dict[int, str]:
    """Checkpoint step -> where the kill lands: "waiting", or "running" the next step."""
    first, second = sorted(random.Random(SEED).sample(range(1, TOTAL - 1), 2))
    return {first: "waiting", second: "running"}


class _Worker:
    """One worker process whose stdout lines are read with a bounded wait."""

    def __init__(self, args: list[str], env: dict[str, str], log: pathlib.Path) -> None:
        # stderr goes to a file: a pipe nobody reads would fill up and block the worker.
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                cwd=WORKER.parent,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"worker silent for {WAIT} s") from None
        if line is None:
            self.proc.wait(timeout=WAIT)
            raise AssertionError(f"worker exited {self.proc.returncode}: {self.stderr()}")
        return line

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=WAIT)
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()

    def stderr(self) -> str:
        return self.log.read_text()[-4000:]


def train_with_kills(root: pathlib.Path, cache: pathlib.Path) -> dict:
    """Runs the worker under `root` to the end, killing and restarting it per the plan;
    its launches share the XLA compilation cache `cache`."""
    env = {
        **os.environ,
        "JAX_NUM_CPU_DEVICES": str(jax.device_count()),
        "JAX_NUMPY_DTYPE_PROMOTION": jax.config.jax_numpy_dtype_promotion,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    args = [str(root / "checkpoints"), str(root), str(TOTAL)]
    plan = _kill_plan()
    restored, killed = [], []
    worker = None
    try:
        for launch in range(len(plan) + 1):
            worker = _Worker(args, env, root / f"worker_{launch}.log")
            line = worker.next_line()
            assert line.startswith("restored "), line
            restored.append(int(line.split()[1]))
            while (line := worker.next_line()) != "done":
                step = int(line.removeprefix("saved "))
                if step in plan and step not in killed:
                    if plan[step] == "running":
                        worker.send("go")
                    worker.kill()
                    assert worker.proc.returncode == -signal.SIGKILL
                    killed.append(step)
                    break
                worker.send("go")
            else:
                worker.proc.wait(timeout=WAIT)
                assert worker.proc.returncode == 0, worker.stderr()
                break
    finally:
        if worker is not None:
            worker.kill()
    return {
        "plan": plan,
        "killed": killed,
        "restored": restored,
        "reference": pickle.loads((root / "reference.pkl").read_bytes()),
        "final": pickle.loads((root / "final.pkl").read_bytes()),
    }


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory) -> dict:
    """The run, once per session: under pytest-xdist the workers share one result."""
    cache = orbax_worker.compile_cache_dir(tmp_path_factory)
    return _session.once(tmp_path_factory, "preemption", lambda root: train_with_kills(root, cache))


def test_killed_at_every_planned_step_and_restarted_from_a_checkpoint(preempted_run):
    plan, killed, restored = (
        preempted_run["plan"],
        preempted_run["killed"],
        preempted_run["restored"],
    )
    assert killed == sorted(plan)
    assert restored[0] == 0 and len(restored) == len(plan) + 1
    for step, resumed in zip(killed, restored[1:], strict=True):
        # Killed while waiting: resumes exactly there. Killed while running the next
        # step: resumes there or one later, if that checkpoint was complete.
        assert resumed == step if plan[step] == "waiting" else resumed in (step, step + 1)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_final_params_and_state_bit_identical_to_an_uninterrupted_run(preempted_run, name):
    want, got = preempted_run["reference"][name], preempted_run["final"][name]
    assert got.keys() == want.keys()
    assert any("params" in key for key in want)
    for key in want:
        assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
        assert got[key].tobytes() == want[key].tobytes(), f"{name}{key}: {got[key]} != {want[key]}"
