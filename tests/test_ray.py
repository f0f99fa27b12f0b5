"""optax_accum.ray: the host accumulators in a Ray actor, driven from several processes
of one local Ray cluster (the session's `ray_cluster`, in conftest.py).

The differential tests run one random program of applies, takes and `set_global_step`
on the Ray object, each call issued from one of three processes (this one and two Ray
actors, `_ray_workers.Process`), and on the in-process object, and compare every
answer; a tree of leaves against an in-process object per leaf. The fault tests kill,
pause and interrupt real processes: a worker mid-apply, a chief blocked in a take, a
chief on "another node" whose lease lapses, the accumulator's actor (with and without
a checkpoint to resume from). Exactly once: a property test sends each push of a
random program once or several times, and Ray retries calls on a restarted actor.

Every wait is bounded (WAIT), so a bug fails instead of hanging.
"""

from __future__ import annotations

import _thread
import collections
import concurrent.futures
import gc
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ray = pytest.importorskip("ray")

import _cases  # noqa: E402
from _ray_workers import DIM, Process, data, host  # noqa: E402

import optax_accum  # noqa: E402
import optax_accum.ray as oray  # noqa: E402
from optax_accum.ray import _kinds, _payload, _spec  # noqa: E402
from optax_accum.ray._callers import LEASE  # noqa: E402

WAIT = 60.0  # seconds: the bound on any wait that should finish promptly (Ray is slow here)

pytestmark = pytest.mark.usefixtures("ray_cluster")


def wait_until(predicate, what="condition"):
    """Polls `predicate` (most often a call to an actor: a round trip through Ray, whose
    CPU every process involved pays) every 20 ms until it holds."""
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {WAIT} s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def processes(ray_cluster):
    """Four processes besides this one, started once for the module: the differential
    test's two other callers are the first two; the training test's four workers are
    all four (the first also its board). No test relies on what another left in them."""
    procs = [Process.remote() for _ in range(4)]
    ray.get([p.pid.remote() for p in procs])
    yield procs
    for p in procs:
        ray.kill(p)


