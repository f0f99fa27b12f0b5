"""The queue of takes (optax_accum/host/_takes.py) through the public objects: FIFO,
deadlines, cancellation, `num_required` values, and interrupts.

Every wait is bounded: futures and joins have timeouts, and `wait_until` polls a
condition for at most WAIT seconds, so a bug fails instead of hanging. No assertion
depends on timing: each checks an outcome that every interleaving must produce.

The interrupt tests raise KeyboardInterrupt, through a trace function, at each line
in turn that the package runs during one call, in the calling thread only: the line
where a real Ctrl-C would land is any of them.
"""

import concurrent.futures
import dis
import functools
import pathlib
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from _host import WAIT, dense, f32, sparse, wait_until

import optax_accum
import optax_accum.host

HOST = pathlib.Path(optax_accum.host.__file__)
HOST_CODE = str(HOST.parent if HOST.name == "__init__.py" else HOST)


# --------------------------------------------------------------------------- FIFO


def test_head_of_line_blocking(pool):
    acc = dense("SUM")
    first = pool.submit(acc.take_grad, 3, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    second = pool.submit(acc.take_grad, 1, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 2)
    acc.apply_grad(f32(1))  # enough for the later take(1), which must still wait
    assert acc.num_waiting_takes() == 2 and acc.num_accumulated() == 1
    assert not first.done() and not second.done()
    acc.apply_grad(f32(2))
    acc.apply_grad(f32(3))
    assert float(first.result(timeout=WAIT)) == 6.0
    assert not second.done() and acc.num_waiting_takes() == 1
    acc.apply_grad(f32(7), local_step=1)
    assert float(second.result(timeout=WAIT)) == 7.0
    assert acc.global_step == 2


def test_timed_out_head_lets_the_next_take_through(pool):
    # Whatever the interleaving, take(1) gets the one gradient and take(3) times out.
    acc = dense()
    head = pool.submit(acc.take_grad, 3, 0.3)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    behind = pool.submit(acc.take_grad, 1, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 2 or head.done())
    acc.apply_grad(f32(5))
    assert isinstance(head.exception(timeout=WAIT), TimeoutError)
    assert float(behind.result(timeout=WAIT)) == 5.0
    assert acc.global_step == 1 and acc.num_waiting_takes() == 0


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("make", [dense, sparse])
def test_timeout_leaves_no_trace(make):
    acc = make()

    def apply(step=0):
        if make is dense:
            return acc.apply_grad(f32(4), local_step=step)
        return acc.apply_grad([1], f32([[4, 4]]), local_step=step)

    apply()
    with pytest.raises(TimeoutError, match=r"take_grad\(2\) timed out"):
        acc.take_grad(2, timeout=0.05)
    assert (acc.global_step, acc.num_accumulated(), acc.num_waiting_takes()) == (0, 1, 0)
    apply()
    apply()  # the abandoned take(2) must not have consumed these
    assert (acc.global_step, acc.num_accumulated()) == (0, 3)
    out = acc.take_grad(3, timeout=0)
    first = float(out) if make is dense else float(out[1][0, 0])
    assert first == 4.0 and acc.global_step == 1


def test_timeout_zero_and_bad_timeouts():
    acc = dense()
    with pytest.raises(TimeoutError):
        acc.take_grad(1, timeout=0)
    acc.apply_grad(f32(2))
    for bad, error in [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError)]:
        with pytest.raises(error, match="timeout must be None or"):
            acc.take_grad(1, timeout=bad)
    for bad, error in [(1.5, TypeError), (True, TypeError), (0, ValueError)]:
        with pytest.raises(error, match="num_required must be"):
            acc.take_grad(bad, timeout=0)
    assert (acc.num_accumulated(), acc.num_waiting_takes()) == (1, 0)
    assert float(acc.take_grad(1, timeout=0)) == 2.0


