"""Tests for the host SparseConditionalAccumulator: TF's vectors, validation in TF's
order, dense meaning of duplicates, growth and bucketing, and a reference model.

Threaded sparse vectors are in test_host.py. Every take has a timeout.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import examples
from _host import f32
from hypothesis import example, given, settings
from hypothesis import strategies as st

import optax_accum
from optax_accum.host import _row_kernels

T = 10.0


def take(acc, n=1):
    indices, values, shape = acc.take_grad(n, timeout=T)
    assert indices.dtype == jnp.int32 and values.dtype == acc.dtype
    return np.asarray(indices).tolist(), np.asarray(values), shape


def state(acc):
    return acc.global_step, acc.num_accumulated(), acc.num_dropped, acc.num_nonfinite


# ----------------------------------------------------------- docs/semantics.md §2 vectors


@pytest.mark.parametrize(
    ("reduction", "want"),
    [("MEAN", [[0.5, 0.5], [0, 2], [3, 0]]), ("SUM", [[1, 1], [0, 2], [3, 0]])],
)
def test_per_row_mean_and_sum(reduction, want):
    acc = optax_accum.SparseConditionalAccumulator(
        np.float32, shape=(3, 2), reduction_type=reduction
    )
    acc.apply_grad([0, 1], f32([[1, 0], [0, 2]]))
    acc.apply_grad([0, 2], f32([[0, 1], [3, 0]]))
    indices, values, shape = take(acc)
    assert indices == [0, 1, 2] and shape == (3, 2)
    np.testing.assert_array_equal(values, want)
    acc.apply_grad([0, 1], f32([[10, 0], [0, 20]]), local_step=1)
    acc.apply_grad([0, 2], f32([[0, 10], [30, 0]]), local_step=1)
    indices, values, _ = take(acc)
    scale = 1 if reduction == "MEAN" else 2
    np.testing.assert_array_equal(
        values, np.array([[5, 5], [0, 20], [30, 0]]) * [[scale], [1], [1]]
    )


def test_rows_divided_by_their_own_count():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(None, 2))
    acc.apply_grad([0, 1], f32([[3, 3], [6, 6]]))
    acc.apply_grad([1], f32([[3, 3]]))
    acc.apply_grad([1, 3], f32([[0, 0], [9, 9]]))
    indices, values, shape = take(acc)
    assert indices == [0, 1, 3] and shape == (-1, 2)  # dim 0 unknown: -1, as TF
    np.testing.assert_array_equal(values, [[3, 3], [3, 3], [9, 9]])


def test_validation_vector_shape_2_2_none():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(2, 2, None))
    ones = np.ones((1, 2, 2), np.float32)
    with pytest.raises(ValueError, match="grad_shape must have rank at least 3"):
        acc.apply_grad([0], ones, grad_shape=[2, 2])
    with pytest.raises(ValueError, match=r"grad_shape dim 1 must be 2.*got 3"):
        acc.apply_grad([0], ones, grad_shape=[2, 3, 2])
    with pytest.raises(ValueError, match=r"grad_indices\[0\] = 3 exceeds .*shape\[0\] = 2"):
        acc.apply_grad([3], ones)
    with pytest.raises(ValueError, match="grad_values must have rank at least 3"):
        acc.apply_grad([0, 1], np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"grad_values dim 1 must be 2.*got 3"):
        acc.apply_grad([0], np.ones((1, 3, 2), np.float32))
    assert state(acc) == (0, 0, 0, 0)
    assert acc.apply_grad([0], np.ones((1, 2, 2, 2), np.float32))
    for bad in [(1, 2, 2), (1, 2, 2, 3)]:  # fixed by the first gradient until the next take
        with pytest.raises(ValueError, match="fixed by the first gradient since the last take"):
            acc.apply_grad([1], np.ones(bad, np.float32))
    assert state(acc) == (0, 1, 0, 0)
    _, values, shape = take(acc)
    assert values.shape == (1, 2, 2, 2) and shape == (2, 2, 2, 2)
    assert acc.apply_grad([1], ones, local_step=1)  # a new take: [1, 2, 2] is fine now


@pytest.mark.parametrize(
    ("indices", "values", "error", "match"),
    [
        (np.array([[0], [1]]), f32(np.ones((2, 2))), ValueError, r"vector, got shape \[2, 1\]"),
        ([0.0, 1.0], f32(np.ones((2, 2))), TypeError, "grad_indices must be integers"),
        ([0], np.float32(1), ValueError, "cannot be 0-dimensional"),
        ([0, 1], f32(np.ones((1, 2))), ValueError, "expected 2 rows.*got 1"),
        ([0, -1], f32(np.ones((2, 2))), ValueError, r"grad_indices\[1\] = -1 is negative"),
        ([0], np.ones((1, 2), np.float64), TypeError, "dtype float32, got float64"),
        ([0], np.ones((1, 2), np.int32), TypeError, "dtype float32, got int32"),
    ],
)
def test_rejected_gradients_change_nothing(indices, values, error, match):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    acc.apply_grad([2], f32([[1, 2]]))
    acc.set_global_step(1)  # stale or not, every gradient is validated
    for step in (0, 1):
        with pytest.raises(error, match=match):
            acc.apply_grad(indices, values, local_step=step)
    assert state(acc) == (1, 1, 0, 0)
    indices_out, values_out, _ = take(acc)
    assert indices_out == [2]
    np.testing.assert_array_equal(values_out, [[1, 2]])


def test_grad_shape_limits_indices_too():
    acc = optax_accum.SparseConditionalAccumulator(np.float32)
    with pytest.raises(ValueError, match=r"grad_indices\[0\] = 5 exceeds grad_shape\[0\] = 3"):
        acc.apply_grad([5], f32([[1]]), grad_shape=(3, 1))
    with pytest.raises(ValueError, match=r"grad_shape must hold non-negative ints.*got '5,1'"):
        acc.apply_grad([5], f32([[1]]), grad_shape="5,1")
    assert acc.apply_grad([5], f32([[1]]), grad_shape=())  # empty: no shape given


def test_empty_gradient_counts():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(3, 2))
    assert acc.apply_grad(np.zeros(0, np.int64), np.zeros((0, 2), np.float32))
    assert acc.num_accumulated() == 1
    indices, values, shape = take(acc)
    assert indices == [] and values.shape == (0, 2) and shape == (3, 2)
    acc.apply_grad([], np.zeros((0, 2), np.float32), local_step=1)
    acc.apply_grad([1], f32([[4, 4]]), local_step=1)
    indices, values, _ = take(acc)
    assert indices == [1]
    np.testing.assert_array_equal(values, [[4, 4]])  # touched once: divided by 1


def test_duplicates_and_unsorted_input_mean_their_dense_tensor():
    # TF keeps [2, 0] then [0, 2] as three rows [0, 2, 0]; a gradient here means its
    # dense tensor: rows summed per index, counted once, answers sorted and unique.
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(3, 1))
    acc.apply_grad([2, 0], f32([[1], [2]]))
    acc.apply_grad([0, 2, 0], f32([[3], [4], [5]]))
    indices, values, _ = take(acc)
    assert indices == [0, 2]
    np.testing.assert_array_equal(values, [[(2 + 3 + 5) / 2], [(1 + 4) / 2]])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dtypes(dtype):
    acc = optax_accum.SparseConditionalAccumulator(dtype, shape=(2, 1))
    for i in range(10):
        acc.apply_grad([1], [[float(i)]])
    indices, values, _ = take(acc)
    assert indices == [1] and values.dtype == jnp.dtype(dtype)
    assert float(values[0, 0]) == 4.5


@pytest.mark.parametrize("nnz", [1, 3, 8])  # padded to 8 rows or not
def test_float64_rows_stay_float64_without_x64(nnz):
    acc = optax_accum.SparseConditionalAccumulator(np.float64, shape=(8, 1))
    rows = np.full((nnz, 1), 1 + 1e-12)  # 1 in float32
    for _ in range(2):
        acc.apply_grad(np.arange(nnz), rows)
    _, values, _ = take(acc)
    np.testing.assert_array_equal(values, rows)


def test_jax_inputs_and_indexed_slices():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(5, 2))
    acc.apply_grad(jnp.array([4, 1, 4]), jnp.ones((3, 2)), grad_shape=(5, 2))
    padded = optax_accum.IndexedSlices(jnp.array([1, 5, 5]), jnp.full((3, 2), 2.0), (5, 2))
    assert acc.apply_indexed_slices_grad(padded)  # index 5 is the padding: ignored
    out = acc.take_indexed_slices_grad(2, timeout=T)
    assert isinstance(out, optax_accum.IndexedSlices) and out.dense_shape == (5, 2)
    assert np.asarray(out.indices).tolist() == [1, 4]
    np.testing.assert_array_equal(out.values, [[1.5, 1.5], [2, 2]])
    unknown_rows = optax_accum.IndexedSlices(
        jnp.array([2, np.iinfo(np.int32).max]), jnp.ones((2, 2)), (-1, 2)
    )
    assert acc.apply_indexed_slices_grad(unknown_rows, local_step=1)  # int32 max: padding
    assert take(acc)[0] == [2]
    with pytest.raises(TypeError, match=r"grad must be an optax_accum\.IndexedSlices"):
        acc.apply_indexed_slices_grad((jnp.array([0]), jnp.ones((1, 2))))
    wrong = optax_accum.IndexedSlices(jnp.array([6]), jnp.ones((1, 2)), (7, 2))
    with pytest.raises(ValueError, match="grad_shape dim 0 must be 5"):
        acc.apply_indexed_slices_grad(wrong, local_step=2)
    assert state(acc) == (2, 0, 0, 0)


def test_skip_nonfinite():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(3, 1), skip_nonfinite=True)
    assert acc.apply_grad([0], f32([[2]]))
    assert not acc.apply_grad([1], f32([[np.nan]]))
    assert not acc.apply_grad([0], f32([[1]]), local_step=-1)
    assert state(acc) == (0, 1, 1, 1)
    indices, values, _ = take(acc)
    assert indices == [0] and values.tolist() == [[2.0]]


# --------------------------------------------------------------------------- growth and compiles


def test_grows_past_any_capacity():
    acc = optax_accum.SparseConditionalAccumulator(
        np.float32, shape=(None, 3), reduction_type="sum"
    )
    rng = np.random.default_rng(0)
    want = {}
    for _ in range(6):  # about 30 new rows each time: the buffer grows 8 -> ... -> 256
        rows = rng.integers(0, 200, size=30)
        vals = rng.integers(-5, 5, size=(30, 3)).astype(np.float32)
        acc.apply_grad(rows, vals)
        for r, v in zip(rows, vals, strict=True):
            want[int(r)] = want.get(int(r), 0) + v
    indices, values, _ = take(acc)
    assert indices == sorted(want)
    np.testing.assert_array_equal(values, [want[r] for r in indices])


def _sparse_cache_sizes():
    kernels = (
        _row_kernels.scatter_add,
        _row_kernels.scatter_grow,
        _row_kernels.gather_copy,
        _row_kernels.merge_copy,
    )
    return [k._cache_size() for k in kernels]


def test_compilations_depend_only_on_size_buckets():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(64, 2))
    everything = (np.arange(64), np.ones((64, 2), np.float32))

    def run(step, sizes):
        acc.apply_grad(*everything, local_step=step)  # capacity 64 from the start
        for n in sizes:
            acc.apply_grad(np.arange(n)[::-1], np.ones((n, 2), np.float32), local_step=step)
        take(acc)

    run(0, range(1, 41, 2))  # every bucket of sizes up to 64 met once
    before = _sparse_cache_sizes()
    run(1, range(2, 41, 2))  # twenty new sizes, no new bucket
    assert _sparse_cache_sizes() == before


# --------------------------------------------------------------------------- reference model


class SparseModel:
    """TF's rules with the dense meaning of each gradient, in pure Python (float64), and
    weights as the functional sparse accumulator's: per row, MEAN divides by the weight
    sum of the gradients that touched it (1 where that is 0) once any came weighted."""

    def __init__(self, mean):
        self.mean, self.step, self.count, self.rows, self.weighted = mean, 0, 0, {}, False

    def apply(self, indices, values, local_step, weight=None):
        if local_step < self.step:
            return False
        w = 1.0 if weight is None else float(weight)
        touched = {}
        for i, v in zip(indices, values, strict=True):
            touched[i] = touched.get(i, 0.0) + np.float64(v)
        for i, v in touched.items():
            total, n, ws = self.rows.get(i, (np.zeros(2), 0, 0.0))
            self.rows[i] = (total + w * v if w else total, n + 1, ws + w)
        self.count += 1
        self.weighted |= weight is not None
        return True

    def take(self, n):
        if self.count < n:
            return None
        keys = sorted(self.rows)
        values = []
        for k in keys:
            total, count, ws = self.rows[k]
            divisor = (ws or 1.0) if self.weighted else count
            values.append(total / divisor if self.mean else total)
        self.step, self.count, self.rows, self.weighted = self.step + 1, 0, {}, False
        return keys, np.array(values).reshape(-1, 2)


ops = st.one_of(
    st.tuples(
        st.just("apply"),
        st.lists(st.tuples(st.integers(0, 20), st.integers(-6, 6)), max_size=12),
        st.integers(0, 4),
        st.one_of(st.none(), st.sampled_from([0, 1, 2, 0.5, np.float32(3)])),
    ),
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("set"), st.integers(0, 4)),
    st.tuples(st.just("bad"), st.integers(0, 4)),
)


@settings(max_examples=examples(40), deadline=None)
@given(mean=st.booleans(), program=st.lists(ops, max_size=12))
# A take after a take whose batch reused a buffer, of a gradient with no rows: the
# batch has no buffer to give back (found by this test on the oldest versions).
@example(
    mean=True,
    program=[
        ("apply", [(0, 0)], 0, None),
        ("apply", [(0, 0)], 0, None),
        ("take", 1),
        ("apply", [], 1, None),
        ("take", 1),
    ],
)
def test_matches_reference_model(mean, program):
    acc = optax_accum.SparseConditionalAccumulator(
        np.float32, shape=(21, 2), reduction_type="MEAN" if mean else "SUM"
    )
    model = SparseModel(mean)
    for op in program:
        if op[0] == "apply":
            indices = np.array([i for i, _ in op[1]], np.int64)
            values = np.array([[v, -v] for _, v in op[1]], np.float32).reshape(-1, 2)
            got = acc.apply_grad(indices, values, local_step=op[2], weight=op[3])
            assert got == model.apply(indices.tolist(), values.tolist(), op[2], op[3])
        elif op[0] == "take":
            want = model.take(op[1])
            if want is None:
                with pytest.raises(TimeoutError):
                    acc.take_grad(op[1], timeout=0)
            else:
                indices, values, shape = acc.take_grad(op[1], timeout=0)
                assert np.asarray(indices).tolist() == want[0] and shape == (21, 2)
                np.testing.assert_allclose(values, want[1], rtol=1e-6)
        elif op[0] == "set":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                acc.set_global_step(op[1])
            assert len(caught) == (op[1] < model.step)  # lowering warns, as TF
            model.step = op[1]
        else:
            with pytest.raises(ValueError):
                acc.apply_grad([21], f32([[1, 1]]), local_step=op[1])
        assert (acc.global_step, acc.num_accumulated()) == (model.step, model.count)


# --------------------------------------------------------------------------- weights


def test_weights_match_the_functional_sparse_accumulator(reduction="mean"):
    # MEAN only (a compile of the transform costs seconds); SUM is the reference model's.
    # Rows touched by different gradients and weights (0 on a NaN row among them);
    # each row's mean divides by the weight sum of the gradients that touched it.
    grads = [
        ([0, 3], f32([[1, 2], [3, 4]]), 2.0),
        ([3, 1, 3], f32([[5, 6], [7, 8], [1, 1]]), None),
        ([0, 2], f32([[np.nan, 1], [2, 2]]), 0),
        ([2], f32([[4, -4]]), 0.5),
    ]
    tx = optax_accum.sparse_conditional_accumulator(
        optax_accum.sparse_sgd(-1.0), 4, capacity=8, reduction=reduction
    )
    state = tx.init(jnp.zeros((5, 2)))
    step = jax.jit(lambda g, s, w: tx.update(g, s, weight=w))
    acc = optax_accum.SparseConditionalAccumulator(np.float32, (5, 2), reduction_type=reduction)
    for ids, values, weight in grads:
        grad = optax_accum.IndexedSlices(jnp.array(ids), jnp.asarray(values), (5, 2))
        updates, state = step(grad, state, weight)
        assert acc.apply_grad(ids, values, weight=weight)
    indices, got, _ = take(acc, 4)
    dense = np.asarray(getattr(updates, "to_dense", lambda: updates)())  # sgd(-1): the sum
    assert indices == [0, 1, 2, 3]
    np.testing.assert_allclose(got, dense[indices], rtol=1e-6)
    assert not np.isnan(got).any()


def test_a_row_touched_only_by_weight_zero_comes_back_as_zeros():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(3, 1))
    acc.apply_grad([0, 1], f32([[np.nan], [2]]), weight=0)
    acc.apply_grad([1], f32([[6]]), weight=np.int64(3))
    indices, values, _ = take(acc, 2)
    assert indices == [0, 1]
    np.testing.assert_array_equal(values, [[0], [6]])


@pytest.mark.parametrize("first_weight", [None, 1])
def test_weights_after_unweighted_gradients_count_those_as_one(first_weight):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 1))
    acc.apply_grad([0, 1], f32([[2], [4]]), weight=first_weight)  # becomes the buffer
    acc.apply_grad([1], f32([[6]]))
    acc.apply_grad([], np.zeros((0, 1), np.float32), weight=5)  # no rows: no weight
    acc.apply_grad([1, 3], f32([[1], [8]]), weight=2)
    indices, values, _ = take(acc, 4)
    assert indices == [0, 1, 3]
    np.testing.assert_array_equal(values, [[2], [(4 + 6 + 2) / 4], [8]])


def test_weighted_first_gradient_is_scaled_not_adopted_as_the_buffer():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2), reduction_type="SUM")
    for step in range(2):  # without and then with a taken batch's spare buffer
        acc.apply_grad([0, 2], f32([[1, 2], [3, 4]]), local_step=step, weight=2.5)
        indices, values, _ = take(acc)
        assert indices == [0, 2]
        np.testing.assert_array_equal(values, [[2.5, 5], [7.5, 10]])


def test_results_live_on_the_device():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(2, 1))
    acc.apply_grad([0], f32([[1]]))
    indices, values, _ = acc.take_grad(1, timeout=T)
    assert isinstance(indices, jax.Array) and isinstance(values, jax.Array)


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray])
def test_grad_shape_may_be_a_numpy_or_jax_array(as_array):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    assert acc.apply_grad([1], f32([[1, 2]]), grad_shape=as_array([4, 2]))
    assert acc.apply_grad([1], f32([[3, 4]]), grad_shape=as_array([-1, 2]))
    with pytest.raises(ValueError, match="grad_shape dim 0 must be 4"):
        acc.apply_grad([1], f32([[3, 4]]), grad_shape=as_array([5, 2]))
    with pytest.raises(ValueError, match=r"grad_indices\[0\] = 3 exceeds grad_shape\[0\] = 3"):
        optax_accum.SparseConditionalAccumulator(np.float32).apply_grad(
            [3], f32([[1, 1]]), grad_shape=as_array([3, 2])
        )
    assert state(acc) == (0, 2, 0, 0)
    assert take(acc)[0] == [1]


def test_jax_values_donated_after_the_apply_are_not_lost():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    donate = jax.jit(lambda x: x * 0, donate_argnums=0)
    for ids, x in (([0, 1], 1.0), ([1, 3], 3.0)):
        values = jnp.full((2, 2), x)
        acc.apply_grad(ids, values)
        donate(values)
    indices, values, _ = take(acc)
    assert indices == [0, 1, 3]
    np.testing.assert_array_equal(values, [[1, 1], [2, 2], [3, 3]])


def test_a_take_whose_gather_fails_leaves_a_consistent_usable_accumulator(monkeypatch):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
    acc.apply_grad([2], f32([[1, 1]]))
    acc.apply_grad([0, 2], f32([[2, 2], [3, 3]]))
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(_row_kernels, "gather_copy", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        acc.take_grad(2, timeout=T)
    assert calls and state(acc) == (1, 0, 0, 0) and acc.num_waiting_takes() == 0
    monkeypatch.undo()
    acc.apply_grad([1], f32([[5, 5]]), local_step=1)
    indices, values, _ = take(acc)
    assert indices == [1]
    np.testing.assert_array_equal(values, [[5, 5]])  # divided by 1: no stale count left


def test_an_apply_whose_scatter_fails_changes_nothing(monkeypatch):
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2), reduction_type="SUM")
    acc.apply_grad([0], f32([[1, 1]]))
    acc.apply_grad([1], f32([[2, 2]]))

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(_row_kernels, "scatter_add", failing)
    monkeypatch.setattr(_row_kernels, "scatter_grow", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        acc.apply_grad([0, 3], f32([[10, 10], [30, 30]]))
    assert state(acc) == (0, 2, 0, 0)
    monkeypatch.undo()
    indices, values, _ = take(acc)
    assert indices == [0, 1]
    np.testing.assert_array_equal(values, [[1, 1], [2, 2]])


# --------------------------------------------------------------------------- slots and buffers


def test_a_taken_batch_buffer_is_reused_with_no_stale_rows():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(64, 2), reduction_type="SUM")
    for ids in (np.arange(20, 60), np.arange(40)):  # slots out of row order: a gather
        acc.apply_grad(ids, np.ones((40, 2), np.float32))
    take(acc)
    spare = acc.accumulator_ref.spare
    assert spare is not None and spare.shape[0] >= 60
    first = np.arange(16, dtype=np.float32).reshape(8, 2)
    acc.apply_grad(np.arange(8), first, local_step=1)  # 8 rows: the buffer, full
    acc.apply_grad([7, 9], f32([[10, 20], [30, 40]]), local_step=1)  # grows into the spare
    assert acc.accumulator_ref.batch.rows.shape == spare.shape and spare.is_deleted()
    indices, values, _ = take(acc)
    assert indices == [*range(8), 9]
    want = np.concatenate([first, [[30, 40]]])
    want[7] += [10, 20]
    np.testing.assert_array_equal(values, want)


def test_a_spare_of_another_row_shape_is_not_reused():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, reduction_type="SUM")
    acc.apply_grad([0, 1], f32([[1, 1], [2, 2]]))
    acc.apply_grad([1, 2], f32([[3, 3], [4, 4]]))
    take(acc)
    acc.apply_grad([0], f32([[1, 1, 1]]), local_step=1)
    acc.apply_grad([3], f32([[2, 2, 2]]), local_step=1)
    indices, values, _ = take(acc)
    assert indices == [0, 3]
    np.testing.assert_array_equal(values, [[1, 1, 1], [2, 2, 2]])


@settings(max_examples=examples(40), deadline=None)
@given(
    mean=st.booleans(),
    limit=st.sampled_from([1, 2, 8, 1 << 22]),
    batches=st.lists(
        st.lists(st.lists(st.integers(0, 300), max_size=10), min_size=1, max_size=5),
        min_size=1,
        max_size=3,
    ),
)
def test_per_row_mean_matches_float64_whatever_the_hint_table(mean, limit, batches):
    """Past its limit the hint table shares entries, a row id can get several slots,
    and the take adds them up: the answer must not change."""
    acc = optax_accum.SparseConditionalAccumulator(
        np.float32, shape=(None, 2), reduction_type="MEAN" if mean else "SUM"
    )
    acc.accumulator_ref.hints.limit = limit
    rng = np.random.default_rng(len(batches))
    for step, batch in enumerate(batches):
        total, touched = {}, {}
        for ids in batch:
            values = rng.standard_normal((len(ids), 2)).astype(np.float32)
            acc.apply_grad(np.array(ids, np.int64), values, local_step=step)
            dense = {}
            for i, v in zip(ids, values.astype(np.float64), strict=True):
                dense[i] = dense.get(i, 0.0) + v
            for i, v in dense.items():
                total[i] = total.get(i, 0.0) + v
                touched[i] = touched.get(i, 0) + 1
        indices, values, _ = acc.take_grad(len(batch), timeout=T)
        keys = sorted(total)
        want = [total[k] / (touched[k] if mean else 1) for k in keys]
        assert np.asarray(indices).tolist() == keys
        np.testing.assert_allclose(
            np.asarray(values, np.float64), np.reshape(want, (-1, 2)), rtol=1e-5, atol=1e-5
        )


def test_a_row_in_two_slots_is_merged_by_the_take():
    acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(None, 1))
    acc.accumulator_ref.hints.limit = 1  # every row id shares one entry
    acc.apply_grad([3, 5], f32([[1], [2]]))
    acc.apply_grad([5], f32([[4]]))  # 5's hint names 3... or 5's slot: never wrong
    acc.apply_grad([3], f32([[7]]))  # 3's hint was overwritten by 5's: a second slot
    batch = acc.accumulator_ref.batch
    assert sorted(batch.slot_ids.tolist()) == [3, 3, 5]
    indices, values, _ = take(acc, 3)
    assert indices == [3, 5]
    np.testing.assert_array_equal(values, [[4], [3]])  # (1 + 7) / 2, (2 + 4) / 2


@pytest.mark.parametrize("reduction", ["MEAN", "SUM"])
def test_distinct_and_repeated_row_ids_add_bit_for_bit_alike(reduction):
    """A gradient with distinct row ids is added by reading, adding and writing back its
    rows; one with a repeated id by zeroing new slots and scatter-adding. Both must give
    the same answers bit for bit: float32 sums in arrival order (a new row is 0 + v, so
    -0.0 becomes 0.0), divided alike."""
    rng = np.random.default_rng(7)
    grads = []
    for i in range(3):
        ids = np.sort(rng.choice(40, 12, replace=False))
        values = (rng.standard_normal((12, 3)) * 1e3).astype(np.float32)
        if i:  # the first may become the buffer as it is (no add: -0.0 stays)
            values[0] = -0.0
        grads.append((ids, values))
    sums = {}
    for ids, values in grads:  # the reference: one float32 add at a time
        for i, v in zip(ids.tolist(), values, strict=True):
            sums[i] = sums.get(i, np.zeros(3, np.float32)) + v
    keys = sorted(sums)
    answers = []
    for repeat in (False, True):
        acc = optax_accum.SparseConditionalAccumulator(
            np.float32, shape=(40, 3), reduction_type=reduction
        )
        for step in range(2):  # into a fresh buffer, then into the taken batch's spare
            for ids, values in grads:
                if repeat:  # the same dense gradient: row ids[1] again, with zeros
                    ids = np.concatenate([ids, ids[1:2]])
                    values = np.concatenate([values, np.zeros((1, 3), np.float32)])
                acc.apply_grad(ids, values, local_step=step)
            indices, values, _ = take(acc, len(grads))
            assert indices == keys
            answers.append(values.view(np.uint32))
    for answer in answers[1:]:
        np.testing.assert_array_equal(answer, answers[0])
    if reduction == "SUM":
        want = np.stack([sums[k] for k in keys])
        np.testing.assert_array_equal(answers[0], want.view(np.uint32))
