"""Malformed calls to the host accumulators get a clear error and change nothing.

HOST_BAD holds malformed constructions. STATEFUL_BAD holds malformed calls on a
`ConditionalAccumulator` or `SparseConditionalAccumulator` holding two gradients;
after each, the counters, the global step and the next take's result must be as if
the call never happened. Every host call runs in a worker thread with a bounded wait,
so a call that blocks fails the test instead of hanging it. tests/_bad_inputs.py says
what a clear error is.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _bad_inputs import Bad, check, ids
from _host import WAIT

import optax_accum
from optax_accum import IndexedSlices


def _in_thread(call: Callable[[], Any]) -> Any:
    """Runs `call` in a daemon thread, waits at most WAIT seconds, re-raises its error."""
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), f"call still blocked after {WAIT} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _dense_acc(**kw: Any) -> optax_accum.ConditionalAccumulator:
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), **kw)
    acc.apply_grad(np.array([1.0, 2.0], np.float32), local_step=0)
    acc.apply_grad(np.array([3.0, 6.0], np.float32), local_step=0)
    return acc


def _sparse_acc(**kw: Any) -> optax_accum.SparseConditionalAccumulator:
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2), **kw)
    acc.apply_grad([0, 1], np.array([[1.0, 0.0], [0.0, 2.0]], np.float32), local_step=0)
    acc.apply_grad([0], np.array([[3.0, 4.0]], np.float32), local_step=0)
    return acc


def _snapshot(acc: Any) -> tuple:
    return (
        acc.num_accumulated(),
        acc.global_step,
        acc.num_dropped,
        acc.num_nonfinite,
        acc.num_waiting_takes(),
    )


def _dense_take_after(acc: Any) -> list:
    """Applies one more gradient and takes: the mean of [1,2], [3,6] and [2,4]."""
    acc.apply_grad(np.array([2.0, 4.0], np.float32), local_step=0)
    return np.asarray(_in_thread(lambda: acc.take_grad(3, timeout=WAIT))).tolist()


def _sparse_take_after(acc: Any) -> list:
    acc.apply_grad([3], np.array([[5.0, 5.0]], np.float32), local_step=0)
    indices, values, shape = _in_thread(lambda: acc.take_grad(3, timeout=WAIT))
    return [indices.tolist(), np.asarray(values).tolist(), shape]


def _deleted(x: jax.Array) -> jax.Array:
    x.delete()
    return x


DENSE_TAKE = [2.0, 4.0]
SPARSE_TAKE = [[0, 1, 3], [[2.0, 2.0], [0.0, 2.0], [5.0, 5.0]], (4, 2)]

F32 = np.float32
ROW = np.ones((1, 2), F32)
DENSE_GRAD = np.ones(2, F32)

HOST_BAD: list[Bad] = [
    # ---------------------------------------------------------------- construction
    Bad(
        "ConditionalAccumulator/dtype=int32",
        lambda: optax_accum.ConditionalAccumulator(np.int32),
        TypeError,
        r"dtype must be one of float16, bfloat16, float32, float64, got <class 'numpy\.int32'>",
    ),
    Bad(
        "ConditionalAccumulator/dtype=None",
        lambda: optax_accum.ConditionalAccumulator(None),
        TypeError,
        r"dtype must be one of float16, bfloat16, float32, float64, got None",
    ),
    Bad(
        "ConditionalAccumulator/negative shape",
        lambda: optax_accum.ConditionalAccumulator(F32, shape=(-2,)),
        ValueError,
        r"shape must hold non-negative ints \(None or -1 for unknown dims\), got \(-2,\)",
    ),
    Bad(
        "ConditionalAccumulator/float shape",
        lambda: optax_accum.ConditionalAccumulator(F32, shape=(2.0,)),
        ValueError,
        r"shape must hold non-negative ints .*got \(2\.0,\)",
    ),
    Bad(
        "ConditionalAccumulator/shared_name=3",
        lambda: optax_accum.ConditionalAccumulator(F32, shared_name=3),
        TypeError,
        r"shared_name must be None or a str, got 3",
    ),
    Bad(
        "ConditionalAccumulator/name=3",
        lambda: optax_accum.ConditionalAccumulator(F32, name=3),
        TypeError,
        r"name must be a str, got 3",
    ),
    Bad(
        "ConditionalAccumulator/reduction_type",
        lambda: optax_accum.ConditionalAccumulator(F32, reduction_type="MAX"),
        ValueError,
        r"reduction_type must be \"mean\" or \"sum\" \(any case\), got 'MAX'",
    ),
    Bad(
        "SparseConditionalAccumulator/skip_nonfinite='no'",
        lambda: optax_accum.SparseConditionalAccumulator(F32, skip_nonfinite="no"),
        TypeError,
        r"skip_nonfinite must be a bool, got 'no' \(str\)",
    ),
]


@dataclasses.dataclass(frozen=True)
class HostBad:
    """A malformed call on a host accumulator built by `make`; state must not change."""

    id: str
    make: Callable[[], Any]
    call: Callable[[Any], Any]
    error: type[Exception]
    match: str
    take_after: Callable[[Any], Any]
    expected_take: Any


def _dense(id, call, error, match):
    return HostBad(
        f"ConditionalAccumulator.{id}",
        _dense_acc,
        call,
        error,
        match,
        _dense_take_after,
        DENSE_TAKE,
    )


def _sparse_host(id, call, error, match):
    return HostBad(
        f"SparseConditionalAccumulator.{id}",
        _sparse_acc,
        call,
        error,
        match,
        _sparse_take_after,
        SPARSE_TAKE,
    )


STATEFUL_BAD: list[HostBad] = [
    _dense(
        "apply_grad/shape",
        lambda a: a.apply_grad(np.ones(3, F32)),
        ValueError,
        r"grad must have a shape compatible with the accumulator's shape \(2,\), got \(3,\)",
    ),
    _dense(
        "apply_grad/float64 into float32",
        lambda a: a.apply_grad(np.ones(2, np.float64)),
        TypeError,
        r"grad must have the accumulator's dtype float32, got float64",
    ),
    _dense(
        "apply_grad/int32",
        lambda a: a.apply_grad(np.ones(2, np.int32)),
        TypeError,
        r"grad must have the accumulator's dtype float32, got int32",
    ),
    _dense(
        "apply_grad/str",
        lambda a: a.apply_grad("grad"),
        TypeError,
        r"grad must be an array or nested list of numbers",
    ),
    _dense(
        "apply_grad/stale and malformed",
        lambda a: a.apply_grad(np.ones(3, F32), local_step=-5),
        ValueError,
        r"grad must have a shape compatible with the accumulator's shape \(2,\), got \(3,\)",
    ),
    _dense(
        "apply_grad/None",
        lambda a: a.apply_grad(None),
        TypeError,
        r"grad must be an array or nested list of numbers, got None",
    ),
    _dense(
        "apply_grad/local_step=1.0",
        lambda a: a.apply_grad(DENSE_GRAD, local_step=1.0),
        TypeError,
        r"local_step must be an int, got 1\.0 \(float\)",
    ),
    _dense(
        "apply_grad/local_step vector",
        lambda a: a.apply_grad(DENSE_GRAD, local_step=np.array([1, 2])),
        TypeError,
        r"local_step must be an int, got array\(\[1, 2\]\)",
    ),
    _dense(
        "apply_grad/weight=-1",
        lambda a: a.apply_grad(DENSE_GRAD, weight=-1),
        ValueError,
        r"weight must be a non-negative, finite scalar \(in float32\), got -1\.0",
    ),
    _dense(
        "apply_grad/weight=nan",
        lambda a: a.apply_grad(DENSE_GRAD, weight=float("nan")),
        ValueError,
        r"weight must be a non-negative, finite scalar \(in float32\), got nan",
    ),
    _dense(
        "apply_grad/weight=inf",
        lambda a: a.apply_grad(DENSE_GRAD, weight=np.inf),
        ValueError,
        r"weight must be a non-negative, finite scalar \(in float32\), got inf",
    ),
    _dense(
        "apply_grad/weight beyond float32",
        lambda a: a.apply_grad(DENSE_GRAD, weight=1e39),
        ValueError,
        r"weight must be a non-negative, finite scalar \(in float32\), got 1e\+39",
    ),
    _dense(
        "apply_grad/weight=True",
        lambda a: a.apply_grad(DENSE_GRAD, weight=True),
        TypeError,
        r"weight must be None or a non-negative real scalar, got True \(bool\)",
    ),
    _dense(
        "apply_grad/weight str",
        lambda a: a.apply_grad(DENSE_GRAD, weight="2"),
        TypeError,
        r"weight must be None or a non-negative real scalar, got '2' \(str\)",
    ),
    _dense(
        "apply_grad/weight complex",
        lambda a: a.apply_grad(DENSE_GRAD, weight=np.complex64(1)),
        TypeError,
        r"weight must be None or a non-negative real scalar, got np\.complex64",
    ),
    _dense(
        "apply_grad/weight vector",
        lambda a: a.apply_grad(DENSE_GRAD, weight=np.ones(2)),
        ValueError,
        r"weight must be None or a non-negative real scalar, got shape \(2,\)",
    ),
    _dense(
        "apply_grad/stale with a bad weight",
        lambda a: a.apply_grad(DENSE_GRAD, local_step=-5, weight=-2),
        ValueError,
        r"weight must be a non-negative, finite scalar",
    ),
    _dense(
        "take_grad/grace_period=-1",
        lambda a: a.take_grad(1, timeout=WAIT, grace_period=-1),
        ValueError,
        r"grace_period must be None or a finite number of seconds >= 0, got -1",
    ),
    _dense(
        "take_grad/grace_period=inf",
        lambda a: a.take_grad(1, timeout=WAIT, grace_period=float("inf")),
        ValueError,
        r"grace_period must be None or a finite number of seconds >= 0, got inf",
    ),
    _dense(
        "take_grad/grace_period str",
        lambda a: a.take_grad(1, timeout=WAIT, grace_period="0.1"),
        TypeError,
        r"grace_period must be None or a number of seconds, got '0\.1' \(str\)",
    ),
    _dense(
        "take_grad/num_required=0",
        lambda a: a.take_grad(0, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _dense(
        "take_grad/num_required=-1",
        lambda a: a.take_grad(-1, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was -1",
    ),
    _dense(
        "take_grad/num_required=1.5",
        lambda a: a.take_grad(1.5, timeout=WAIT),
        TypeError,
        r"num_required must be a positive int, got 1\.5 \(float\)",
    ),
    _dense(
        "take_grad/timeout=-1",
        lambda a: a.take_grad(1, timeout=-1),
        ValueError,
        r"timeout must be None or >= 0 seconds, got -1",
    ),
    _dense(
        "take_grad/timeout='1'",
        lambda a: a.take_grad(1, timeout="1"),
        TypeError,
        r"timeout must be None or a number of seconds, got '1'",
    ),
    _dense(
        "set_global_step/1.5",
        lambda a: a.set_global_step(1.5),
        TypeError,
        r"new_global_step must be an int, got 1\.5 \(float\)",
    ),
    _dense(
        "set_global_step/None",
        lambda a: a.set_global_step(None),
        TypeError,
        r"new_global_step must be an int, got None",
    ),
    _dense(
        "apply_grad/deleted jax array",
        lambda a: a.apply_grad(_deleted(jnp.ones(2))),
        ValueError,
        r"grad must be a live array, got one whose buffer was deleted \(donated to a jit",
    ),
    _dense(
        "take_grad/num_required vector",
        lambda a: a.take_grad(np.array([1, 2]), timeout=WAIT),
        TypeError,
        r"num_required must be a positive int, got array\(\[1, 2\]\) \(ndarray\)",
    ),
    _dense(
        "take_grad/num_required 0-d array 0",
        lambda a: a.take_grad(jnp.array(0), timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _sparse_host(
        "apply_grad/float indices",
        lambda a: a.apply_grad(np.array([0.0]), ROW),
        TypeError,
        r"grad_indices must be integers, got dtype float64",
    ),
    _sparse_host(
        "apply_grad/matrix indices",
        lambda a: a.apply_grad(np.array([[0]]), ROW),
        ValueError,
        r"grad_indices must be a vector, got shape \[1, 1\]",
    ),
    _sparse_host(
        "apply_grad/scalar values",
        lambda a: a.apply_grad(np.array([0]), F32(1)),
        ValueError,
        r"grad_values cannot be 0-dimensional; expected \[nnz, \.\.\.\]",
    ),
    _sparse_host(
        "apply_grad/rows != indices",
        lambda a: a.apply_grad(np.array([0, 1]), ROW),
        ValueError,
        r"grad_values must have one row per index: expected 2 rows, got 1",
    ),
    _sparse_host(
        "apply_grad/index out of range",
        lambda a: a.apply_grad(np.array([4]), ROW),
        ValueError,
        r"grad_indices\[0\] = 4 exceeds the accumulator's shape\[0\] = 4",
    ),
    _sparse_host(
        "apply_grad/negative index",
        lambda a: a.apply_grad(np.array([1, -1]), np.ones((2, 2), F32)),
        ValueError,
        r"grad_indices\[1\] = -1 is negative; indices must be row ids",
    ),
    _sparse_host(
        "apply_grad/values dtype",
        lambda a: a.apply_grad(np.array([0]), np.ones((1, 2), np.float64)),
        TypeError,
        r"grad_values must have the accumulator's dtype float32, got float64",
    ),
    _sparse_host(
        "apply_grad/values row shape",
        lambda a: a.apply_grad(np.array([0]), np.ones((1, 3), F32)),
        ValueError,
        r"grad_values dim 1 must be 2 \(the accumulator's shape \(4, 2\)\), got 3",
    ),
    _sparse_host(
        "apply_grad/grad_shape rank",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=[4]),
        ValueError,
        r"grad_shape must have rank at least 2 \(the accumulator's shape \(4, 2\)\), got \(4,\)",
    ),
    _sparse_host(
        "apply_grad/grad_shape dim",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=[5, 2]),
        ValueError,
        r"grad_shape dim 0 must be 4 \(the accumulator's shape \(4, 2\)\), got 5",
    ),
    _sparse_host(
        "apply_grad/grad_shape str",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape="4,2"),
        ValueError,
        r"grad_shape must hold non-negative ints \(None or -1 for unknown dims\), got '4,2'",
    ),
    _sparse_host(
        "apply_grad/grad_shape float array",
        lambda a: a.apply_grad(np.array([0]), ROW, grad_shape=jnp.array([4.0, 2.0])),
        ValueError,
        r"grad_shape must hold non-negative ints \(None or -1 for unknown dims\), got Array",
    ),
    _sparse_host(
        "apply_grad/deleted values",
        lambda a: a.apply_grad(np.array([0]), _deleted(jnp.ones((1, 2)))),
        ValueError,
        r"grad_values must be a live array, got one whose buffer was deleted",
    ),
    _sparse_host(
        "apply_grad/local_step=0.5",
        lambda a: a.apply_grad(np.array([0]), ROW, local_step=0.5),
        TypeError,
        r"local_step must be an int, got 0\.5 \(float\)",
    ),
    _sparse_host(
        "apply_indexed_slices_grad/not IndexedSlices",
        lambda a: a.apply_indexed_slices_grad((np.array([0]), ROW)),
        TypeError,
        r"grad must be an optax_accum\.IndexedSlices, got tuple",
    ),
    _sparse_host(
        "apply_indexed_slices_grad/row shape",
        lambda a: a.apply_indexed_slices_grad(
            IndexedSlices(jnp.array([0]), jnp.ones((1, 3)), (4, 3))
        ),
        ValueError,
        r"grad_shape dim 1 must be 2 \(the accumulator's shape \(4, 2\)\), got 3",
    ),
    _sparse_host(
        "apply_grad/weight=-0.5",
        lambda a: a.apply_grad([0], ROW, weight=-0.5),
        ValueError,
        r"weight must be a non-negative, finite scalar \(in float32\), got -0\.5",
    ),
    _sparse_host(
        "apply_grad/weight jax vector",
        lambda a: a.apply_grad([0], ROW, weight=jnp.ones(1)),
        ValueError,
        r"weight must be None or a non-negative real scalar, got shape \(1,\)",
    ),
    _sparse_host(
        "apply_indexed_slices_grad/weight list",
        lambda a: a.apply_indexed_slices_grad(
            IndexedSlices(jnp.array([0]), jnp.ones((1, 2)), (4, 2)), weight=[1.0]
        ),
        TypeError,
        r"weight must be None or a non-negative real scalar, got \[1\.0\] \(list\)",
    ),
    _sparse_host(
        "take_grad/num_required=0",
        lambda a: a.take_grad(0, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was 0",
    ),
    _sparse_host(
        "take_indexed_slices_grad/grace_period=nan",
        lambda a: a.take_indexed_slices_grad(1, timeout=WAIT, grace_period=float("nan")),
        ValueError,
        r"grace_period must be None or a finite number of seconds >= 0, got nan",
    ),
    _sparse_host(
        "take_indexed_slices_grad/num_required=-1",
        lambda a: a.take_indexed_slices_grad(-1, timeout=WAIT),
        ValueError,
        r"num_required must be positive, but was -1",
    ),
    _sparse_host(
        "set_global_step/float32",
        lambda a: a.set_global_step(np.float32(1)),
        TypeError,
        r"new_global_step must be an int, got np\.float32\(1\.0\)",
    ),
]


@pytest.mark.parametrize("bad", HOST_BAD, ids=ids(HOST_BAD))
def test_host_construction_raises_a_clear_error(bad: Bad):
    check(bad, run=_in_thread)


@pytest.mark.parametrize("bad", STATEFUL_BAD, ids=ids(STATEFUL_BAD))
def test_host_rejection_leaves_state_unchanged(bad: HostBad):
    acc = bad.make()
    before = _snapshot(acc)
    check(Bad(bad.id, lambda: bad.call(acc), bad.error, bad.match), run=_in_thread)
    assert _snapshot(acc) == before
    assert bad.take_after(acc) == bad.expected_take
    assert acc.global_step == before[1] + 1


@pytest.mark.parametrize(
    "first, second, match",
    [
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(2,)),
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float64, shape=(2,)),
            r"dtype=float32.*got a ConditionalAccumulator\(dtype=float64",
        ),
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(2,)),
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(3,)),
            r"shape=\(2,\).*got a ConditionalAccumulator\(dtype=float32, shape=\(3,\)",
        ),
        (
            dict(cls=optax_accum.ConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            dict(cls=optax_accum.SparseConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            r"ConditionalAccumulator\(dtype.*got a SparseConditionalAccumulator",
        ),
        (
            dict(cls=optax_accum.SparseConditionalAccumulator, dtype=np.float32, shape=(4, 2)),
            dict(
                cls=optax_accum.SparseConditionalAccumulator,
                dtype=np.float32,
                shape=(4, 2),
                reduction_type="SUM",
            ),
            r"reduction_type=MEAN.*got a SparseConditionalAccumulator.*reduction_type=SUM",
        ),
    ],
    ids=["dtype", "shape", "kind", "reduction"],
)
def test_shared_name_clash_is_rejected_and_leaves_the_first_untouched(first, second, match):
    name = f"bad-inputs-{uuid.uuid4().hex}"
    cls = first.pop("cls")
    acc = cls(shared_name=name, **first)
    if cls is optax_accum.ConditionalAccumulator:
        acc.apply_grad(np.ones(first["shape"], np.float32))
    else:
        acc.apply_grad([0], np.ones((1, 2), np.float32))
    before = _snapshot(acc)
    other = second.pop("cls")
    with pytest.raises(ValueError, match=rf"shared_name '{name}' is already used by a .*{match}"):
        _in_thread(lambda: other(shared_name=name, **second))
    assert _snapshot(acc) == before
    again = cls(shared_name=name, **first)  # the same signature still shares it
    assert again.accumulator_ref is acc.accumulator_ref
    assert again.num_accumulated() == 1