def _dead(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _answers(acc):
    """Whether the actor answers (it may be restarting)."""
    try:
        acc.num_accumulated()
        return True
    except oray.AccumulatorUnavailableError:
        return False


# --------------------------------------------------------------------------- differential


def _gradient(rng, kind):
    if kind == "dense":
        return (rng.integers(-8, 9, size=2).astype(np.float32),)
    k = int(rng.integers(0, 4))
    indices = rng.choice(4, size=k, replace=False).astype(np.int32)
    return indices, rng.integers(-8, 9, size=(k, 2)).astype(np.float32)


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_random_program_from_three_processes_matches_in_process(processes, kind):
    rng = np.random.default_rng(30 + (kind == "sparse"))
    types_ = {
        "dense": (optax_accum.ConditionalAccumulator, oray.ConditionalAccumulator, (2,)),
        "sparse": (
            optax_accum.SparseConditionalAccumulator,
            oray.SparseConditionalAccumulator,
            (4, 2),
        ),
    }
    local_type, ray_type, shape = types_[kind]
    ref = local_type(np.float32, shape=shape)
    acc = ray_type(np.float32, shape=shape, shared_name=f"differential-{kind}")
    callers = [None, *processes[:2]]  # None: this process
    pool = concurrent.futures.ThreadPoolExecutor(4)
    ref_takes, ray_takes = [], []  # futures, in the order the takes were issued
    seen = {"queued take": 0, "stale": 0, "accepted": 0}

    def call(caller, method, *args, **kwargs):
        if caller is None:
            return host(getattr(acc, method)(*args, **kwargs))
        return ray.get(caller.call.remote(acc, method, *args, **kwargs))

    def issue_take(caller, n):
        ref_takes.append(pool.submit(ref.take_grad, n, WAIT))
        if caller is None:
            ray_takes.append(pool.submit(lambda: host(acc.take_grad(n, WAIT))))
        else:
            ray_takes.append(pool.submit(ray.get, caller.call.remote(acc, "take_grad", n, WAIT)))

    def settled():
        """Both have the same step, count and waiting takes, and completed the same takes."""
        ref_done = sum(f.done() for f in ref_takes)
        wait_until(lambda: sum(f.done() for f in ray_takes) == ref_done, "takes completed")
        wait_until(lambda: acc.num_waiting_takes() == ref.num_waiting_takes(), "takes queued")
        assert (acc.global_step, acc.num_accumulated()) == (ref.global_step, ref.num_accumulated())

    for _ in range(40):
        caller = callers[int(rng.integers(3))]
        op = rng.choice(["apply", "apply", "apply", "take", "step"])
        if op == "take" and ref.num_waiting_takes() < 2:
            n = int(rng.integers(1, 4))
            issue_take(caller, n)
            wait_until(lambda: ref_takes[-1].done() or ref.num_waiting_takes() > 0)
            seen["queued take"] += not ref_takes[-1].done()
        elif op == "step":
            step = ref.global_step + int(rng.integers(0, 3))
            ref.set_global_step(step)
            call(caller, "set_global_step", step)
        else:
            grad = _gradient(rng, kind)
            local_step = max(0, ref.global_step + int(rng.integers(-1, 2)))
            expected = ref.apply_grad(*grad, local_step=local_step)
            assert call(caller, "apply_grad", *grad, local_step=local_step) == expected
            seen["accepted" if expected else "stale"] += 1
        settled()
    while ref.num_waiting_takes():  # finish the waiting takes
        grad = _gradient(rng, kind)
        ref.apply_grad(*grad, local_step=ref.global_step)
        acc.apply_grad(*grad, local_step=acc.global_step)
        settled()
    assert len(ray_takes) >= 5 and min(seen.values()) >= 3, seen
    for mine, theirs in zip(ref_takes, ray_takes, strict=True):
        expected, got = host(mine.result()), theirs.result()
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    pool.shutdown()
    acc.kill()


def test_one_actor_holds_a_tree_and_takes_it_whole():
    """One accumulator for a model's gradient (a dict of float32 and bfloat16 leaves,
    given as ShapeDtypeStructs) and one for a tree of embedding tables: each leaf's
    answers are the in-process object's for that leaf, and a take returns every leaf
    of the same gradients."""
    params = {
        "w": jax.ShapeDtypeStruct((3, 2), jnp.float32),
        "b": jax.ShapeDtypeStruct((2,), jnp.bfloat16),
    }
    dense = oray.ConditionalAccumulator(params, shared_name="tree")
    assert dense.shape == {"w": (3, 2), "b": (2,)} and dense.dtype["b"] == jnp.bfloat16
    local = {k: optax_accum.ConditionalAccumulator(p.dtype, p.shape) for k, p in params.items()}
    tables = {"users": (6, 2), "items": (4, 3)}
    sparse = oray.SparseConditionalAccumulator(np.float32, shape=tables, reduction_type="MEAN")
    sparse_local = {
        k: optax_accum.SparseConditionalAccumulator(np.float32, s) for k, s in tables.items()
    }
    rng = np.random.default_rng(5)
    for step in range(3):
        for weight in (None, 3.0):
            grad = {k: rng.integers(-8, 9, size=p.shape).astype(p.dtype) for k, p in params.items()}
            assert dense.apply_grad(grad, step, weight=weight)
            for k, acc in local.items():
                assert acc.apply_grad(grad[k], step, weight=weight)
            rows = {
                k: rng.choice(s[0], size=2, replace=True).astype(np.int32)
                for k, s in tables.items()
            }
            values = {
                k: rng.integers(-8, 9, size=(2, *s[1:])).astype(np.float32)
                for k, s in tables.items()
            }
            slices = {
                k: optax_accum.IndexedSlices(rows[k], values[k], s) for k, s in tables.items()
            }
            assert sparse.apply_indexed_slices_grad(slices, step, weight=weight)
            for k, acc in sparse_local.items():
                assert acc.apply_grad(rows[k], values[k], local_step=step, weight=weight)
        got, want = (
            host(dense.take_grad(2, WAIT)),
            {k: host(a.take_grad(2)) for k, a in local.items()},
        )
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert got["b"].dtype == jnp.bfloat16
        taken = sparse.take_indexed_slices_grad(2, WAIT)
        for k, acc in sparse_local.items():
            expected = host(acc.take_grad(2))
            jax.tree.map(
                np.testing.assert_array_equal,
                host((taken[k].indices, taken[k].values)),
                expected[:2],
            )
            assert taken[k].dense_shape == expected[2]
    with pytest.raises(ValueError, match="tree structure"):
        dense.apply_grad({"w": np.zeros((3, 2), np.float32)})
    with pytest.raises(ValueError, match=r"grad\['w'\] must have a shape compatible"):
        dense.apply_grad({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match="already used by a ConditionalAccumulator"):
        oray.ConditionalAccumulator({"w": params["w"]}, shared_name="tree")
    assert dense.num_accumulated() == 0 and dense.global_step == sparse.global_step == 3
    dense.kill(), sparse.kill()


def test_the_actor_imports_no_jax():
    """The actor runs NumPy (`optax_accum` imports its names lazily, and the actor's
    modules import no JAX): no JAX library is mapped into its process, and it holds
    little memory besides the Ray worker's own (measured and stated in
    benchmarks/README.md; a JAX import alone would add about 120 MB)."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,))
    process = psutil.Process(acc._call("pid"))
    mapped = {m.path for m in process.memory_maps()}
    assert not [path for path in mapped if "jaxlib" in path or "/jax/" in path]
    assert process.memory_info().rss < 150 * 2**20
    acc.kill()


# --------------------------------------------------------------------------- sharing and ownership


def test_shared_name_finds_the_same_accumulator_and_checks_its_kind(processes):
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="shared")
    # Built by name in another process: the same accumulator.
    assert ray.get(processes[1].build_and_apply.remote("shared", np.ones(2, np.float32)))
    assert acc.num_accumulated() == 1
    with pytest.raises(ValueError, match="shared_name 'shared' is already used by a Cond"):
        oray.ConditionalAccumulator(np.float64, shape=(2,), shared_name="shared")
    with pytest.raises(ValueError, match="already used"):
        oray.SparseConditionalAccumulator(np.float32, shape=(2,), shared_name="shared")
    with pytest.raises(ValueError, match="already used"):
        oray.ConditionalAccumulator(np.float32, (2,), "shared", reduction_type="SUM")
    # Options other than the live actor's are refused, each named; left out, they are its.
    for option, value in (
        ("max_restarts", 2),
        ("lifetime", "non_detached"),
        ("checkpoint_dir", "/x"),
    ):
        with pytest.raises(ValueError, match=f"{option}=.*the live accumulator's"):
            oray.ConditionalAccumulator(np.float32, (2,), "shared", **{option: value})
    assert (
        oray.ConditionalAccumulator(
            np.float32, (2,), "shared", lifetime="detached"
        ).num_accumulated()
        == 1
    )
    acc.kill()


def test_a_named_accumulator_outlives_the_handles_and_the_process_that_made_it(processes):
    """A worker creates the accumulator, applies, and is killed; the chief's handle is
    dropped: the accumulator, its gradients and its step live on (it is detached,
    owned by no process), and a handle built by name reaches them."""
    creator = Process.remote()
    name = "outlives"
    assert ray.get(creator.build_and_apply.remote(name, np.full(2, 1.0, np.float32)))
    chief = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name=name)
    assert chief.apply_grad(np.full(2, 3.0, np.float32))
    np.testing.assert_array_equal(np.asarray(chief.take_grad(2, WAIT)), [2.0, 2.0])
    assert ray.get(processes[0].build_and_apply.remote(name, np.full(2, 5.0, np.float32), 1))
    os.kill(ray.get(creator.pid.remote()), signal.SIGKILL)
    del chief
    gc.collect()
    time.sleep(1.0)  # what an owner's death or a dropped handle would end, would be ended by now
    again = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name=name)
    assert (again.global_step, again.num_accumulated()) == (1, 1)
    np.testing.assert_array_equal(np.asarray(again.take_grad(1, WAIT)), [5.0, 5.0])
    again.kill()
    wait_until(lambda: name not in {a["name"] for a in ray.util.list_named_actors(True)}, "kill")


def test_a_handle_that_would_start_a_second_accumulator_in_another_namespace_warns():
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="namespaced")
    with pytest.warns(UserWarning, match="namespace='optax_accum' to reach the existing one"):
        other = oray.ConditionalAccumulator(np.float32, (2,), "namespaced", namespace="elsewhere")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one in its own namespace: no warning
        same = oray.ConditionalAccumulator(np.float32, (2,), "namespaced", namespace="elsewhere")
    assert same.apply_grad(np.ones(2, np.float32)) and acc.num_accumulated() == 0
    acc.kill(), other.kill()


def test_another_driver_reaches_a_named_accumulator_whatever_its_own_namespace():
    """A second driver (another job, started in its own Ray namespace) builds the
    handle by name, naming no namespace: it reaches this job's accumulator, since named
    accumulators live in the "optax_accum" namespace, not the job's."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="two-drivers")
    code = (
        "import numpy as np, ray, optax_accum.ray as oray\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace='job-two')\n"
        "acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name='two-drivers')\n"
        "print(acc.apply_grad(np.ones(2, np.float32)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT, check=True
    )
    assert out.stdout.split()[-1] == "True"
    assert acc.num_accumulated() == 1
    acc.kill()


def test_cancel_waiting_takes_releases_the_takes_of_every_process(processes):
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="cancelled")
    assert acc.apply_grad(np.ones(2, np.float32))
    elsewhere = processes[0].error.remote(acc, "take_grad", 3)
    wait_until(lambda: acc.num_waiting_takes() == 1, "the other process's take queued")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        here = pool.submit(acc.take_grad, 2)
        wait_until(lambda: acc.num_waiting_takes() == 2, "both takes queued")
        assert acc.cancel_waiting_takes() == 2
        with pytest.raises(concurrent.futures.CancelledError, match=r"take_grad\(2\) was cancel"):
            here.result(WAIT)
    error, message = ray.get(elsewhere, timeout=WAIT)
    assert error is concurrent.futures.CancelledError and "take_grad(3) was cancel" in message
    assert acc.num_accumulated() == 1 and acc.global_step == 0  # nothing consumed
    np.testing.assert_array_equal(np.asarray(acc.take_grad(1, WAIT)), [1.0, 1.0])
    acc.kill()


def test_any_number_of_takes_wait_and_are_cancelled():
    """Takes wait in the actor as coroutines, not in a pool of threads: 100 of them
    (each sent straight to the actor, from this process) are all counted, cancelled,
    and told so."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,))
    caller = oray._callers.Caller.this_process()
    refs = [
        acc._actor.take.remote(f"client-{i}", 1, f"ticket-{i}", 2, None, None, caller)
        for i in range(100)
    ]
    wait_until(lambda: acc.num_waiting_takes() == 100, "100 takes waiting")
    assert acc.cancel_waiting_takes() == 100
    outcomes = ray.get(refs, timeout=WAIT)
    assert all(isinstance(o.error, concurrent.futures.CancelledError) for o in outcomes)
    assert acc.num_waiting_takes() == 0
    acc.kill()


# --------------------------------------------------------------------------- payloads


def test_payloads_travel_as_host_numpy_the_large_by_reference(monkeypatch):
    array_type = type(jnp.zeros(1))
    conversions, puts, put = [], [], ray.put

    def counted(x, *args, **kwargs):
        conversions.append(x.shape)
        return np.asarray(x, *args, **kwargs)

    def never_pickled(self):
        raise AssertionError("a device array was pickled")

    class CountingNumPy(types.ModuleType):
        asarray = staticmethod(counted)

        def __getattr__(self, name):
            return getattr(np, name)

    monkeypatch.setattr(_payload, "np", CountingNumPy("numpy"))  # counts conversions
    monkeypatch.setattr(array_type, "__reduce__", never_pickled)
    monkeypatch.setattr(_payload.ray, "put", lambda x: puts.append(x) or put(x))
    big = (1 << 18,)  # 1 MB of float32
    acc = oray.ConditionalAccumulator(np.float32, shape=big)
    grad = jnp.arange(big[0], dtype=jnp.float32)
    assert acc.apply_grad(grad, local_step=jnp.int32(0))
    assert conversions == [big, ()]  # the gradient once, and the step
    assert len(puts) == 1 and isinstance(puts[0], np.ndarray) and puts[0].shape == big
    taken = acc.take_grad(jnp.int32(1), timeout=WAIT)
    assert isinstance(taken, jax.Array) and taken.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(taken), np.arange(big[0], dtype=np.float32))
    # A donated (deleted) array: the in-process ValueError, and nothing sent.
    donated = jnp.ones(big, jnp.float32)
    donated.delete()
    local = optax_accum.ConditionalAccumulator(np.float32, shape=big)
    with pytest.raises(ValueError, match="buffer was deleted") as expected:
        local.apply_grad(donated)
    with pytest.raises(ValueError) as got:
        acc.apply_grad(donated)
    assert str(got.value) == str(expected.value) and acc.num_accumulated() == 0
    acc.kill()

    # float64 comes back float64 (jax_enable_x64 is off), as from the in-process object.
    conversions.clear(), puts.clear()
    sparse = oray.SparseConditionalAccumulator(np.float64, shape=(4, 2))
    rows = np.array([[1.0, 1e-12], [2.0, 0.0]], np.float64)
    assert sparse.apply_grad(jnp.array([3, 1]), rows, (4, 2))
    assert len(conversions) == 1 and not puts  # the indices; values: NumPy, small: inline
    indices, values, shape = sparse.take_grad(1, timeout=WAIT)
    assert isinstance(indices, jax.Array) and isinstance(values, jax.Array)
    assert values.dtype == np.float64 and shape == (4, 2)
    local = optax_accum.SparseConditionalAccumulator(np.float64, shape=(4, 2))
    local.apply_grad(np.array([3, 1]), rows, (4, 2))
    jax.tree.map(
        np.testing.assert_array_equal, host((indices, values)), host(local.take_grad(1)[:2])
    )
    sparse.kill()


# --------------------------------------------------------------------------- bad input

DENSE_BAD = [
    ((np.ones(2, np.float64),), {}),  # dtype
    ((np.ones(3, np.float32),), {}),  # shape
    ((np.ones(2, np.float32),), {"local_step": 1.5}),  # a float step
    ((np.ones(2, np.float32),), {"local_step": "1"}),
    ((np.ones(2, np.float32),), {"local_step": True}),
    (("not an array",), {}),
    ((np.array([object(), object()]),), {}),
]
SPARSE_BAD = [
    (([0, 4], np.ones((2, 2), np.float32)), {}),  # row id out of range
    (([0, -1], np.ones((2, 2), np.float32)), {}),
    (([0, 1], np.ones((2, 2), np.float64)), {}),  # dtype
    (([0, 1], np.ones((2, 3), np.float32)), {}),  # row shape
    (([0.0, 1.0], np.ones((2, 2), np.float32)), {}),  # float ids
    (([0, 1], np.ones((2, 2), np.float32)), {"local_step": 2.0}),
]


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    raise AssertionError("no error")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_bad_input_is_rejected_in_the_actor_with_the_in_process_error(kind):
    if kind == "dense":
        local = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
        acc, cases = oray.ConditionalAccumulator(np.float32, shape=(2,)), DENSE_BAD
    else:
        local = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
        acc, cases = oray.SparseConditionalAccumulator(np.float32, shape=(4, 2)), SPARSE_BAD
    for args, kwargs in cases:
        expected = _error(lambda: local.apply_grad(*args, **kwargs))  # noqa: B023
        assert _error(lambda: acc.apply_grad(*args, **kwargs)) == expected  # noqa: B023
    for bad in (0, 1.5, "2", np.ones(2, np.int32)):
        expected = _error(lambda: local.take_grad(bad, timeout=1.0))  # noqa: B023
        assert _error(lambda: acc.take_grad(bad, timeout=1.0)) == expected  # noqa: B023
    for bad in (-1.0, float("nan"), "1"):
        expected = _error(lambda: local.take_grad(1, timeout=1.0, grace_period=bad))  # noqa: B023
        assert _error(lambda: acc.take_grad(1, 1.0, grace_period=bad)) == expected  # noqa: B023
    for bad in (-1.0, float("inf"), "2", np.ones(2, np.float32)):
        args = (np.ones(2, np.float32),) if kind == "dense" else ([0], np.ones((1, 2), np.float32))
        expected = _error(lambda: local.apply_grad(*args, weight=bad))  # noqa: B023
        assert _error(lambda: acc.apply_grad(*args, weight=bad)) == expected  # noqa: B023
    assert acc.num_accumulated() == 0 and acc.global_step == 0 and acc.num_waiting_takes() == 0
    with pytest.raises(TimeoutError, match="nothing was taken"):
        acc.take_grad(1, timeout=0.1)
    acc.kill()


# --------------------------------------------------------------------------- waits


def test_weights_and_a_grace_period_as_in_process(processes):
    """A weighted mean, and a take that waits 2 s past its quorum of 2 for a third
    gradient (sent by another process), then drops a late one: as in-process. (The
    sparse object: its weights are per row; the dense one's take the same path.)"""
    kind = "sparse"
    local = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    acc = oray.SparseConditionalAccumulator(np.float32, shape=(4, 2), shared_name="weighted")
    rng = np.random.default_rng(7)
    grads = [_gradient(rng, kind) for _ in range(4)]
    weights = [100, 300, 600.5, 50]
    answers = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for obj, remote in ((local, False), (acc, True)):
            taking = pool.submit(obj.take_grad, 2, WAIT, grace_period=2.0)
            wait_until(lambda: obj.num_waiting_takes() == 1, "the take queued")  # noqa: B023
            accepted = [
                obj.apply_grad(*g, local_step=0, weight=w)
                for g, w in zip(grads[:2], weights[:2], strict=True)
            ]
            if remote:  # the third from another process
                call = processes[0].call.remote(obj, "apply_grad", *grads[2], weight=weights[2])
                accepted.append(ray.get(call))
            else:
                accepted.append(obj.apply_grad(*grads[2], local_step=0, weight=weights[2]))
            assert not taking.done()  # in its grace window
            answers.append(host(taking.result(WAIT)))
            accepted.append(obj.apply_grad(*grads[3], local_step=0, weight=weights[3]))
            assert accepted == [True, True, True, False]
            assert obj.global_step == 1 and obj.num_accumulated() == 0
    jax.tree.map(np.testing.assert_array_equal, answers[1], answers[0])
    acc.kill()


def test_waits_past_the_longest_a_thread_can_wait_are_capped_as_in_process():
    """A timeout and a grace period of 1e10 s (past `threading.TIMEOUT_MAX`): the take
    waits, is served, or is cancelled, and the accumulator goes on."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(acc.take_grad, 1, 1e10)
        wait_until(lambda: acc.num_waiting_takes() == 1, "the take queued")
        assert acc.apply_grad(np.ones(2, np.float32))
        np.testing.assert_array_equal(np.asarray(first.result(WAIT)), [1.0, 1.0])
        windowed = pool.submit(acc.take_grad, 1, 1e10, grace_period=1e10)
        wait_until(lambda: acc.num_waiting_takes() == 1, "the take queued")
        assert acc.apply_grad(np.full(2, 2.0, np.float32), local_step=1)  # its grace begins
        assert acc.cancel_waiting_takes() == 1
        with pytest.raises(concurrent.futures.CancelledError):
            windowed.result(WAIT)
    assert (acc.global_step, acc.num_accumulated()) == (1, 1)
    np.testing.assert_array_equal(np.asarray(acc.take_grad(1, 1e10)), [2.0, 2.0])
    acc.kill()


# --------------------------------------------------------------------------- exactly once


def _core(kind):
    leaves = (_spec.Leaf("float32", (2,) if kind == "dense" else (4, 2), ""),)
    return _kinds.core_for(_spec.Spec(kind, leaves, None, "SUM", False))


@settings(max_examples=_cases.examples(25))
@given(data=st.data(), kind=st.sampled_from(["dense", "sparse"]))
def test_each_push_counts_once_however_often_it_arrives(data, kind):
    """A random program of pushes from three clients (stale ones among them), takes and
    step changes, in which a push arrives again (a retry after an ambiguous failure,
    Ray retrying it), an older one after a newer: every take's sum is the float64
    NumPy sum of the pushes accepted since the last take, each counted once, and a
    repeated push gets its first answer."""
    core = _core(kind)
    seqs, sent, first, pending, step = [0, 0, 0], [], {}, [], 0
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["push", "push", "push", "again", "take", "step"]))
        if op == "push" or (op == "again" and not sent):
            client = data.draw(st.integers(0, 2))
            seqs[client] += 1
            grad = _gradient(rng, kind)
            grad = grad if kind == "dense" else ((*grad, None),)
            push = (f"c{client}", seqs[client], step + data.draw(st.integers(-1, 1)), grad)
            sent.append(push)
            first[push[:2]] = core.apply(*push[:3], None, push[3])
            assert first[push[:2]] == (push[2] >= step)
            if first[push[:2]]:
                pending.append(push)
        elif op == "again":
            push = data.draw(st.sampled_from(sent))
            count = core.batch.count
            answer = core.apply(*push[:3], None, push[3])
            if seqs[int(push[0][1:])] == push[1]:  # the client's latest: its answer again
                assert answer == first[push[:2]]
            assert core.batch.count == count  # not counted again
        elif op == "take" and pending:
            _assert_sum(kind, core.take(len(pending), 0), pending)  # through the queue
            pending, step = [], step + 1
        elif op == "step":
            step += data.draw(st.integers(0, 1))
            core.global_step = step
    assert core.batch.count == len(pending)


def _assert_sum(kind, taken, pending):
    if kind == "dense":
        expected = sum((np.float64(p[3][0]) for p in pending), np.zeros(2))
        np.testing.assert_array_equal(taken[0], expected)
        return
    dense = np.zeros((4, 2))
    for p in pending:
        indices, values, _ = p[3][0]
        dense[indices] += values
    indices, values, _ = taken[0]
    touched = sorted({int(i) for p in pending for i in p[3][0][0]})
    assert indices.tolist() == touched
    np.testing.assert_array_equal(values, dense[touched])


def test_a_repeated_push_and_a_repeated_take_count_once():
    """Through Ray: the same push sent twice (a retry with its identity) counts once
    and gets its first answer; a take sent again gets the batch it was handed, not a
    second one."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), reduction_type="SUM")
    push = ("worker-0", 1, 0, None, np.ones(2, np.float32))
    assert ray.get(acc._actor.apply.remote(*push)).value is True
    assert ray.get(acc._actor.apply.remote(*push)).value is True
    assert acc.num_accumulated() == 1
    caller = oray._callers.Caller.this_process()
    take = ("chief", 1, "ticket", 1, WAIT, None, caller)
    first = ray.get(acc._actor.take.remote(*take), timeout=WAIT)
    assert acc.apply_grad(np.full(2, 5.0, np.float32), local_step=1)
    again = ray.get(acc._actor.take.remote(*take), timeout=WAIT)
    np.testing.assert_array_equal(again.value[0], first.value[0])
    assert (acc.global_step, acc.num_accumulated()) == (1, 1)
    acc.kill()


# --------------------------------------------------------------------------- faults


def test_a_worker_killed_mid_apply_loses_nothing_accepted_and_corrupts_nothing(tmp_path):
    acc = oray.ConditionalAccumulator(np.float64, shape=(2,), reduction_type="SUM")
    worker = Process.remote()
    log = tmp_path / "acknowledged"
    applying = worker.apply_until_killed.remote(acc, str(log), 50)
    wait_until(lambda: log.exists() and len(log.read_text().split()) >= 5, "five applies")
    os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(applying)
    acknowledged = [int(i) for i in log.read_text().split()]
    count = acc.num_accumulated()
    total = np.asarray(acc.take_grad(count, timeout=WAIT))
    # Gradient i is 2**i everywhere: the sum's bits name the gradients that were taken.
    taken = [i for i in range(50) if int(total[0]) >> i & 1]
    assert total[0] == total[1] == sum(2.0**i for i in taken)
    assert taken == list(range(count))  # each once, in order, none half-applied
    assert acknowledged == taken[: len(acknowledged)]
    assert count - len(acknowledged) in (0, 1)  # at most the one in flight
    acc.kill()


def test_a_chief_killed_while_blocked_in_a_take_consumes_nothing(processes):
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="orphaned-take")
    chief = Process.remote()
    pid = ray.get(chief.pid.remote())
    blocked = chief.call.remote(acc, "take_grad", 2)
    wait_until(lambda: acc.num_waiting_takes() == 1, "the chief's take queued")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _dead(pid), "the chief's death")
    # At once, before Ray has noticed: the actor checks the caller's process itself.
    assert acc.apply_grad(np.full(2, 1.0, np.float32))
    assert acc.apply_grad(np.full(2, 3.0, np.float32))
    assert acc.global_step == 0 and acc.num_accumulated() == 2
    assert acc.num_waiting_takes() == 0
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(blocked)
    np.testing.assert_array_equal(np.asarray(acc.take_grad(2, timeout=WAIT)), [2.0, 2.0])
    acc.kill()


