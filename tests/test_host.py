"""Threads and the host accumulators: parallel applies, blocking takes, shared_name
(optax_accum/host/_core.py), and a stress test. The take queue's own tests (FIFO,
deadlines, cancellation, interrupts) are in test_host_takes.py.

Every wait is bounded: futures and joins have timeouts, and `wait_until` polls a
condition for at most WAIT seconds, so a bug fails instead of hanging. No assertion
depends on timing: each checks an outcome that every interleaving must produce.
"""

import contextlib
import gc
import random
import threading
import uuid

import numpy as np
import pytest
from _host import WAIT, dense, f32, sparse, wait_until

import optax_accum


def row_grad(x):
    """The sparse gradient diag(x, x) as rows {0: [x, 0], 1: [0, x]}."""
    return [0, 1], f32([[x, 0], [0, x]])


# -------------------------------------------------------------- docs/semantics.md vectors


@pytest.mark.parametrize("make", [dense, sparse])
@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_parallel_applies(pool, make, reduction):
    acc = make(reduction)
    barrier = threading.Barrier(10, timeout=WAIT)

    def worker(x):
        barrier.wait()
        return acc.apply_grad(f32(x)) if make is dense else acc.apply_grad(*row_grad(x))

    futures = [pool.submit(worker, x) for x in range(10, 101, 10)]
    assert all(f.result(timeout=WAIT) for f in futures)
    x = 55.0 if reduction == "MEAN" else 550.0
    if make is dense:
        assert float(acc.take_grad(1, timeout=WAIT)) == x
        return
    indices, values, shape = acc.take_grad(1, timeout=WAIT)
    assert np.asarray(indices).tolist() == [0, 1] and shape == (2, 2)
    np.testing.assert_array_equal(values, [[x, 0], [0, x]])


@pytest.mark.parametrize("make", [dense, sparse])
def test_concurrent_takes_against_sequential_applies(pool, make):
    acc = make()
    futures = [pool.submit(acc.take_grad, 1, WAIT) for _ in range(10)]
    wait_until(lambda: acc.num_waiting_takes() == 10)
    for e in range(10):  # gradient e computed at step e: each completes one take
        if make is dense:
            assert acc.apply_grad(f32(e), local_step=e)
        else:
            assert acc.apply_grad([1], f32([[e, e]]), local_step=e)
    results = [f.result(timeout=WAIT) for f in futures]
    if make is dense:
        got = sorted(float(r) for r in results)
    else:
        got = sorted(float(values[0, 0]) for _, values, _ in results)
    assert got == list(range(10))
    assert acc.global_step == 10


def test_blocking_take_released_by_applies_dense(pool):
    acc = dense()
    future = pool.submit(acc.take_grad, 3, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    acc.apply_grad(f32(10))
    acc.apply_grad(f32(20))
    assert not future.done() and acc.num_accumulated() == 2  # two of three: still waiting
    acc.apply_grad(f32(30))
    # The take fired inside that apply: the step has moved before the taker wakes.
    assert acc.global_step == 1 and acc.num_accumulated() == 0
    assert not acc.apply_grad(f32(99), local_step=0)
    assert float(future.result(timeout=WAIT)) == 20.0


def test_blocking_take_released_by_applies_sparse(pool):
    acc = sparse()
    future = pool.submit(acc.take_grad, 3, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    for x in (10, 20, 30):
        assert not future.done()
        acc.apply_grad([0], f32([[0, x]]))
    indices, values, _ = future.result(timeout=WAIT)
    assert np.asarray(indices).tolist() == [0]
    np.testing.assert_array_equal(values, [[0, 20]])


# --------------------------------------------------------------------------- shared_name


def test_shared_name_shares_one_accumulator(pool):
    name = f"shared-{uuid.uuid4()}"
    learner = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), shared_name=name)
    actor = optax_accum.ConditionalAccumulator(
        "float32", shape=[2], shared_name=name, name="actor", reduction_type="mean"
    )
    assert actor.accumulator_ref is learner.accumulator_ref
    assert actor.name == "actor" and learner.name == "conditional_accumulator"
    future = pool.submit(learner.take_grad, 2, WAIT)
    wait_until(lambda: actor.num_waiting_takes() == 1)
    actor.apply_grad(f32([1, 2]))
    actor.apply_grad(f32([3, 4]))
    np.testing.assert_array_equal(future.result(timeout=WAIT), [2, 3])
    assert actor.global_step == learner.global_step == 1
    alone = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), shared_name="")
    assert alone.accumulator_ref is not learner.accumulator_ref


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (optax_accum.ConditionalAccumulator, {"dtype": np.float64}),
        (optax_accum.ConditionalAccumulator, {"shape": (3,)}),
        (optax_accum.ConditionalAccumulator, {"shape": None}),
        (optax_accum.ConditionalAccumulator, {"reduction_type": "SUM"}),
        (optax_accum.ConditionalAccumulator, {"skip_nonfinite": True}),
        (optax_accum.SparseConditionalAccumulator, {}),
    ],
)
def test_shared_name_mismatch(cls, kwargs):
    name = f"shared-{uuid.uuid4()}"
    first = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), shared_name=name)
    first.apply_grad(f32([1, 1]))
    args = {"dtype": np.float32, "shape": (2,), **kwargs}
    with pytest.raises(ValueError, match=f"shared_name '{name}' is already used by a "):
        cls(shared_name=name, **args)
    assert first.num_accumulated() == 1


