"""Tests for the host ConditionalAccumulator: TF's vectors, validation, dtypes, kernels.

Threaded behaviour (blocking, FIFO, timeouts, cancellation, shared_name, stress) is
in test_host.py. Every take here has a timeout, so a bug fails instead of hanging.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import examples
from _host import f32, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import optax_accum
from optax_accum.host import _dense, _device

T = 10.0  # seconds: the bound on every take that should complete at once


def take(acc, n=1):
    return np.asarray(acc.take_grad(n, timeout=T))


def counters(acc):
    return acc.global_step, acc.num_accumulated(), acc.num_dropped, acc.num_nonfinite


# ----------------------------------------------------------- docs/semantics.md §1 vectors


def test_mean_of_two_matrices():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(3, 2))
    acc.apply_grad(f32([[1, 2], [3, 4], [5, 6]]))
    acc.apply_grad(f32([[10, 20], [30, 40], [50, 60]]))
    np.testing.assert_array_equal(take(acc), [[5.5, 11], [16.5, 22], [27.5, 33]])


@pytest.mark.parametrize(("reduction", "first", "second"), [("MEAN", 15, 25), ("SUM", 30, 50)])
def test_mean_and_sum_over_steps(reduction, first, second):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(), reduction_type=reduction)
    for ls, grads, want in [(0, (10, 20), first), (1, (20, 30), second)]:
        for g in grads:
            assert acc.apply_grad(f32(g), local_step=ls)
        assert take(acc) == want
    assert acc.global_step == 2


@pytest.mark.parametrize("reduction", ["MEAN", "SUM", "mean", "sum"])
def test_same_answer_twice(reduction):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(1,), reduction_type=reduction)
    want = 15.0 if reduction.lower() == "mean" else 30.0
    for ls in (0, 1):
        acc.apply_grad(f32([10]), local_step=ls)
        acc.apply_grad(f32([20]), local_step=ls)
        np.testing.assert_array_equal(take(acc), [want])
    assert acc.reduction_type == reduction.upper()


def test_mean_divides_by_all_accepted_not_num_required():
    acc = optax_accum.ConditionalAccumulator(np.float32)
    for g in (1, 2, 3, 6):
        acc.apply_grad(f32(g))
    assert take(acc, 2) == 3.0


def test_num_accumulated():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    assert acc.num_accumulated() == 0
    acc.apply_grad(f32([1, 2]))
    assert acc.num_accumulated() == 1
    acc.apply_grad(f32([3, 4]))
    assert acc.num_accumulated() == 2
    take(acc, 2)
    assert acc.num_accumulated() == 0
    for _ in range(4):
        acc.apply_grad(f32([1, 1]), local_step=1)
    assert acc.num_accumulated() == 4


def test_set_global_step_over_future_steps():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=())
    results = []
    for s in range(1000, 1005):
        acc.set_global_step(s)
        for ls in range(1000, 1005):
            acc.apply_grad(f32(ls), local_step=ls)
        results.append(float(take(acc)))
    assert results == [1002, 1002.5, 1003, 1003.5, 1004]


def test_stale_dropped_future_accepted_and_increment():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=())
    acc.set_global_step(5)
    assert not acc.apply_grad(f32(100.0), local_step=4)
    assert acc.apply_grad(f32(2.0), local_step=5)
    assert acc.apply_grad(f32(4.0), local_step=100)
    assert take(acc) == 3.0
    assert acc.global_step == 6  # an increment, not the largest local step
    assert not acc.apply_grad(f32(1.0), local_step=5)
    assert acc.apply_grad(f32(1.0), local_step=6)
    assert counters(acc) == (6, 1, 2, 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dtypes(dtype):
    acc = optax_accum.ConditionalAccumulator(dtype, shape=(1,))
    for i in range(10):
        acc.apply_grad([float(i)])
    out = acc.take_grad(1, timeout=T)
    assert isinstance(out, jax.Array)
    assert out.dtype == jnp.dtype(dtype)
    assert float(out[0]) == 4.5
    assert acc.dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("bad", [0, -1])
def test_num_required_below_one_is_an_error_and_changes_nothing(bad):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=())
    acc.apply_grad(f32(3.0))
    with pytest.raises(ValueError, match=f"num_required must be positive, but was {bad}"):
        acc.take_grad(bad, timeout=T)
    assert counters(acc) == (0, 1, 0, 0)
    assert acc.num_waiting_takes() == 0
    assert take(acc) == 3.0


# --------------------------------------------------------------------------- differences from TF


def test_float16_accumulates_in_float32():
    # In float16, 2048 + 1 rounds back to 2048; the float32 aggregate keeps 2050.
    acc = optax_accum.ConditionalAccumulator(np.float16, shape=(), reduction_type="sum")
    for g in (2048, 1, 1):
        acc.apply_grad(np.float16(g))
    out = acc.take_grad(1, timeout=T)
    assert out.dtype == jnp.float16
    assert float(out) == 2050.0


def test_float64_stays_float64_without_x64():
    assert not jax.config.jax_enable_x64
    tiny = 2.0**-40  # lost in float32 next to 1.0
    acc = optax_accum.ConditionalAccumulator(np.float64, shape=(1,))
    acc.apply_grad(np.array([1.0]))
    acc.apply_grad(np.array([1.0 + 2 * tiny]))
    out = acc.take_grad(1, timeout=T)
    assert out.dtype == jnp.float64
    assert np.asarray(out)[0] == 1.0 + tiny


def test_every_gradient_is_validated_even_stale():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.set_global_step(3)
    with pytest.raises(ValueError, match=r"compatible with the accumulator's shape \(2,\)"):
        acc.apply_grad(f32([1, 2, 3]), local_step=0)
    with pytest.raises(TypeError, match="dtype float32, got float64"):
        acc.apply_grad(np.zeros(2), local_step=0)
    assert counters(acc) == (3, 0, 0, 0)


def test_skip_nonfinite_counts_and_skips():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), skip_nonfinite=True)
    assert acc.apply_grad(f32([1, 2]))
    assert not acc.apply_grad(f32([np.nan, 0]))
    assert not acc.apply_grad(jnp.array([np.inf, 0.0]))
    assert acc.apply_grad(f32([3, 4]))
    assert counters(acc) == (0, 2, 0, 2)
    np.testing.assert_array_equal(take(acc), [2, 3])
    assert not acc.apply_grad(f32([np.nan, 0]), local_step=0)  # stale first: a drop
    assert counters(acc) == (1, 0, 1, 2)


def test_nonfinite_accumulated_by_default_as_tf():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.apply_grad(f32([1, np.inf]))
    acc.apply_grad(f32([1, 0]))
    np.testing.assert_array_equal(take(acc), [1, np.inf])


# --------------------------------------------------------------------------- shapes


def test_unknown_shape_fixed_by_first_gradient_until_take():
    acc = optax_accum.ConditionalAccumulator(np.float32)
    assert acc.shape is None
    acc.apply_grad(f32(np.ones((3, 2))))
    with pytest.raises(ValueError, match=r"expected \(3, 2\).*got \(2, 2\)"):
        acc.apply_grad(f32(np.ones((2, 2))))
    assert acc.num_accumulated() == 1
    np.testing.assert_array_equal(take(acc), np.ones((3, 2)))
    acc.apply_grad(f32(np.ones((2, 2))), local_step=1)  # a new shape after the take
    np.testing.assert_array_equal(take(acc), np.ones((2, 2)))


def test_partially_known_shape():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(None, 2))
    assert acc.shape == (None, 2)
    assert optax_accum.ConditionalAccumulator(np.float32, shape=[-1, 2]).shape == (None, 2)
    acc.apply_grad(f32(np.ones((5, 2))))
    with pytest.raises(ValueError, match="compatible"):
        acc.apply_grad(f32(np.ones((5, 3))))
    with pytest.raises(ValueError, match="compatible"):
        acc.apply_grad(f32(np.ones(2)))
    with pytest.raises(ValueError, match=r"expected \(5, 2\)"):
        acc.apply_grad(f32(np.ones((4, 2))))
    assert counters(acc) == (0, 1, 0, 0)


def test_rejected_gradient_leaves_aggregate_untouched():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.apply_grad(f32([1, 2]))
    bads = (f32([1, 2, 3]), np.array([1, 2], np.int32), np.zeros(2), "x", [[1.0, 2.0]], None)
    for bad in (*bads, [True, False], [[1.0], [2.0, 3.0]]):
        with pytest.raises((TypeError, ValueError)):
            acc.apply_grad(bad)
    for bad_step in (1.0, "0", None, True):
        with pytest.raises(TypeError, match="local_step must be an int"):
            acc.apply_grad(f32([5, 5]), local_step=bad_step)
    assert counters(acc) == (0, 1, 0, 0)
    np.testing.assert_array_equal(take(acc), [1, 2])


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": np.int32}, TypeError, "dtype must be one of"),
        ({"dtype": bool}, TypeError, "dtype must be one of"),
        ({"dtype": np.complex64}, TypeError, "dtype must be one of"),
        ({"dtype": "float8_e4m3fn"}, TypeError, "dtype must be one of"),
        ({"dtype": "nope"}, TypeError, "dtype must be one of"),
        ({"dtype": None}, TypeError, "dtype must be one of"),
        ({"reduction_type": "MAX"}, ValueError, "reduction_type must be"),
        ({"shape": (2, -3)}, ValueError, "shape must hold non-negative ints"),
        ({"shape": (2.5,)}, ValueError, "shape must hold non-negative ints"),
        ({"shape": object()}, TypeError, "shape must be None or a sequence"),
        ({"name": 3}, TypeError, "name must be a str"),
        ({"shared_name": 3}, TypeError, "shared_name must be None or a str"),
        ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be a bool"),
    ],
)
def test_bad_construction(kwargs, error, match):
    args = {"dtype": np.float32, **kwargs}
    with pytest.raises(error, match=match):
        optax_accum.ConditionalAccumulator(**args)


def test_attributes_and_lower_step_warns():
    acc = optax_accum.ConditionalAccumulator(
        jnp.bfloat16, shape=[4], name="grads", reduction_type="sum"
    )
    assert (acc.dtype, acc.shape, acc.name, acc.reduction_type) == (
        jnp.dtype(jnp.bfloat16),
        (4,),
        "grads",
        "SUM",
    )
    assert acc.accumulator_ref is not None
    assert "ConditionalAccumulator(dtype=bfloat16" in repr(acc)
    acc.set_global_step(4)
    acc.apply_grad(np.ones(4, jnp.bfloat16), local_step=4)
    with pytest.warns(UserWarning, match="lowers the accumulator's global step from 4"):
        acc.set_global_step(2)
    assert counters(acc) == (2, 1, 0, 0)  # the counter and aggregate are untouched
    with pytest.raises(TypeError, match="new_global_step must be an int"):
        acc.set_global_step(1.5)
    np.testing.assert_array_equal(take(acc).astype(np.float32), np.ones(4))


# --------------------------------------------------------------------------- device kernels


def _dense_cache_sizes():
    kernels = (_dense._sum_as, _dense._add, _dense._finish_in_place, _dense._finish_copy)
    return [k._cache_size() for k in kernels]


def test_no_recompilation_for_same_shape_gradients():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(5,))

    def grad(i):  # NumPy, then JAX arrays (weak-typed ones compile their own add)
        return jnp.full(5, float(i)) if i else f32(np.arange(5))

    for ls in range(2):  # warm up
        for i in range(3):
            acc.apply_grad(grad(i), local_step=ls)
        take(acc)
    before = _dense_cache_sizes()
    for ls in range(2, 6):
        for i in range(3):
            acc.apply_grad(grad(i), local_step=ls)
        take(acc)
    assert _dense_cache_sizes() == before


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_callers_arrays_are_never_donated(reduction):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(3,), reduction_type=reduction)
    g1 = jnp.array([1.0, 2.0, 3.0])
    g2 = jax.device_put(jnp.array([3.0, 2.0, 1.0]), jax.devices()[-1])  # another device
    acc.apply_grad(g1)
    acc.apply_grad(g2)
    out = take(acc)
    np.testing.assert_array_equal(out, [4, 4, 4] if reduction == "SUM" else [2, 2, 2])
    assert not g1.is_deleted() and not g2.is_deleted()
    np.testing.assert_array_equal(np.asarray(g1) + np.asarray(g2), [4, 4, 4])


def test_numpy_gradients_are_copied_at_apply():
    # Actors reuse their buffers: what counts is the value at the time of the apply,
    # although up to four accepted gradients wait to be added in one pass.
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(4,), reduction_type="SUM")
    buffer = np.zeros(4, np.float32)
    for i in range(6):
        buffer[:] = i
        acc.apply_grad(buffer)
    buffer[:] = 100
    np.testing.assert_array_equal(take(acc), np.full(4, 15.0))


@pytest.mark.parametrize("reduction", ["SUM", "MEAN"])
def test_taken_answers_never_share_memory_with_later_gradients(reduction):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(8,), reduction_type=reduction)
    answers = []
    for step in range(12):  # a single pending gradient, then several
        for _ in range(1 + step % 3):
            acc.apply_grad(np.full(8, step, np.float32), local_step=step)
        answers.append(acc.take_grad(1, timeout=T))
    scale = [1 + s % 3 if reduction == "SUM" else 1 for s in range(12)]
    np.testing.assert_array_equal(np.stack(answers)[:, 0], np.arange(12) * np.array(scale))


def test_staging_buffers_are_reused(monkeypatch):
    # On a CPU device NumPy gradients are copied into pooled aligned buffers: in a
    # steady state of applies and takes, no new host buffer is allocated.
    allocated = []
    real = _device.aligned_empty

    def counting(shape, dtype):
        allocated.append(shape)
        return real(shape, dtype)

    monkeypatch.setattr(_device, "aligned_empty", counting)
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(64,), reduction_type="SUM")
    for step in range(8):
        for i in range(7):
            acc.apply_grad(np.full(64, i, np.float32), local_step=step)
        np.testing.assert_array_equal(take(acc), np.full(64, 21.0))
        if step == 1:
            warm = len(allocated)
    assert 0 < warm <= 2 * _dense._MAX_PENDING
    assert len(allocated) == warm


# --------------------------------------------------------------------------- reference model


class DenseModel:
    """TF's rules in pure Python, with a float64 NumPy aggregate, and weights as the
    functional accumulator's (MEAN divides by the weight sum once any came)."""

    def __init__(self, mean):
        self.mean, self.step = mean, 0
        self.count, self.total, self.weight_sum, self.weighted = 0, np.zeros(2), 0.0, False

    def apply(self, grad, local_step, weight=None):
        if local_step < self.step:
            return False
        w = 1.0 if weight is None else float(weight)
        if w:
            self.total = self.total + w * grad.astype(np.float64)
        self.count, self.weight_sum = self.count + 1, self.weight_sum + w
        self.weighted |= weight is not None
        return True

    def take(self, n):
        if self.count < n:
            return None
        divisor = (self.weight_sum or 1.0) if self.weighted else self.count
        out = self.total / divisor if self.mean else self.total
        self.step, self.count, self.total = self.step + 1, 0, np.zeros(2)
        self.weight_sum, self.weighted = 0.0, False
        return out


