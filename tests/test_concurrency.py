"""Stress: host accumulators under concurrent applies, takes, step changes and timeouts.

Each round, 8 threads apply 200 gradients each (60 to the sparse accumulator, where
each apply dispatches a device scatter: 480 a round still keep all 8 racing the takes
and the stepper, and the test checks that timeouts, takes served while applies run and
stale drops all happen), tagged with the current global step, the one before (stale)
or the one after (future), while 2 threads take with random
`num_required` and short timeouts (many time out) and 1 thread raises the global step
with `set_global_step`. Gradients carry integer values (exact in float32) and a
count column, and integer weights (or none), with SUM reduction, so the takes must add
up exactly to the weighted sum of what the applies report as accepted: nothing lost,
nothing counted twice, no gradient taken by a take that timed out. Some takes wait out
a short grace period after their quorum. Every wait is bounded (takes have timeouts,
joins a limit), so a deadlock fails the test instead of hanging it. 10 rounds run in
one test.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import optax_accum

ROUNDS = 10  # each a fresh accumulator and random interleaving (every event seen in several)
APPLIERS = 8
APPLIES = 200  # per applier and round (dense)
SPARSE_APPLIES = 60  # per applier and round (sparse: each apply dispatches a scatter)
TAKERS = 2
ROWS = 8
WAIT = 30.0  # seconds: the bound on any join or final take

pytestmark = pytest.mark.filterwarnings("ignore:set_global_step")


class _Round:
    """One round's threads and their records; `run` returns what the takes returned."""

    def __init__(
        self, acc: Any, seed: int, apply_one: Callable, take_one: Callable, applies: int
    ) -> None:
        self.acc, self.seed, self.applies = acc, seed, applies
        self.apply_one, self.take_one = apply_one, take_one
        self.accepted: list[list[tuple[int, int, int]]] = [[] for _ in range(APPLIERS)]
        self.rejected = [0] * APPLIERS
        self.taken: list[Any] = []
        self.timeouts = 0
        self.errors: list[BaseException] = []
        self.appliers_done = threading.Event()
        self.lock = threading.Lock()

    def _guard(self, fn: Callable) -> Callable:
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # reported by the test thread
                self.errors.append(e)

        return run

    def _applier(self, t: int) -> None:
        rng = random.Random(self.seed * 100 + t)
        for j in range(self.applies):
            value = t * 1000 + j + 1  # unique per gradient, exact in float32 sums
            row = rng.randrange(ROWS)
            step = self.acc.global_step + rng.choice([0, 0, 0, 0, -1, 1])
            weight = rng.choice([None, None, 0, 1, 2, 3])
            if self.apply_one(self.acc, value, row, step, weight):
                self.accepted[t].append((value, row, 1 if weight is None else weight))
            else:
                self.rejected[t] += 1

    def _taker(self, t: int) -> None:
        rng = random.Random(self.seed * 100 + 50 + t)
        while not self.appliers_done.is_set():
            try:
                got = self.take_one(
                    self.acc,
                    rng.randint(1, 6),
                    rng.choice([0.0, 1e-4, 2e-3]),
                    rng.choice([None, None, 0.0, 1e-3]),
                )
            except TimeoutError:
                with self.lock:
                    self.timeouts += 1
                continue
            with self.lock:
                self.taken.append(got)

    def _stepper(self) -> None:
        rng = random.Random(self.seed * 100 + 99)
        while not self.appliers_done.is_set():
            self.acc.set_global_step(self.acc.global_step + rng.choice([0, 1]))
            self.appliers_done.wait(1e-3)

    def run(self) -> None:
        appliers = [
            threading.Thread(target=self._guard(self._applier), args=(t,), daemon=True)
            for t in range(APPLIERS)
        ]
        others = [
            threading.Thread(target=self._guard(self._taker), args=(t,), daemon=True)
            for t in range(TAKERS)
        ] + [threading.Thread(target=self._guard(self._stepper), daemon=True)]
        for thread in appliers + others:
            thread.start()
        for thread in appliers:
            thread.join(WAIT)
        self.appliers_done.set()
        for thread in others:
            thread.join(WAIT)
        stuck = [thread for thread in appliers + others if thread.is_alive()]
        assert not stuck, f"{len(stuck)} thread(s) still running after {WAIT} s: deadlock?"
        assert not self.errors, self.errors
        left = self.acc.num_accumulated()
        if left:
            self.taken.append(self.take_one(self.acc, left, WAIT))
        assert self.acc.num_accumulated() == 0 and self.acc.num_waiting_takes() == 0


def _check_round(r: _Round, totals: Callable[[list], np.ndarray], expected: np.ndarray) -> None:
    accepted = [a for per_thread in r.accepted for a in per_thread]
    assert len(accepted) + sum(r.rejected) == APPLIERS * r.applies
    assert r.acc.num_dropped == sum(r.rejected)  # every rejection was a stale drop
    np.testing.assert_array_equal(totals(r.taken), expected)


def _exercised(r: _Round) -> np.ndarray:
    """Whether the round saw a timed-out take, takes served while applies ran, a drop."""
    return np.array([r.timeouts > 0, len(r.taken) > 1, sum(r.rejected) > 0], int)


def _dense_apply(acc, value, row, step, weight) -> bool:
    return acc.apply_grad(np.array([value, 1.0], np.float32), local_step=step, weight=weight)


def _dense_take(acc, n, timeout, grace=None):
    return np.asarray(acc.take_grad(n, timeout=timeout, grace_period=grace), np.float64)


def _sparse_apply(acc, value, row, step, weight) -> bool:
    rows = np.array([[value, 1.0], [1.0, 0.0]], np.float32)
    return acc.apply_grad([row, (row + 1) % ROWS], rows, local_step=step, weight=weight)


def _sparse_take(acc, n, timeout, grace=None):
    indices, values, _ = acc.take_grad(n, timeout=timeout, grace_period=grace)
    dense = np.zeros((ROWS, 2))
    np.add.at(dense, np.asarray(indices), np.asarray(values, np.float64))
    return dense


def test_dense_accumulator_stress_10_rounds():
    exercised = np.zeros(3, int)  # rounds with timeouts, concurrent takes, stale drops
    for seed in range(ROUNDS):
        acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), reduction_type="SUM")
        r = _Round(acc, seed, _dense_apply, _dense_take, APPLIES)
        r.run()
        accepted = [(v, w) for per_thread in r.accepted for v, _, w in per_thread]
        expected = np.array([sum(v * w for v, w in accepted), sum(w for _, w in accepted)], float)
        _check_round(r, lambda taken: np.sum(taken, axis=0), expected)
        exercised += _exercised(r)
    assert np.all(exercised > 0), exercised


def test_sparse_accumulator_stress_10_rounds():
    exercised = np.zeros(3, int)  # rounds with timeouts, concurrent takes, stale drops
    for seed in range(ROUNDS):
        acc = optax_accum.SparseConditionalAccumulator(
            np.float32, shape=(ROWS, 2), reduction_type="SUM"
        )
        r = _Round(acc, seed, _sparse_apply, _sparse_take, SPARSE_APPLIES)
        r.run()
        expected = np.zeros((ROWS, 2))
        for per_thread in r.accepted:
            for value, row, weight in per_thread:
                expected[row] += [weight * value, weight]
                expected[(row + 1) % ROWS] += [weight, 0.0]
        _check_round(r, lambda taken: np.sum(taken, axis=0), expected)
        exercised += _exercised(r)
    assert np.all(exercised > 0), exercised