# --------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("make", [dense, sparse])
def test_cancel_waiting_takes(pool, make):
    acc = make()
    if make is dense:
        acc.apply_grad(f32(3))
    else:
        acc.apply_grad([0], f32([[3, 3]]))
    futures = [pool.submit(acc.take_grad, 5, WAIT) for _ in range(3)]
    wait_until(lambda: acc.num_waiting_takes() == 3)
    assert acc.cancel_waiting_takes() == 3
    for f in futures:
        error = f.exception(timeout=WAIT)
        assert isinstance(error, concurrent.futures.CancelledError)
        assert "cancelled while waiting" in str(error)
    assert (acc.num_waiting_takes(), acc.num_accumulated(), acc.global_step) == (0, 1, 0)
    assert acc.cancel_waiting_takes() == 0
    out = acc.take_grad(1, timeout=WAIT)  # still usable, the gradient still there
    assert float(out if make is dense else out[1][0, 0]) == 3.0


@pytest.mark.parametrize("timeout", [None, float("inf"), 1e300, 10 * threading.TIMEOUT_MAX])
def test_unbounded_and_huge_timeouts_wait_for_the_gradients(pool, timeout):
    acc = dense()
    future = pool.submit(acc.take_grad, 1, timeout)
    wait_until(lambda: acc.num_waiting_takes() == 1 or future.done())
    assert not future.done(), future.exception()
    acc.apply_grad(f32(7))
    assert float(future.result(timeout=WAIT)) == 7.0


def test_huge_timeout_on_a_served_take_and_inf_is_not_a_bad_timeout():
    acc = dense()
    acc.apply_grad(f32(3))
    assert float(acc.take_grad(1, timeout=float("inf"))) == 3.0
    with pytest.raises(ValueError, match="timeout must be None or >= 0"):
        acc.take_grad(1, timeout=float("-inf"))


# --------------------------------------------------------------------------- num_required


@pytest.mark.parametrize("make", [dense, sparse])
@pytest.mark.parametrize(
    "n", [np.array(2), np.array(2, np.int64), jnp.array(2), jnp.array(2, jnp.uint8), np.int16(2)]
)
def test_num_required_may_be_a_0d_integer_array(make, n):
    acc = make()
    for _ in range(2):
        if make is dense:
            acc.apply_grad(f32(4))
        else:
            acc.apply_grad([0], f32([[4, 4]]))
    out = acc.take_grad(n, timeout=WAIT)
    assert float(out if make is dense else out[1][0, 0]) == 4.0
    assert acc.global_step == 1


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (np.array([2]), TypeError, r"num_required must be a positive int, got array\(\[2\]\)"),
        (jnp.array(2.0), TypeError, "num_required must be a positive int, got Array"),
        (np.array(True), TypeError, "num_required must be a positive int"),
        (np.array(0), ValueError, "num_required must be positive, but was 0"),
        (jnp.array(-3), ValueError, "num_required must be positive, but was -3"),
    ],
)
def test_bad_num_required_arrays_change_nothing(bad, error, match):
    acc = dense()
    acc.apply_grad(f32(5))
    with pytest.raises(error, match=match):
        acc.take_grad(bad, timeout=0)
    assert (acc.num_accumulated(), acc.num_waiting_takes(), acc.global_step) == (1, 0, 0)


# --------------------------------------------------------------------------- grace period


def _grad(acc, value, step=0):
    if isinstance(acc, optax_accum.SparseConditionalAccumulator):
        return acc.apply_grad([0], f32([[value, value]]), local_step=step)
    return acc.apply_grad(f32(value), local_step=step)


def _value(out):
    return float(out[1][0, 0]) if isinstance(out, tuple) else float(out)