WEIGHTS = st.one_of(st.none(), st.sampled_from([0, 1, 2, 0.25, 3.5, np.float32(1.5), np.int64(4)]))

ops = st.one_of(
    st.tuples(
        st.just("apply"),
        st.lists(st.integers(-8, 8), min_size=2, max_size=2),
        st.integers(0, 5),
        WEIGHTS,
    ),
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("set"), st.integers(0, 5)),
    st.tuples(st.just("bad"), st.integers(0, 5)),
)


@settings(max_examples=examples(40), deadline=None)
@given(mean=st.booleans(), program=st.lists(ops, max_size=14))
def test_matches_reference_model(mean, program):
    acc = optax_accum.ConditionalAccumulator(
        np.float32, shape=(2,), reduction_type="MEAN" if mean else "SUM"
    )
    model = DenseModel(mean)
    for op in program:
        if op[0] == "apply":
            grad = f32(op[1])
            got = acc.apply_grad(grad, local_step=op[2], weight=op[3])
            assert got == model.apply(grad, op[2], op[3])
        elif op[0] == "take":
            want = model.take(op[1])
            if want is None:
                with pytest.raises(TimeoutError):
                    acc.take_grad(op[1], timeout=0)
            else:
                np.testing.assert_allclose(acc.take_grad(op[1], timeout=0), want, rtol=1e-6)
        elif op[0] == "set":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                acc.set_global_step(op[1])
            model.step = op[1]
        else:
            with pytest.raises(ValueError):
                acc.apply_grad(f32([1, 2, 3]), local_step=op[1])
        assert (acc.global_step, acc.num_accumulated()) == (model.step, model.count)
        assert acc.num_waiting_takes() == 0


