"""optax_accum.ray: the host accumulators in a named Ray actor, driven from several
processes of one local Ray cluster (the session's `ray_cluster`, in conftest.py).

The differential test runs one random program of applies, takes and
`set_global_step` on the Ray object, each call issued from one of three processes
(this one and two Ray actors), and on the in-process object, and compares every
answer. The fault tests kill real processes: a worker mid-apply, a chief blocked in a
take, the accumulator's actor (with and without a checkpoint to resume from).
"""

from __future__ import annotations

import _thread
import concurrent.futures
import os
import signal
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest

ray = pytest.importorskip("ray")

import optax_accum  # noqa: E402
import optax_accum.ray as oray  # noqa: E402
from optax_accum.ray import _payload  # noqa: E402
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


@ray.remote(max_concurrency=8)
class Process:
    """Another process of the cluster, calling a handle's methods for the test.

    It also runs an asynchronous worker (`train`) and can be the board the chief
    publishes its parameters on (`publish`, `read`) for the training test, so those
    run in the module's processes rather than in five more (each a fresh Python that
    imports JAX and this module).
    """

    def __init__(self):
        self.board = None

    def call(self, handle, method, *args, **kwargs):
        return jax.device_get(getattr(handle, method)(*args, **kwargs))

    def pid(self):
        return os.getpid()

    def build_and_apply(self, shared_name, grad):
        acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name=shared_name)
        return acc.apply_grad(grad)

    def apply_until_killed(self, handle, log_path, n):
        """Applies gradient i = 2**i (for i < n), logging each acknowledged one."""
        for i in range(n):
            grad = np.full(2, 2.0**i, np.float64)
            assert handle.apply_grad(grad, local_step=0)
            with open(log_path, "a") as log:
                log.write(f"{i}\n")
        return n

    def publish(self, step, params, done=False):
        self.board = (step, params, done)

    def read(self):
        return self.board

    def train(self, acc, board, seed, delay):
        """Computes gradients on its own data with a jitted step, at its own pace, and
        sends them tagged with the step of the parameters it read from `board` (a
        Process); returns its log."""
        x, y = _data(seed)

        @jax.jit
        def gradient(params):
            g = jax.grad(lambda p: jnp.mean((x @ p - y) ** 2))(params)
            # On a grid of 2**-10 (and bounded): sums of a few are exact in any order.
            return jnp.round(jnp.clip(g, -64, 64) * 1024) / 1024

        log = []
        while True:
            step, params, done = ray.get(board.read.remote())
            if done:
                return log
            grad = np.asarray(gradient(params))
            time.sleep(delay)
            log.append((step, grad, acc.apply_grad(grad, local_step=step)))


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


def _host(x):
    return jax.tree.map(np.asarray, jax.device_get(x))


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
    types = {
        "dense": (optax_accum.ConditionalAccumulator, oray.ConditionalAccumulator, (2,)),
        "sparse": (
            optax_accum.SparseConditionalAccumulator,
            oray.SparseConditionalAccumulator,
            (4, 2),
        ),
    }
    local_type, ray_type, shape = types[kind]
    ref = local_type(np.float32, shape=shape)
    acc = ray_type(np.float32, shape=shape, shared_name=f"differential-{kind}")
    callers = [None, *processes[:2]]  # None: this process
    pool = concurrent.futures.ThreadPoolExecutor(4)
    ref_takes, ray_takes = [], []  # futures, in the order the takes were issued
    seen = {"queued take": 0, "stale": 0, "accepted": 0}

    def call(caller, method, *args, **kwargs):
        if caller is None:
            return _host(getattr(acc, method)(*args, **kwargs))
        return ray.get(caller.call.remote(acc, method, *args, **kwargs))

    def issue_take(caller, n):
        ref_takes.append(pool.submit(ref.take_grad, n, WAIT))
        if caller is None:
            ray_takes.append(pool.submit(lambda: _host(acc.take_grad(n, WAIT))))
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
        expected, got = _host(mine.result()), theirs.result()
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    pool.shutdown()
    acc.kill()