@pytest.mark.parametrize("make", [dense, sparse])
def test_a_grace_period_takes_the_stragglers_that_arrive_in_it(pool, make):
    acc = make("SUM")
    start = time.monotonic()
    future = pool.submit(acc.take_grad, 2, WAIT, grace_period=0.5)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    _grad(acc, 1)
    _grad(acc, 2)  # the quorum: the take waits on, still at the head
    assert not future.done() and acc.num_waiting_takes() == 1 and acc.global_step == 0
    assert _grad(acc, 4)  # a straggler computed at step 0: accepted into this take
    assert _value(future.result(timeout=WAIT)) == 7.0
    assert time.monotonic() - start >= 0.5
    assert (acc.global_step, acc.num_accumulated(), acc.num_waiting_takes()) == (1, 0, 0)
    assert not _grad(acc, 8)  # stale once the take completed


def test_a_grace_period_without_stragglers_takes_the_quorum_after_it():
    acc = dense()
    acc.apply_grad(f32(3))
    start = time.monotonic()
    assert float(acc.take_grad(1, timeout=0, grace_period=0.03)) == 3.0
    assert time.monotonic() - start >= 0.03
    acc.apply_grad(f32(5), local_step=1)
    assert float(acc.take_grad(1, timeout=0, grace_period=0)) == 5.0  # 0: none, as TF
    assert acc.global_step == 2


def test_timeout_bounds_the_quorum_only_and_consumes_nothing():
    acc = dense("SUM")
    acc.apply_grad(f32(1))
    with pytest.raises(TimeoutError, match=r"take_grad\(2\) timed out"):
        acc.take_grad(2, timeout=0.02, grace_period=0.5)
    assert (acc.global_step, acc.num_accumulated(), acc.num_waiting_takes()) == (0, 1, 0)
    # Reached before the timeout: the grace period runs past it and the take completes.
    start = time.monotonic()
    assert float(acc.take_grad(1, timeout=0.01, grace_period=0.05)) == 1.0
    assert time.monotonic() - start >= 0.05 and acc.global_step == 1


def test_a_later_take_waits_behind_a_grace_period(pool):
    acc = dense("SUM")
    first = pool.submit(acc.take_grad, 1, WAIT, grace_period=0.3)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    second = pool.submit(acc.take_grad, 1, WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 2)
    acc.apply_grad(f32(1))  # the head's quorum; the later take(1) must still wait
    acc.apply_grad(f32(2))
    assert not first.done() and not second.done()
    assert float(first.result(timeout=WAIT)) == 3.0
    assert not second.done() and acc.num_waiting_takes() == 1
    acc.apply_grad(f32(7), local_step=1)
    assert float(second.result(timeout=WAIT)) == 7.0
    assert acc.global_step == 2


@pytest.mark.parametrize("make", [dense, sparse])
def test_cancel_waiting_takes_ends_a_grace_period_consuming_nothing(pool, make):
    acc = make()
    _grad(acc, 3)
    future = pool.submit(acc.take_grad, 1, WAIT, grace_period=WAIT)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    _grad(acc, 5)
    assert acc.cancel_waiting_takes() == 1
    assert isinstance(future.exception(timeout=WAIT), concurrent.futures.CancelledError)
    assert (acc.global_step, acc.num_accumulated(), acc.num_waiting_takes()) == (0, 2, 0)
    assert _value(acc.take_grad(2, timeout=0)) == 4.0


def test_set_global_step_during_a_grace_period(pool):
    # The step moves on mid-window: gradients older than it are dropped, newer ones
    # join the take, which then advances the step from where it was set.
    acc = dense("SUM")
    acc.apply_grad(f32(1))
    future = pool.submit(acc.take_grad, 1, WAIT, grace_period=0.3)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    acc.set_global_step(5)
    assert not acc.apply_grad(f32(10), local_step=0)
    assert acc.apply_grad(f32(100), local_step=5)
    assert float(future.result(timeout=WAIT)) == 101.0
    assert (acc.global_step, acc.num_dropped) == (6, 1)