# --------------------------------------------------------------------------- weights


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16, np.float32, np.float64])
def test_weighted_aggregate_matches_float64(reduction, dtype):
    # Nine gradients: the queue of pending gradients flushes twice and the take adds
    # the last one; weights include 0 (on a NaN gradient, which must not leak).
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((9, 5)).astype(dtype)
    weights = [2, 0.5, 0, 3, 1, 1.25, 7, 0, 4]
    grads[2, 1] = grads[7, 0] = np.nan
    acc = optax_accum.ConditionalAccumulator(dtype, shape=(5,), reduction_type=reduction)
    for grad, weight in zip(grads, weights, strict=True):
        assert acc.apply_grad(grad, weight=weight)
    got = take(acc, 9)
    kept = np.array(weights) > 0
    want = (np.array(weights)[kept, None] * grads[kept].astype(np.float64)).sum(0)
    if reduction == "MEAN":
        want = want / sum(weights)
    assert got.dtype == np.dtype(dtype)
    tol = {np.float16: 2e-3, jnp.bfloat16: 2e-2}.get(dtype, 1e-6)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_weights_match_the_functional_accumulator(reduction, dtype):
    # Same formula and divisor; the last bit may differ: XLA fuses (and may contract
    # into FMAs) the host's batched adds differently from the transform's one at a time.
    rng = np.random.default_rng(1)
    grads = rng.standard_normal((6, 7)).astype(dtype)
    weights = [3, None, 0.5, 0, 1, 2.75]
    tx = optax_accum.conditional_accumulator(optax.identity(), 6, reduction=reduction)
    state = tx.init(jnp.zeros(7, dtype))
    step = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    for grad, weight in zip(grads, weights, strict=True):
        updates, state = step(jnp.asarray(grad), state, weight)
    acc = optax_accum.ConditionalAccumulator(dtype, shape=(7,), reduction_type=reduction)
    for grad, weight in zip(grads, weights, strict=True):
        acc.apply_grad(grad, weight=weight)
    ulp = np.finfo(dtype).eps
    np.testing.assert_allclose(take(acc, 6), np.asarray(updates), rtol=2 * ulp, atol=ulp)