# --------------------------------------------------------------------------- sharing


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
    acc.kill()


def test_cancel_waiting_takes_releases_the_takes_of_every_process(processes):
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="cancelled")
    assert acc.apply_grad(np.ones(2, np.float32))
    elsewhere = processes[0].call.remote(acc, "take_grad", 3)
    wait_until(lambda: acc.num_waiting_takes() == 1, "the other process's take queued")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        here = pool.submit(acc.take_grad, 2)
        wait_until(lambda: acc.num_waiting_takes() == 2, "both takes queued")
        assert acc.cancel_waiting_takes() == 2
        with pytest.raises(concurrent.futures.CancelledError, match=r"take_grad\(2\) was cancel"):
            here.result(WAIT)
    with pytest.raises(concurrent.futures.CancelledError, match=r"take_grad\(3\) was cancel"):
        ray.get(elsewhere)
    assert acc.num_accumulated() == 1 and acc.global_step == 0  # nothing consumed
    np.testing.assert_array_equal(np.asarray(acc.take_grad(1, WAIT)), [1.0, 1.0])
    acc.kill()


# --------------------------------------------------------------------------- payloads


def test_payloads_travel_as_host_numpy_the_large_by_reference(monkeypatch):
    array_type = type(jnp.zeros(1))
    conversions, puts, put = [], [], ray.put

    def counted(x):
        conversions.append(x.shape)
        return np.asarray(x)

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
        np.testing.assert_array_equal, _host((indices, values)), _host(local.take_grad(1)[:2])
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


# --------------------------------------------------------------------------- beyond TF


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
            answers.append(_host(taking.result(WAIT)))
            accepted.append(obj.apply_grad(*grads[3], local_step=0, weight=weights[3]))
            assert accepted == [True, True, True, False]
            assert obj.global_step == 1 and obj.num_accumulated() == 0
    jax.tree.map(np.testing.assert_array_equal, answers[1], answers[0])
    acc.kill()


# --------------------------------------------------------------------------- faults


def _dead(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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


def test_an_interrupted_take_leaves_the_queue_and_consumes_nothing():
    """Ctrl-C in a blocked take (KeyboardInterrupt in the caller's main thread) withdraws
    it at once: the gradients that arrive next stay for the next take. Without the
    withdrawal the take stays queued while its caller's process lives (a lease covers
    only callers on other nodes), and the next gradients would complete it, with nobody
    to hand them to (checked: with the withdrawal removed, this test fails)."""
    acc = oray.ConditionalAccumulator(np.float32, shape=(2,), shared_name="interrupted-take")

    def interrupt_when_queued():
        wait_until(lambda: acc.num_waiting_takes() == 1, "the take queued")
        _thread.interrupt_main()  # as Ctrl-C does: KeyboardInterrupt in the main thread

    interrupter = threading.Thread(target=interrupt_when_queued)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        acc.take_grad(2)
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
    # The sparse object's gradients are saved and replayed by the same code (the
    # in-process method's name and arguments): the dense one stands for both here.
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
        np.testing.assert_array_equal, _host(acc.take_grad(2, WAIT)), _host(local.take_grad(2))
    )
    for _ in range(3):  # pending at the crash
        grad = _gradient(rng, kind)
        assert acc.apply_grad(*grad, local_step=3) and local.apply_grad(*grad, local_step=3)
    os.kill(acc._call("pid"), signal.SIGKILL)

    def answers():
        try:
            return acc.num_accumulated() == 3
        except oray.AccumulatorUnavailableError:
            return False

    wait_until(answers, "the restarted actor")
    assert acc.global_step == local.global_step == 3
    jax.tree.map(
        np.testing.assert_array_equal, _host(acc.take_grad(3, WAIT)), _host(local.take_grad(3))
    )
    assert acc.global_step == 4
    acc.kill()


# --------------------------------------------------------------------------- training

DIM, ROWS, STEPS, LEARNING_RATE = 8, 32, 6, 0.05


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    return x, (x @ np.linspace(-1, 1, DIM, dtype=np.float32)).astype(np.float32)


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
    x, y = _data(0)
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