def test_an_apply_after_the_grace_period_hands_the_take_over(pool):
    # Whoever holds the lock after the window ends hands the batch over: an apply that
    # comes before the taker's thread wakes is the take's last gradient; one after it
    # finds the step advanced, and is stale. Either way, exactly once.
    acc = dense("SUM")
    future = pool.submit(acc.take_grad, 1, WAIT, grace_period=0.02)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    acc.apply_grad(f32(1))
    time.sleep(0.03)
    accepted = acc.apply_grad(f32(2))
    assert float(future.result(timeout=WAIT)) == (3.0 if accepted else 1.0)
    assert (acc.global_step, acc.num_accumulated(), acc.num_dropped) == (1, 0, int(not accepted))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1", True, [1]])
def test_bad_grace_periods_change_nothing(bad):
    acc = dense()
    acc.apply_grad(f32(2))
    error = TypeError if isinstance(bad, str | bool | list) else ValueError
    with pytest.raises(error, match="grace_period must be None or"):
        acc.take_grad(1, timeout=0, grace_period=bad)
    assert (acc.num_accumulated(), acc.num_waiting_takes(), acc.global_step) == (1, 0, 0)


# --------------------------------------------------------------------------- interrupts


@functools.cache
def _with_exits(code):
    """Offsets where a `with` block calls `__exit__` (`None, None, None`, then the call).

    A line event fires there, but a real KeyboardInterrupt cannot land between the block
    and that call (CPython checks for signals at calls, not before them): skipped.
    """
    ins = list(dis.get_instructions(code))
    return {
        ins[k].offset
        for k in range(len(ins) - 3)
        if all(i.opname == "LOAD_CONST" and i.argval is None for i in ins[k : k + 3])
        and ins[k + 3].opname in ("PRECALL", "CALL")
        and ins[k + 3].arg == 2
    }