def test_weights_summing_to_zero_take_zeros_and_a_weight_zero_nan_never_leaks():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.apply_grad(f32([np.nan, np.inf]), weight=0)
    acc.apply_grad(jnp.array([np.nan, 1.0]), weight=0.0)  # a caller's JAX array
    np.testing.assert_array_equal(take(acc, 2), [0, 0])
    acc.apply_grad(f32([np.nan, 1]), local_step=1, weight=0)
    acc.apply_grad(f32([4, 8]), local_step=1, weight=2)
    np.testing.assert_array_equal(take(acc, 2), [4, 8])  # (0 + 2 * g) / 2
    assert counters(acc) == (2, 0, 0, 0)


def test_weight_zero_counts_towards_num_required_and_is_accepted():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(), reduction_type="SUM")
    assert acc.apply_grad(f32(5), weight=0)
    assert acc.num_accumulated() == 1
    assert not acc.apply_grad(f32(5), local_step=-1, weight=2)  # stale: no weight added
    acc.apply_grad(f32(3), weight=np.float64(2))
    assert take(acc, 2) == 6
    assert acc.num_dropped == 1


@pytest.mark.parametrize("num_required", [2, 4, 6])
def test_a_waiting_take_gets_the_same_answer_as_a_late_one(pool, num_required):
    # With a take waiting, the gradients before its last are added as soon as they come
    # (the hand-off then adds one and divides); with none, they queue. Same answer.
    rng = np.random.default_rng(num_required)
    grads = rng.standard_normal((num_required, 3)).astype(np.float32)
    weights = rng.integers(0, 4, num_required).tolist()
    answers = []
    for waiting in (True, False):
        acc = optax_accum.ConditionalAccumulator(np.float32, shape=(3,))
        future = pool.submit(acc.take_grad, num_required, T) if waiting else None
        if waiting:
            wait_until(lambda acc=acc: acc.num_waiting_takes() == 1)
        for grad, weight in zip(grads, weights, strict=True):
            acc.apply_grad(grad, weight=weight)
        answers.append(np.asarray(future.result(T) if waiting else take(acc, num_required)))
    kept = np.array(weights, float)
    want = (kept[:, None] * grads).sum(0) / (kept.sum() or 1)
    np.testing.assert_allclose(answers[0], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(answers[1], want, rtol=1e-6, atol=1e-7)


def test_weights_may_be_numpy_and_jax_scalars():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=())
    for weight in (np.int32(1), np.float16(2), np.array(3.0), jnp.asarray(2, jnp.int32)):
        acc.apply_grad(f32(8), weight=weight)
    assert take(acc, 4) == 8


