"""Two processes x 4 CPU devices (jax.distributed, gloo) end where one process x 8 does.

The worker (tests/multihost_worker.py) runs cross_shard_optimizer with and without
groups, the shared conditional_accumulator with stragglers, a few steps of a small
Flax model, and an FSDP run under `jax.jit` with explicit sharding on a (data=2,
fsdp=4) mesh spanning both processes (drop_stale_gradients around a
conditional_accumulator of Adam, with stale steps). Both processes must finish with
the parameters this process computes for the same program on its 8 devices; the FSDP
run must also equal the same steps on one device in float64, and each process must
hold only its 4 shards of every param-shaped state leaf. The children are killed if
anything goes wrong.
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

from optax_accum import _compat

WORKER = Path(__file__).with_name("multihost_worker.py")
TIMEOUT = 100  # seconds for both children together
# The shard of each FSDP param on one device of the (data=2, fsdp=4) mesh.
FSDP_SHARDS = {"w": (4, 8), "v": (2, 2), "b": (4,)}  # P("fsdp"), P("fsdp", "data"), P()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path: Path) -> list[Path]:
    port = _free_port()
    env = {
        **os.environ,
        # As conftest.py sets for this process: XLA:CPU's code unoptimised (the same
        # results; LLVM's optimisation of these tiny programs costs more than it saves).
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
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
    expected, _ = multihost_worker.program()
    loaded = [dict(np.load(p)) for p in outs]
    per_process = [{k: v for k, v in d.items() if not k.startswith("shards ")} for d in loaded]
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

    _check_fsdp(per_process, expected)
    for d in loaded:
        _check_fsdp_shards({k[7:]: v for k, v in d.items() if k.startswith("shards ")})


def _check_fsdp(per_process, expected):
    """The FSDP run on 2 processes equals the same steps on one device (float64)."""
    with _compat.enable_x64():
        params, state = multihost_worker.train_fsdp(None)
    flat, _ = jax.tree_util.tree_flatten_with_path({"params": params, "state": state})
    one_device = {f"['fsdp']{jax.tree_util.keystr(p)}": np.asarray(v) for p, v in flat}
    assert sorted(one_device) == sorted(k for k in expected if k.startswith("['fsdp']"))
    for got in per_process:
        for key, value in one_device.items():
            assert got[key].dtype == value.dtype, key
            np.testing.assert_allclose(got[key], value, rtol=1e-9, atol=1e-12, err_msg=key)
    # The run drops the lag-3 step whole; the accumulator releases twice (an Adam
    # step each) from the 5 it is given, and holds the last.
    state = "['fsdp']['state']"
    assert one_device[f"{state}.num_dropped"] == 1
    assert one_device[f"{state}.inner_state.global_step"] == 2
    assert one_device[f"{state}.inner_state.count"] == 1


def _check_fsdp_shards(shapes):
    """Each process holds 4 shards of every FSDP param and param-shaped state leaf,
    each of the param's shard shape; the state's scalars are replicated."""
    mirrored = dict.fromkeys(FSDP_SHARDS, 0)
    for key, rows in shapes.items():
        name = key.rsplit("['", 1)[1][:-2] if key.endswith("']") else None
        assert rows.shape[0] == 4, (key, rows)
        if name in FSDP_SHARDS:
            assert {tuple(r) for r in rows} == {FSDP_SHARDS[name]}, (key, rows)
            mirrored[name] += 1
        else:
            assert rows.shape[1] == 0, (key, rows)  # a scalar: shape () on every device
    # The param, the accumulator's sum and Adam's two moments, at least.
    assert all(count >= 4 for count in mirrored.values()), mirrored