class Interrupt:
    """Raises KeyboardInterrupt at the `n`-th line the host package runs in this thread."""

    def __init__(self, n):
        self.n, self.seen, self.fired = n, 0, False

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc_info):
        sys.settrace(None)

    def _call(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(HOST_CODE) else None

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired and frame.f_lasti not in _with_exits(frame.f_code):
            self.seen += 1
            if self.seen == self.n:
                self.fired = True
                raise KeyboardInterrupt
        return self._line


def _every_line(run):
    """Calls `run(Interrupt(n))` for n = 1, 2, ... until a call runs uninterrupted."""
    for n in range(1, 1000):
        interrupt = run(Interrupt(n))
        if not interrupt.fired:
            return n - 1
    raise AssertionError("the call never finished")


def _apply(acc, value, step=0, as_jax=False):
    """Applies [value, 1] (a count column: SUM takes count their gradients)."""
    grad = f32([value, 1])
    if isinstance(acc, optax_accum.SparseConditionalAccumulator):
        rows = jnp.asarray(grad[None]) if as_jax else grad[None]
        return acc.apply_grad([1], rows, local_step=step)
    return acc.apply_grad(jnp.asarray(grad) if as_jax else grad, local_step=step)


def _taken(out):
    if isinstance(out, tuple):  # sparse: the one row
        return np.asarray(out[1])[0].tolist()
    return np.asarray(out).tolist()


def _assert_consistent(acc):
    """The count matches the aggregate: a SUM take of everything counts as many."""
    count = acc.num_accumulated()
    _apply(acc, 1000, step=10**6)
    assert _taken(acc.take_grad(count + 1, timeout=0))[1] == count + 1


def _make(kind):
    shape = (2,) if kind == "dense" else (2, 2)
    cls = {
        "dense": optax_accum.ConditionalAccumulator,
        "sparse": optax_accum.SparseConditionalAccumulator,
    }[kind]
    return cls(np.float32, shape=shape, reduction_type="SUM")


@pytest.mark.parametrize(
    ("kind", "as_jax", "grace"),
    [
        ("dense", False, None),
        ("dense", True, None),
        ("sparse", False, None),
        ("dense", False, 0.01),
    ],
)
def test_an_interrupted_apply_never_orphans_the_take_it_completes(kind, as_jax, grace):
    """A take waits for 2 gradients; the apply that brings the second is interrupted at
    each line in turn. The take must get its result (from that gradient, or from a
    later one tagged with the same step) or time out at its deadline: never hang, never
    fail otherwise; and the counter must match the aggregate afterwards. With a grace
    period, the interrupted apply may be the one that starts it."""
    # Seconds. Each take the interrupt orphans waits it out (5 lines of the sparse apply,
    # 1 of the dense one with a JAX gradient), so it is kept short. A take that is not
    # orphaned gets its gradients within milliseconds of the late apply; if a loaded
    # machine ever made it time out, that is an outcome this test accepts anyway.
    deadline = 0.5

    def run(interrupt):
        acc = _make(kind)
        _apply(acc, 1, as_jax=as_jax)
        outcome = {}

        def taker():
            start = time.monotonic()
            try:
                outcome["result"] = _taken(acc.take_grad(2, timeout=deadline, grace_period=grace))
            except BaseException as e:
                outcome["error"], outcome["after"] = e, time.monotonic() - start

        thread = threading.Thread(target=taker, daemon=True)
        thread.start()
        wait_until(lambda: acc.num_waiting_takes() == 1)
        try:
            with interrupt:
                _apply(acc, 10, as_jax=as_jax)
        except KeyboardInterrupt:
            assert interrupt.fired
        late = _apply(acc, 100, as_jax=as_jax)  # accepted only if the take still waits
        thread.join(WAIT)
        assert not thread.is_alive(), f"take still waiting after an interrupt at line {interrupt.n}"
        if "error" in outcome:  # only the deadline may end it
            assert isinstance(outcome["error"], TimeoutError), (interrupt.n, outcome["error"])
            assert outcome["after"] >= deadline
        else:
            # Late and accepted: the interrupted gradient was left out, or counted with a
            # hand-off undone (then the take gets all three, as TF's MEAN would).
            expected = ([101, 2], [111, 3]) if late else ([11, 2],)
            if grace is not None:  # the late one may also come in the window, or after
                expected = ([11, 2], [101, 2], [111, 3])
            assert outcome["result"] in expected, interrupt.n
            assert acc.global_step == 1
        assert acc.num_waiting_takes() == 0
        _assert_consistent(acc)
        return interrupt

    assert _every_line(run) > 10


@pytest.mark.parametrize(("kind", "grace"), [("dense", None), ("sparse", None), ("dense", 0.01)])
def test_an_interrupted_taker_never_orphans_the_take_behind_it(kind, grace):
    """Take A is interrupted at each line in turn (while queueing, waiting, being served,
    sitting out its grace period or reducing); take B, behind it, must still get a
    gradient, and nothing is counted twice or lost from the accumulator."""

    def run(interrupt):
        acc = _make(kind)
        outcome = {}

        def first():
            try:
                with interrupt:
                    outcome["a"] = _taken(acc.take_grad(1, timeout=WAIT, grace_period=grace))
            except KeyboardInterrupt:
                assert interrupt.fired
                outcome["a"] = None

        def second():
            outcome["b"] = _taken(acc.take_grad(1, timeout=WAIT))

        a = threading.Thread(target=first, daemon=True)
        a.start()
        wait_until(lambda: acc.num_waiting_takes() == 1 or not a.is_alive())
        b = threading.Thread(target=second, daemon=True)
        b.start()
        wait_until(lambda: acc.num_waiting_takes() == (2 if a.is_alive() else 1))
        _apply(acc, 1, step=10**6)
        a.join(WAIT)
        _apply(acc, 10, step=10**6)
        b.join(WAIT)
        assert not a.is_alive() and not b.is_alive(), f"a take hangs (line {interrupt.n})"
        assert outcome["b"] in ([1, 1], [10, 1]), interrupt.n
        if outcome["a"] is not None:
            assert sorted([outcome["a"], outcome["b"]]) == [[1, 1], [10, 1]]
        assert acc.num_waiting_takes() == 0
        _assert_consistent(acc)
        return interrupt

    assert _every_line(run) > 10