def test_a_paused_chief_on_another_node_whose_lease_lapses_is_told_and_consumes_nothing():
    """A chief on "another node" (its liveness is a lease, here of 1 s) is paused
    (SIGSTOP) while blocked in a take; its gradients arrive after the lease lapsed:
    the take is dropped, the gradients stay, and the chief, resumed (SIGCONT), gets
    a TimeoutError that says so."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="lapsed")
    chief = Process.remote()
    pid = ray.get(chief.pid.remote())
    outcome = chief.take_from_afar.remote(acc, 2, 1.0)
    wait_until(lambda: acc.num_waiting_takes() == 1, "the chief's take queued")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # its last renewal, however late it reached the actor, is > 1 s old
        assert acc.apply_grad(np.full(2, 1.0, np.float32))
        assert acc.apply_grad(np.full(2, 3.0, np.float32))
        assert (acc.global_step, acc.num_accumulated(), acc.num_waiting_takes()) == (0, 2, 0)
    finally:
        os.kill(pid, signal.SIGCONT)
    error, message = ray.get(outcome, timeout=WAIT)
    assert error is TimeoutError and "lease" in message and "nothing was taken" in message
    np.testing.assert_array_equal(np.asarray(acc.take_grad(2, timeout=WAIT)), [2.0, 2.0])
    ray.kill(chief)
    acc.kill()


def test_an_interrupted_take_leaves_the_queue_and_consumes_nothing():
    """Ctrl-C in a blocked take (KeyboardInterrupt in the caller's main thread) withdraws
    it at once: the gradients that arrive next stay for the next take. Without the
    withdrawal the take stays queued while its caller's process lives (a lease covers
    only callers on other nodes), and the next gradients would complete it, with nobody
    to hand them to."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="interrupted-take")

    def interrupt_when_queued():
        wait_until(lambda: acc.num_waiting_takes() == 1, "the take queued")
        _thread.interrupt_main()  # as Ctrl-C does: KeyboardInterrupt in the main thread

    interrupter = threading.Thread(target=interrupt_when_queued)
    # Python's own SIGINT handler, which raises KeyboardInterrupt: a pytest-xdist worker
    # ignores SIGINT (its controller handles Ctrl-C), and then interrupt_main does
    # nothing. A timeout keeps a missed interrupt a failure, never a hang.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            acc.take_grad(2, timeout=WAIT)
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupter.join()
    start = time.monotonic()
    wait_until(lambda: acc.num_waiting_takes() == 0, "the take withdrawn")
    assert time.monotonic() - start < LEASE / 2  # withdrawn, not left to a lease
    assert acc.apply_grad(np.full(2, 1.0, np.float32))
    assert acc.apply_grad(np.full(2, 3.0, np.float32))
    assert acc.global_step == 0 and acc.num_accumulated() == 2
    np.testing.assert_array_equal(np.asarray(acc.take_grad(2, timeout=WAIT)), [2.0, 2.0])
    acc.kill()