# --------------------------------------------------------------------------- faults


def test_a_jax_gradient_donated_after_the_apply_is_not_lost():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(3,))
    donate = jax.jit(lambda x: x * 0, donate_argnums=0)
    grads = [jnp.full(3, float(x)) for x in (1, 2, 6)]
    for g in grads:
        acc.apply_grad(g)
        donate(g)  # the caller reuses its buffer at once
    assert all(g.is_deleted() for g in grads)
    np.testing.assert_array_equal(take(acc), [3, 3, 3])
    acc.apply_grad(f32([5, 5, 5]), local_step=1)
    np.testing.assert_array_equal(take(acc), [5, 5, 5])  # nothing left over, no stale count


def test_a_deleted_jax_gradient_is_rejected_and_changes_nothing():
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.apply_grad(f32([1, 2]))
    gone = jnp.ones(2)
    gone.delete()
    with pytest.raises(ValueError, match="grad must be a live array, got one whose buffer was"):
        acc.apply_grad(gone)
    assert counters(acc) == (0, 1, 0, 0)
    np.testing.assert_array_equal(take(acc), [1, 2])


def _fail_once(monkeypatch, module, names, times=1):
    """Makes the kernels `names` of `module` raise on their next `times` calls."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def failing(*args, _real=real, **kwargs):
            if len(calls) < times:
                calls.append(1)
                raise RuntimeError("device lost")
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, failing)
    return calls


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_a_take_whose_reduction_fails_leaves_a_consistent_usable_accumulator(
    monkeypatch, reduction
):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), reduction_type=reduction)
    acc.apply_grad(f32([1, 1]))
    acc.apply_grad(f32([3, 3]))
    # Dispatched as the batch is handed over, the reduction fails; the taker meets the
    # failure again and raises it.
    calls = _fail_once(monkeypatch, _dense, ["_finish_in_place", "_finish_copy"], times=2)
    with pytest.raises(RuntimeError, match="device lost"):
        acc.take_grad(2, timeout=T)
    assert len(calls) == 2
    # The take took its gradients and failed with them: the count went with them.
    assert counters(acc) == (1, 0, 0, 0) and acc.num_waiting_takes() == 0
    acc.apply_grad(f32([10, 10]), local_step=1)
    acc.apply_grad(f32([20, 20]), local_step=1)
    want = 15.0 if reduction == "MEAN" else 30.0
    np.testing.assert_array_equal(take(acc, 2), [want, want])


def test_a_reduction_that_fails_once_at_the_hand_off_is_retried_by_the_taker(monkeypatch):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    acc.apply_grad(f32([1, 1]))
    acc.apply_grad(f32([3, 3]))
    calls = _fail_once(monkeypatch, _dense, ["_finish_in_place", "_finish_copy"])
    np.testing.assert_array_equal(take(acc, 2), [2, 2])
    assert calls and counters(acc) == (1, 0, 0, 0)


def test_a_hand_off_interrupted_after_its_answer_was_dispatched(pool, monkeypatch):
    # The answer's kernel consumed the aggregate, and the interrupt lost its result:
    # the take completes with a clear error, and the accumulator goes on.
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
    real = _dense.DenseCore.seal

    def interrupted(self, batch, take):
        self._answer(batch)
        raise KeyboardInterrupt

    monkeypatch.setattr(_dense.DenseCore, "seal", interrupted)
    future = pool.submit(acc.take_grad, 2, T)
    wait_until(lambda: acc.num_waiting_takes() == 1)
    acc.apply_grad(f32([1, 1]))  # one short: added at once, the aggregate exists
    with pytest.raises(KeyboardInterrupt):
        acc.apply_grad(f32([3, 3]))
    with pytest.raises(RuntimeError, match="interrupted at its hand-off"):
        future.result(timeout=T)
    monkeypatch.setattr(_dense.DenseCore, "seal", real)
    assert counters(acc) == (1, 0, 0, 0) and acc.num_waiting_takes() == 0
    acc.apply_grad(f32([5, 5]), local_step=1)
    np.testing.assert_array_equal(take(acc), [5, 5])


def test_an_apply_whose_add_fails_changes_nothing(monkeypatch):
    acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,), reduction_type="SUM")
    for x in range(1, _dense._MAX_PENDING):  # the queue before one kernel adds them
        acc.apply_grad(f32([x, 1]))
    _fail_once(monkeypatch, _dense, ["_sum_as", "_add"])
    with pytest.raises(RuntimeError, match="device lost"):
        acc.apply_grad(f32([100, 1]))
    assert counters(acc) == (0, _dense._MAX_PENDING - 1, 0, 0)
    n = _dense._MAX_PENDING - 1
    np.testing.assert_array_equal(take(acc, n), [n * (n + 1) / 2, n])
