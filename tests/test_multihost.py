"""Two processes x 4 CPU devices (jax.distributed, gloo) end where one process x 8 does.

The worker (tests/multihost_worker.py) runs cross_shard_optimizer with and without
groups, the shared conditional_accumulator with stragglers, and a few steps of a small
Flax model. Both processes must finish with the parameters this process computes for
the same program on its 8 devices. The children are killed if anything goes wrong.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import multihost_worker
import numpy as np

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT = 100  # seconds for both children together


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path: Path) -> list[Path]:
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    outs = [tmp_path / f"process{i}.npz" for i in range(2)]
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i in range(2):
            with open(logs[i], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), str(i), str(port), str(outs[i])],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=WORKER.parent,
                    )
                )
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        tail = "\n".join(f"--- process {i}:\n{logs[i].read_text()[-3000:]}" for i in range(2))
        raise AssertionError(f"workers failed (exit codes {codes}, timeout {TIMEOUT}s)\n{tail}")
    return outs


def test_two_processes_end_with_the_single_process_parameters(tmp_path):
    outs = _run_workers(tmp_path)
    assert len(jax.devices()) == 8
    expected = multihost_worker.program()
    per_process = [dict(np.load(p)) for p in outs]
    for got in per_process:
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            # The same arithmetic; gloo may add the 8 replicas in another order.
            np.testing.assert_allclose(got[key], value, rtol=2e-6, atol=1e-7, err_msg=key)
    for key in expected:  # the two processes hold the very same values
        np.testing.assert_array_equal(per_process[0][key], per_process[1][key], err_msg=key)
    counters = {k: v for k, v in expected.items() if "counters" in k}
    assert int(counters["['accumulator_counters']['num_dropped']"]) == 3
    groups = expected["['cross_shard_groups']['w']"]
    for g in multihost_worker.GROUPS:  # replicas agree within a group, groups differ
        assert all(np.array_equal(groups[g[0]], groups[r]) for r in g)
    assert not np.allclose(groups[0], groups[1])