def test_if_the_actor_dies_blocked_and_later_calls_raise_promptly():
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,))
    pid = acc._call("pid")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        blocked = [pool.submit(acc.take_grad, 1), pool.submit(acc.take_grad, 1, 1e6)]
        wait_until(lambda: acc.num_waiting_takes() == 2, "two takes queued")
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for future in blocked:
            with pytest.raises(oray.AccumulatorUnavailableError, match="died or is unreachable"):
                future.result(timeout=WAIT)
    assert time.monotonic() - start < WAIT
    with pytest.raises(oray.AccumulatorUnavailableError):
        acc.apply_grad(np.ones(2, np.float32))
    with pytest.raises(oray.AccumulatorUnavailableError):
        acc.num_accumulated()


def test_a_restarted_actor_resumes_from_its_checkpoint(tmp_path):
    # The sparse object's gradients are saved and replayed by the same code (its
    # checked arrays): the dense one stands for both here.
    kind = "dense"
    local = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc = oray.ConditionalAccumulator(
        np.float32, shape=(2,), checkpoint_dir=tmp_path, max_restarts=1
    )
    rng = np.random.default_rng(4)
    for obj in (local, acc):
        obj.set_global_step(2)
    for step in (2, 2, 1, 3):  # the third is stale
        grad = _gradient(rng, kind)
        assert acc.apply_grad(*grad, local_step=step) == local.apply_grad(*grad, local_step=step)
    jax.tree.map(
        np.testing.assert_array_equal, host(acc.take_grad(2, WAIT)), host(local.take_grad(2))
    )
    for _ in range(3):  # pending at the crash
        grad = _gradient(rng, kind)
        assert acc.apply_grad(*grad, local_step=3) and local.apply_grad(*grad, local_step=3)
    os.kill(acc._call("pid"), signal.SIGKILL)
    wait_until(lambda: _answers(acc), "the restarted actor")
    assert acc.global_step == local.global_step == 3
    assert acc.num_accumulated() == 3
    jax.tree.map(
        np.testing.assert_array_equal, host(acc.take_grad(3, WAIT)), host(local.take_grad(3))
    )
    assert acc.global_step == 4
    acc.kill()


