"""Running sums of gradients: their dtype, their zeros, and selections.

An accumulator keeps one copy of the gradients in a fixed dtype. A gradient is added
or not by selection (`jnp.where`), never by multiplying with a 0/1 mask, so a NaN or
Inf in a gradient that is not taken never reaches the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _compat

# The dtype of weight sums (`weight_sum`, the rows' `weights`): float32, whatever the
# gradients' dtypes.
WEIGHT_DTYPE = jnp.float32


def accumulator_dtype_for(param_dtype: Any, accumulator_dtype: np.dtype | None) -> np.dtype:
    """The dtype an accumulator keeps for a parameter leaf.

    An explicit `accumulator_dtype` wins; otherwise float16/bfloat16 accumulate in
    float32 (sums of many low-precision gradients lose too much), and every other
    floating dtype accumulates in itself.
    """
    if accumulator_dtype is not None:
        return accumulator_dtype
    dt = jnp.dtype(param_dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dt


def zeros_accumulator(param: Any, accumulator_dtype: np.dtype | None = None) -> jax.Array:
    """Zeros like `param` (its shape, sharding and varying mesh axes), in the dtype its
    accumulator keeps."""
    dtype = accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    return jnp.zeros_like(param, dtype=dtype)


def row_zeros(param: Any, dtype: Any) -> jax.Array:
    """Zeros, one per row (first axis) of `param`, laid out like those rows under
    explicit sharding."""
    rows = jnp.shape(param)[:1]
    return jnp.zeros(rows, dtype, out_sharding=_compat.leading_axis_sharding(param))


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """`jnp.where(pred, on_true, on_false)`; for a scalar bool `pred` and two arrays of
    one shape and dtype, a single `select_n`. `jnp.where` is a jit call of its own,
    which a step over hundreds of leaves pays hundreds of times when it is traced and
    lowered."""
    try:
        same = (
            pred.shape == ()
            and pred.dtype == jnp.bool_
            and on_true.shape == on_false.shape
            and on_true.dtype == on_false.dtype
        )
    except AttributeError:  # a Python scalar
        same = False
    if same:
        return lax.select_n(pred, on_false, on_true)
    return jnp.where(pred, on_true, on_false)


def zeros_unless(pred: jax.Array, x: jax.Array) -> jax.Array:
    """`x` where `pred` holds, zeros (like `x`) elsewhere: a selection."""
    return select(pred, x, jnp.zeros_like(x))


def restarted(emitted: jax.Array, accumulator: jax.Array) -> jax.Array:
    """The running sum as the next gradient finds it: zeros after a release (`emitted`).

    A release leaves the sum's buffer holding whatever it spent it on (the updates,
    which travel in it: see `_branch.release_if`); the next step adds to zeros instead,
    in the same pass as its addition, so no step spends a pass writing zeros.
    """
    return select(emitted, jnp.zeros_like(accumulator), accumulator)


def add_where(
    accepted: jax.Array,
    accumulator: jax.Array,
    gradient: jax.Array,
    weight: jax.Array | None = None,
) -> jax.Array:
    """`accumulator + weight * gradient` (in the accumulator's dtype) if `accepted`.

    A selection, so a NaN in a rejected gradient never reaches the accumulator. Without
    a `weight` nothing is multiplied; a zero weight adds nothing (not even a NaN).
    """
    if weight is None:
        added = lax.add(accumulator, gradient.astype(accumulator.dtype))
        return select(accepted, added, accumulator)
    added = lax.add(accumulator, weighted(gradient, weight, accumulator.dtype))
    return select(accepted & (weight > 0), added, accumulator)


def continued(
    accumulator: jax.Array,
    emitted: jax.Array,
    accepted: jax.Array,
    gradient: jax.Array,
    weight: jax.Array | None = None,
) -> jax.Array:
    """A running sum after one step: restarted if the last step released it
    (`emitted`), plus the (weighted) gradient if `accepted`, in one pass."""
    return add_where(accepted, restarted(emitted, accumulator), gradient, weight)


def weighted(values: jax.Array, weight: jax.Array | None, dtype: Any) -> jax.Array:
    """`weight * values` in `dtype`, multiplied in at least float32; `values` as they are
    (cast) without a weight. A zero weight gives zeros, even for a NaN."""
    if weight is None:
        return values.astype(dtype)
    # Not `jnp.promote_types`: strict dtype promotion rejects float64 with float32.
    compute = dtype if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)
    product = values.astype(compute) * weight.astype(compute)
    return zeros_unless(weight > 0, product).astype(dtype)


def mean_divisor(weights: jax.Array, dtype: Any) -> jax.Array:
    """The divisor of a weighted mean: the weight sum, or 1 where it is 0 (the sum is
    then 0 too, so the mean is 0)."""
    return select(weights > 0, weights, jnp.ones_like(weights)).astype(dtype)


def mean_divider(weights: jax.Array, leaves: list) -> Callable[[jax.Array], jax.Array]:
    """`t -> t / mean_divisor(weights, t.dtype)` for the leaves of one release, with what
    the leaves share computed once.

    Each leaf still selects its own divisor: XLA:CPU rewrites a division by a value
    with one user into a multiply by its reciprocal, which it fuses into every
    consumer, while a division by one shared value stays a kernel per leaf.
    """
    positive = weights > 0
    cast = {d: (weights.astype(d), jnp.ones((), d)) for d in {t.dtype for t in leaves}}

    def divide(t: jax.Array) -> jax.Array:
        w, one = cast[t.dtype]
        return lax.div(t, lax.select_n(positive, one, w))

    return divide


def weight_or_none(weight: Any) -> tuple[jax.Array | None, jax.Array]:
    """Validates the `weight` extra argument: `(weight as a float32 scalar, ok)`.

    `None` (the default, weight 1) gives `(None, True)`, so that callers skip the
    multiply. A weight must be a real scalar (TypeError / ValueError at trace time
    otherwise). A concrete weight that is negative, NaN or infinite is a ValueError; a
    traced one cannot raise, so it comes back as 0 with `ok` False, for the caller to
    skip the gradient and count it.
    """
    if weight is None:
        return None, jnp.asarray(True)
    real = int | float | np.ndarray | np.generic | jax.Array
    if isinstance(weight, bool | np.bool_) or not isinstance(weight, real):
        raise TypeError(
            f"weight must be a non-negative real scalar, got {weight!r} ({type(weight).__name__})"
        )
    dtype = jnp.result_type(weight)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"weight must be a non-negative real scalar, got dtype {dtype}")
    if jnp.ndim(weight) != 0:
        raise ValueError(
            f"weight must be a non-negative real scalar, got shape {tuple(jnp.shape(weight))}"
        )
    # A concrete value is checked now; a traced one (or one spread over several
    # processes, which cannot be read here) is checked in the program.
    if not isinstance(weight, jax.core.Tracer) and getattr(weight, "is_fully_addressable", True):
        value = np.asarray(weight).astype(np.float64)
        if not (np.isfinite(value) and 0 <= value <= np.finfo(np.float32).max):
            raise ValueError(
                "weight must be a non-negative, finite scalar (in float32), got "
                f"{np.asarray(weight).item()!r}"
            )
        return jnp.asarray(value, WEIGHT_DTYPE), jnp.asarray(True)
    w = jnp.asarray(weight).astype(WEIGHT_DTYPE)
    ok = jnp.isfinite(w) & (w >= 0)
    return jnp.where(ok, w, jnp.zeros((), WEIGHT_DTYPE)), ok


def skip_rule(
    should_skip_update_fn: Callable | None,
    updates: Any,
    gradient_step: jax.Array,
    params: Any,
) -> jax.Array | None:
    """The scalar bool `should_skip_update_fn(updates, gradient_step, params)` says, or
    None without a rule.

    The rule may return a bool scalar, or `optax.MultiSteps`' pair `(bool scalar,
    debugging tree)`, whose tree is discarded. Anything else is a TypeError or
    ValueError at trace time.
    """
    if should_skip_update_fn is None:
        return None
    out = should_skip_update_fn(updates, gradient_step, params)
    if isinstance(out, tuple | list) and len(out) == 2:
        out = out[0]
    if isinstance(out, bool | np.bool_):
        return jnp.asarray(bool(out))
    if not isinstance(out, np.ndarray | jax.Array) or (out.dtype, out.shape) != (jnp.bool_, ()):
        got = (
            f"dtype {out.dtype} and shape {out.shape}"
            if isinstance(out, np.ndarray | jax.Array)
            else f"{out!r} ({type(out).__name__})"
        )
        raise TypeError(
            "should_skip_update_fn must return a bool scalar (or a pair of one and any "
            f"tree, as optax.MultiSteps' rules do), got {got}"
        )
    return jnp.asarray(out)


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: True iff no leaf of `tree` holds a NaN or Inf."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `jnp.where(pred, a, b)`: a selection, never a 0/1 multiply."""
    return jax.tree.map(lambda a, b: select(pred, a, b), on_true, on_false)