def test_shared_name_is_released_with_its_last_object():
    name = f"shared-{uuid.uuid4()}"
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), shared_name=name)
    acc.apply_grad(f32([1, 1]))
    del acc
    gc.collect()
    fresh = optax_accum.ConditionalAccumulator(np.float64, shared_name=name)
    assert fresh.num_accumulated() == 0


@pytest.mark.parametrize(
    "cls", [optax_accum.ConditionalAccumulator, optax_accum.SparseConditionalAccumulator]
)
def test_an_accumulator_built_in_a_thread_that_ended_serves_every_other(pool, cls):
    # As in a Ray actor whose methods run on a pool of threads: nothing belongs to the
    # thread that built the object, and a shared_name finds it from any thread.
    name = f"shared-{uuid.uuid4()}"
    built = {}
    builder = threading.Thread(
        target=lambda: built.update(acc=cls(np.float64, shape=(2, 1), shared_name=name))
    )
    builder.start()
    builder.join()
    same = pool.submit(cls, np.float64, shape=(2, 1), shared_name=name).result(timeout=WAIT)
    assert same.accumulator_ref is built["acc"].accumulator_ref

    def apply(i):
        grad = np.array([[i], [1e-17]])  # float64 only: lost in float32 next to i
        if cls is optax_accum.ConditionalAccumulator:
            return same.apply_grad(grad, weight=i)
        return same.apply_grad([0, 1], grad, weight=i)

    taken = pool.submit(built["acc"].take_grad, 4, WAIT, grace_period=0.01)
    assert all(pool.map(apply, [1, 2, 3, 4]))
    out = taken.result(timeout=WAIT)
    values = np.asarray(out[1] if isinstance(out, tuple) else out)
    assert values.dtype == np.float64
    np.testing.assert_allclose(values[:, 0], [30 / 10, 1e-17], rtol=1e-12)


# --------------------------------------------------------------------------- stress


@pytest.mark.parametrize("make", [dense, sparse])
def test_stress_nothing_lost(pool, make):
    """8 threads x 200 applies while a taker takes with random sizes and timeouts.

    SUM of integer-valued floats is exact, so the takes plus the remainder must add
    up to exactly what was applied, and the step must count the takes.
    """
    threads, applies = 8, 200
    acc = make("SUM")
    is_dense = make is dense

    def worker(seed):
        rng = random.Random(seed)
        total = 0
        for _ in range(applies):
            x = rng.randint(1, 9)
            total += x
            # A far-future step: never stale, however the takes advance the step.
            if is_dense:
                assert acc.apply_grad(f32(x), local_step=10**9)
            else:
                assert acc.apply_grad([1, 0], f32([[1, 0], [x, 1]]), local_step=10**9)
        return total

    stop = threading.Event()

    def taker():
        rng = random.Random(0)
        taken = []
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                taken.append(acc.take_grad(rng.randint(1, 16), timeout=rng.choice([0, 0.002])))
        return taken

    taker_future = pool.submit(taker)
    totals = [pool.submit(worker, s) for s in range(threads)]
    expected = sum(f.result(timeout=WAIT * 3) for f in totals)
    stop.set()
    taken = taker_future.result(timeout=WAIT)
    if acc.num_accumulated():
        taken.append(acc.take_grad(acc.num_accumulated(), timeout=WAIT))
    if is_dense:
        got = sum(float(t) for t in taken)
    else:  # row 0 carries [x, 1]: its sums are the total and the number of applies
        sums = np.sum([np.asarray(v)[list(np.asarray(i)).index(0)] for i, v, _ in taken], 0)
        got = float(sums[0])
        assert int(sums[1]) == threads * applies
    assert got == expected
    assert acc.global_step == len(taken) and acc.num_accumulated() == 0