def test_a_checkpoint_dir_belongs_to_one_accumulator_and_a_bad_one_says_why(tmp_path):
    """A checkpoint_dir in use by a live accumulator, one that holds another's
    checkpoint, and one that is a file: each refused with its cause (not a failure of
    the actor to start), and the name is free again."""
    first = oray.ConditionalAccumulator(np.float32, (2,), "first", checkpoint_dir=tmp_path)
    assert first.apply_grad(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="in use by another live accumulator"):
        oray.ConditionalAccumulator(np.float32, (2,), "second", checkpoint_dir=tmp_path)
    first.kill()
    with pytest.raises(ValueError, match="holds the checkpoint of the accumulator 'first'"):
        oray.ConditionalAccumulator(np.float32, (3,), "second", checkpoint_dir=tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(OSError, match="cannot be used as a directory"):
        oray.ConditionalAccumulator(np.float32, (2,), "second", checkpoint_dir=a_file)
    # The same name and spec resume the checkpoint; the failed starts left no actor.
    again = oray.ConditionalAccumulator(np.float32, (2,), "first", checkpoint_dir=tmp_path)
    assert again.num_accumulated() == 1
    names = {a["name"] for a in ray.util.list_named_actors(True)}
    assert "second" not in names
    again.kill()


def test_an_apply_that_cannot_be_logged_is_not_counted(tmp_path):
    """The checkpoint cannot be written (here: a directory where the gradient's file
    goes): the apply raises OSError and nothing is counted; retried once the disk is
    back, it counts once."""
    acc = oray.ConditionalAccumulator(np.float32, (2,), checkpoint_dir=tmp_path)
    assert acc.apply_grad(np.ones(2, np.float32))
    blocker = tmp_path / ".grad-000000000001.pkl.tmp"
    blocker.mkdir()
    with pytest.raises(OSError, match="grad-000000000001"):
        acc.apply_grad(np.full(2, 3.0, np.float32))
    assert acc.num_accumulated() == 1
    blocker.rmdir()
    assert acc.apply_grad(np.full(2, 3.0, np.float32))
    np.testing.assert_array_equal(np.asarray(acc.take_grad(2, WAIT)), [2.0, 2.0])
    acc.kill()


def _stopped(pids, stop):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)


