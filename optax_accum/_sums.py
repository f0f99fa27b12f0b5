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

from optax_accum import _compat, _unreduced

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
    accumulator keeps; typed unreduced over the mesh axes `param` is typed reduced over
    (see `_unreduced`)."""
    dtype = accumulator_dtype_for(jnp.result_type(param), accumulator_dtype)
    return _unreduced.sum_zeros(param, dtype)


def row_zeros(param: Any, dtype: Any) -> jax.Array:
    """Zeros, one per row (first axis) of `param`, laid out like those rows under
    explicit sharding.

    A placed `param` (not traced) gets them placed on its devices: eagerly outside
    `jax.set_mesh`, JAX cannot build an array typed on a mesh from a shape alone.
    """
    rows = jnp.shape(param)[:1]
    sharding = _compat.leading_axis_sharding(param)
    if sharding is not None and not isinstance(param, jax.core.Tracer):
        return jnp.zeros(rows, dtype, device=sharding)
    return jnp.zeros(rows, dtype, out_sharding=sharding)


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
    return select(pred, x, _unreduced.zeros_like(x))


def restarted(emitted: jax.Array, accumulator: jax.Array) -> jax.Array:
    """The running sum as the next gradient finds it: zeros after a release (`emitted`).

    A release leaves the sum's buffer holding whatever it spent it on (the updates,
    which travel in it: see `_branch.release_if`); the next step adds to zeros instead,
    in the same pass as its addition, so no step spends a pass writing zeros.
    """
    return select(emitted, _unreduced.zeros_like(accumulator), accumulator)


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
    # At least float32 (float64 stays: `jnp.promote_types` refuses it under strict promotion).
    compute = jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)
    product = values.astype(compute) * _unreduced.scalar_for(weight.astype(compute), values)
    return zeros_unless(weight > 0, product).astype(dtype)


def mean_divisor(weights: jax.Array, dtype: Any) -> jax.Array:
    """The divisor of a weighted mean: the weight sum, or 1 where it is 0 (the sum is
    then 0 too, so the mean is 0).

    The 1 is a scalar that the selection broadcasts in `weights`' layout: ones built
    like `weights` (`jnp.ones_like`) come out replicated when `weights` is a placed
    array that a traced function closes over (an eager release), and a select of two
    layouts is a type error under explicit sharding.
    """
    return jnp.where(weights > 0, weights, jnp.ones((), weights.dtype)).astype(dtype)


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
    try:
        out = should_skip_update_fn(updates, gradient_step, params)
    except (NotImplementedError, TypeError, ValueError) as e:
        unreduced = [x for x in jax.tree.leaves(updates) if _unreduced.unreduced_axes(x)]
        if not unreduced:
            raise
        raise TypeError(
            "should_skip_update_fn cannot read gradients typed unreduced (each device "
            f"holds a partial sum, e.g. {jax.typeof(unreduced[0])}: params typed reduced "
            "under jit), whose true values are not known before the release reduces "
            "them; for non-finite gradients use skip_nonfinite=True, which reads them "
            "with one scalar all-reduce"
        ) from e
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
    """A scalar bool: True iff no leaf of `tree` holds a NaN or Inf.

    A leaf typed unreduced (see `_unreduced`) is read through its devices' partial
    sums: `_unreduced.finite`, one scalar all-reduce, no gradient-sized one."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([_unreduced.finite(x) for x in leaves]).all()


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `jnp.where(pred, a, b)`: a selection, never a 0/1 multiply."""
    return jax.tree.map(lambda a, b: select(pred, a, b), on_true, on_false)