def test_chaos_every_accepted_gradient_is_taken_exactly_once(processes, tmp_path):
    """Four workers and a chief, each its own process, on an accumulator with a
    checkpoint, while in turn a worker is SIGKILLed, a worker is paused (SIGSTOP, then
    SIGCONT), the chief is killed while blocked in a take and restarted, and the
    actor is SIGKILLed and restarted by Ray from its checkpoint. Each gradient is
    one-hot (SUM takes count each id they got): every gradient a worker saw accepted
    is taken exactly once, none it saw dropped is taken, one in flight when its worker
    died at most once, and every wait ends."""
    size, per_worker = 4096, 1024
    acc = oray.ConditionalAccumulator(
        np.float32,
        (size,),
        "chaos",
        reduction_type="SUM",
        checkpoint_dir=tmp_path / "ckpt",
        max_restarts=-1,
    )
    stop, chief_log = str(tmp_path / "stop"), str(tmp_path / "chief")
    killed = Process.remote()
    workers = [killed, *processes[1:4]]
    pids = ray.get([w.pid.remote() for w in workers])
    logs = [str(tmp_path / f"worker-{i}") for i in range(4)]
    pushing = [
        w.push.remote(acc, i * per_worker, per_worker, logs[i], stop) for i, w in enumerate(workers)
    ]
    chief = Process.remote()
    chiefs = [chief.chief.remote(acc, 2, chief_log, stop)]

    def takes():
        return (
            len(pathlib.Path(chief_log).read_text().splitlines())
            if os.path.exists(chief_log)
            else 0
        )

    def progress(what, more=10):
        start = takes()
        wait_until(lambda: takes() >= start + more, what)

    progress("takes before any fault")
    os.kill(pids[0], signal.SIGKILL)  # a worker dies, maybe mid-apply
    progress("takes after a worker's death")
    _stopped(pids[1:2], True)  # a worker paused, then resumed
    progress("takes while a worker is paused")
    _stopped(pids[1:2], False)
    # The chief dies while blocked in a take: the workers are paused until no gradient
    # is on its way (the counters stay put for a second: an apply sent before the pause
    # may still be writing its file), and resumed once the chief is dead, not merely
    # signalled (a process tearing itself down still runs, and a take handed its batch
    # then would be lost with it: no caller can be guarded against dying after it is
    # answered). So its take cannot be served meanwhile.
    chief_pid = ray.get(chief.pid.remote())
    _stopped(pids[1:], True)
    settled = [None]

    def blocked():
        now = (acc.num_accumulated(), acc.num_dropped)
        if now != settled[0]:
            settled[0], settled[1:] = now, [time.monotonic()]
            return False
        quiet = time.monotonic() - settled[1] > 1.0
        return quiet and now[0] < 2 and acc.num_waiting_takes() == 1

    wait_until(blocked, "chief blocked")
    os.kill(chief_pid, signal.SIGKILL)
    wait_until(lambda: _dead(chief_pid), "chief dead")
    _stopped(pids[1:], False)
    chief = Process.remote()  # restarted: its handle by name, the same log
    chiefs.append(
        chief.chief.remote(
            oray.ConditionalAccumulator(np.float32, (size,), "chaos", reduction_type="SUM"),
            2,
            chief_log,
            stop,
        )
    )
    progress("takes by the restarted chief")
    os.kill(acc._call("pid"), signal.SIGKILL)  # the actor dies; Ray restarts it
    progress("takes after the actor's restart")
    pathlib.Path(stop).touch()
    ray.get(pushing[1:] + chiefs[1:], timeout=WAIT)
    counts = collections.Counter()
    for line in pathlib.Path(chief_log).read_text().splitlines():
        for item in line.split():
            k, times = item.split(":")
            counts[int(k)] += int(times)
    left = acc.num_accumulated()
    if left:
        for k in np.flatnonzero(np.asarray(acc.take_grad(left, WAIT))):
            counts[int(k)] += 1
    answers = {}
    for log in logs:
        for line in pathlib.Path(log).read_text().splitlines():
            k, accepted = line.split()
            answers[int(k)] = accepted == "1"
    accepted = [k for k, a in answers.items() if a]
    assert len(accepted) > 60 and sum(not a for a in answers.values()) > 0
    wrong = {k: counts[k] for k in accepted if counts[k] != 1}
    assert not wrong, wrong  # taken exactly once
    assert all(counts[k] == 0 for k, a in answers.items() if not a)  # dropped: never taken
    unanswered = set(counts) - set(answers)  # sent when its worker died: at most once
    assert all(counts[k] == 1 for k in unanswered) and len(unanswered) <= 1
    acc.kill()
    ray.kill(chief)


# --------------------------------------------------------------------------- training

STEPS, LEARNING_RATE = 6, 0.05


def test_four_asynchronous_workers_and_a_chief_match_the_in_process_accumulator(processes):
    """Four worker processes (the module's) at their own paces, and this one the chief."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(DIM,), shared_name="async-training")
    params = np.zeros(DIM, np.float32)
    board = processes[0]
    ray.get(board.publish.remote(0, params))
    delays = (0.0, 0.02, 0.05, 0.3)  # the last one is mostly stale
    workers = [
        p.train.remote(acc, board, seed, d)
        for p, seed, d in zip(processes, range(4), delays, strict=True)
    ]
    taken = []
    for step in range(STEPS):
        taken.append(np.asarray(acc.take_grad(2, timeout=WAIT)))
        params = params - np.float32(LEARNING_RATE) * taken[-1]
        ray.get(board.publish.remote(step + 1, params, done=step + 1 == STEPS))
    logs = ray.get(workers, timeout=WAIT)
    # The in-process accumulator, fed each step's accepted gradients, takes the same.
    local = optax_accum.ConditionalAccumulator(np.float32, shape=(DIM,))
    replayed = np.zeros(DIM, np.float32)
    for step in range(STEPS):
        batch = [g for log in logs for s, g, accepted in log if accepted and s == step]
        for grad in batch:
            assert local.apply_grad(grad, local_step=step)
        expected = np.asarray(local.take_grad(len(batch)))
        np.testing.assert_array_equal(taken[step], expected)
        replayed = replayed - np.float32(LEARNING_RATE) * expected
    np.testing.assert_array_equal(params, replayed)
    dropped = sum(not accepted for log in logs for _, _, accepted in log)
    assert dropped >= 1 and dropped == acc.num_dropped
    x, y = data(0)
    assert np.mean((x @ params - y) ** 2) < np.mean(y**2)  # it learned
    acc.kill()


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax_accum.conditional_accumulator(optax.sgd(0.1), 2),
        lambda: optax_accum.drop_stale_gradients(optax.sgd(0.1), 2),
        lambda: optax_accum.drop_stale_gradients(
            optax_accum.conditional_accumulator(optax.sgd(0.1), 2), 2
        ),
        lambda: optax_accum.agn(optax.sgd(0.1), 2),
        lambda: optax_accum.sparse_conditional_accumulator(
            optax_accum.sparse_sgd(0.1), 2, capacity=4
        ),
    ],
    ids=["conditional_accumulator", "drop_stale", "drop_stale_of_accumulator", "agn", "sparse"],
)
def test_a_transform_travels_to_ray_actors_by_cloudpickle(make):
    """Ray sends what an actor's methods close over (a `tx` built in the driver's
    `__main__`) by cloudpickle; the unpickled transform steps as the original does."""
    from ray import cloudpickle

    tx = make()
    copy = cloudpickle.loads(cloudpickle.dumps(tx))
    params, grad = jnp.zeros((4, 2)), jnp.ones((4, 2))
    for t in (tx, copy):
        state = t.init(params)
        for _ in range(2):
            updates, state = t.update(grad, state, params, local_step=0, weight=1.0)
        if t is tx:
            expected = updates
    np.testing.assert_array_equal(updates, expected)
