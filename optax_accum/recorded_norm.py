"""Recording the global norm of the updates a chain passes on, to log it later.

`record_global_norm()` passes its updates through unchanged and keeps their global L2
norm in its state; `recorded_global_norm(state)` reads it from any state that holds
one. Inside an accumulator (`conditional_accumulator(optax.chain(record_global_norm(),
optax.adam(...)), k)`) it runs only on the releasing steps, on the window's reduced
aggregate, so a training loop logs the window's gradient norm without computing a
norm, or reducing anything, on the held steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_accum import _compat, _row_ids, _state_tree, _unreduced
from optax_accum.indexed_slices import IndexedSlices


class RecordGlobalNormState(NamedTuple):
    """State of `record_global_norm`.

    Attributes:
      global_norm: the global L2 norm of the last updates that passed through (0
        before the first): a scalar, float64 when a param is (complex128 included),
        float32 otherwise, replicated (on the params' mesh when they lie on one with
        explicit axes).

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> optax_accum.record_global_norm().init({"w": jnp.zeros(2)})
      RecordGlobalNormState(global_norm=Array(0., dtype=float32))
    """

    global_norm: jax.Array


def record_global_norm() -> optax.GradientTransformationExtraArgs:
    """Passes the updates on unchanged and records their global L2 norm in its state.

    The norm is `optax.global_norm`'s, `sqrt(sum of |u|^2 over every element of every
    leaf)`, summed in float32 at least (float16 and bfloat16 leaves are cast up), so a
    tree of mixed dtypes works. A row-sparse `IndexedSlices` leaf counts as its dense
    tensor: rows with the same id are added first, padding ids are left out (no
    table-sized array is built).

    Put it first in the chain an accumulator wraps:
    `conditional_accumulator(optax.chain(record_global_norm(), optax.adam(1e-3)), k)`.
    The accumulator runs its inner chain only on the steps that release, on the
    window's aggregate (the mean, or the sum, of its gradients), so the state records
    the window's gradient norm at each release and keeps it through the held steps,
    and nothing about the norm runs on a held step. On params typed reduced
    (`optax_accum.as_reduced`) the aggregate is already reduced there (the window's one
    all-reduce); the norm of a leaf sharded over mesh axes (FSDP) then costs one scalar
    all-reduce over them, on the release only. `recorded_global_norm(state)` reads it.

    It is the norm of what its inner optimizer is given: with `reduction="mean"`, of
    the window's mean gradient, not the mean of each step's gradient norm (which
    `optax.MultiSteps` users log per step, at one all-reduce of the gradient each).

    Updates typed unreduced (`{U:axes}`: each device's partial sum, as `jax.grad` gives
    for params typed reduced) have no norm until they are summed, which would be the
    all-reduce this library saves; they raise a TypeError that says where to put the
    transform instead.

    Returns:
      An `optax.GradientTransformationExtraArgs` (extra arguments are accepted and
      ignored) whose state is a `RecordGlobalNormState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optax_accum
      >>> inner = optax.chain(optax_accum.record_global_norm(), optax.sgd(0.1))
      >>> tx = optax_accum.conditional_accumulator(inner, num_required=2)
      >>> params = {"w": jnp.zeros(2)}
      >>> state, update = tx.init(params), jax.jit(tx.update)
      >>> for g in ([3.0, 0.0], [3.0, 8.0]):  # the window's mean gradient is [3, 4]
      ...     _, state = update({"w": jnp.array(g)}, state, params)
      >>> float(optax_accum.recorded_global_norm(state))
      5.0
    """

    def init_fn(params: optax.Params) -> RecordGlobalNormState:
        return RecordGlobalNormState(global_norm=_zero_norm(params))

    def update_fn(
        updates: optax.Updates,
        state: RecordGlobalNormState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, RecordGlobalNormState]:
        del params, extra_args
        norm = _global_norm(updates).astype(state.global_norm.dtype)
        return updates, RecordGlobalNormState(global_norm=_typed_like(norm, state.global_norm))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def recorded_global_norm(state: Any) -> jax.Array:
    """The global norm that the outermost `record_global_norm` in `state` recorded.

    Finds the `RecordGlobalNormState` inside whatever state holds it (the transform's
    own state, an `optax.chain` tuple, an accumulator's `inner_state`, an
    `optax.inject_hyperparams` or `optax.MultiSteps` state, a dict, a Flax
    `TrainState`'s `opt_state`, a batch of states made under `jax.vmap`), breadth
    first. Inside an accumulator it is the norm of the last window it released (0
    before the first release). Reading it costs nothing: it is a replicated scalar,
    computed at the release.

    Args:
      state: a state holding a `RecordGlobalNormState`.

    Returns:
      The recorded norm, a scalar (an array of them for a batched state), in a buffer
      of its own outside tracing, so it may be read after `state` is donated to a
      jitted step.

    Raises:
      ValueError: when `state` holds no `RecordGlobalNormState`.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax.chain(optax_accum.record_global_norm(), optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([6.0, 8.0]), state)
      >>> float(optax_accum.recorded_global_norm(state))
      10.0
    """
    found = _state_tree.find(state, RecordGlobalNormState)
    if found is None:
        raise ValueError(
            "state must hold a RecordGlobalNormState: put optax_accum.record_global_norm() "
            "in the optimizer's chain (inside an accumulator, first in the chain it wraps); "
            f"got {type(state).__name__}"
        )
    norm = found.global_norm
    return norm if isinstance(norm, jax.core.Tracer) else jnp.copy(norm)


# --------------------------------------------------------------------------- helpers


def _norm_dtype(params: Any) -> jnp.dtype:
    """float64 when a param is float64 or complex128, float32 otherwise."""
    wide = any(_real_dtype(_leaf_dtype(x)).itemsize > 4 for x in _leaves(params))
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _real_dtype(dtype: Any) -> jnp.dtype:
    """The dtype of `dtype`'s real part (the dtype itself when it is real)."""
    return (
        jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else jnp.dtype(dtype)
    )


def _leaves(tree: Any) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, IndexedSlices))


def _leaf_dtype(x: Any) -> Any:
    return x.values.dtype if isinstance(x, IndexedSlices) else jnp.result_type(x)


def _zero_norm(params: Any) -> jax.Array:
    """A zero norm typed as the norm an update computes: replicated on the params' mesh
    when they lie, placed, on one with explicit axes (outside `jax.set_mesh` too); under
    tracing, made in the current mesh's context, as the norm will be."""
    dtype = _norm_dtype(params)
    for x in _leaves(params):
        x = x.values if isinstance(x, IndexedSlices) else x
        if isinstance(x, jax.core.Tracer):
            continue
        sharding = getattr(x, "sharding", None)
        aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
        placed = isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh)
        if placed and _compat.explicit_sharding(aval) is not None:
            return jax.device_put(np.zeros((), dtype), NamedSharding(sharding.mesh, P()))
    return jnp.zeros((), dtype)


def _typed_like(norm: jax.Array, like: jax.Array) -> jax.Array:
    """`norm` typed plain (a reduced scalar is a full copy already: free), as `like`."""
    if _compat.sum_types(norm) == _compat.sum_types(like):
        return norm
    return _compat.retyped(norm, like=like)


def _global_norm(updates: Any) -> jax.Array:
    """The global L2 norm of `updates`, summed in float32 at least."""
    flat = jax.tree_util.tree_flatten_with_path(
        updates, is_leaf=lambda x: isinstance(x, IndexedSlices)
    )[0]
    squares = []
    for path, x in flat:
        axes = _unreduced.unreduced_axes(x.values if isinstance(x, IndexedSlices) else x)
        if axes:
            raise TypeError(
                f"record_global_norm needs summed updates, but updates"
                f"{jax.tree_util.keystr(path)} is typed unreduced over {sorted(axes)} (each "
                f"device's partial sum, the gradient of a param typed reduced): "
                f"{jax.typeof(x)}. Put it inside an accumulator, which gives its inner "
                "chain the window's reduced sum: conditional_accumulator(optax.chain("
                "optax_accum.record_global_norm(), optax.adam(...)), k)"
            )
        squares.append(_sum_of_squares(x))
    if not squares:
        return jnp.zeros((), jnp.float32)
    dtype = jnp.float64 if any(q.dtype == jnp.float64 for q in squares) else jnp.float32
    return jnp.sqrt(sum(q.astype(dtype) for q in squares))


def _sum_of_squares(x: Any) -> jax.Array:
    """The sum of `|x|^2` over `x`'s elements, in float32 at least; for an
    `IndexedSlices`, over its dense tensor's."""
    if isinstance(x, IndexedSlices):
        return _sparse_sum_of_squares(x)
    x = jnp.asarray(x)
    real = jnp.abs(x) if jnp.issubdtype(x.dtype, jnp.complexfloating) else x
    if real.dtype != jnp.float64:
        real = real.astype(jnp.float32)
    return _compat.retyped(jnp.sum(real * real), reduced=frozenset())


def _sparse_sum_of_squares(x: IndexedSlices) -> jax.Array:
    """`_sum_of_squares(x.to_dense())` without the dense tensor: the rows of each id are
    added (over the slices' own rows), padding ids left out."""
    rows = x.dense_shape[0]
    if rows < 0:
        raise ValueError(
            f"record_global_norm needs an IndexedSlices' row count, but dense_shape is "
            f"{x.dense_shape}; rebuild it with a known dense_shape"
        )
    n = x.indices.shape[0]
    ids = _row_ids.row_ids(x.indices, rows)
    unique, inverse = jnp.unique(ids, size=n, fill_value=rows, return_inverse=True)
    summed = jax.ops.segment_sum(x.values, inverse.reshape(-1), num_segments=n)
    kept = (unique < rows).reshape((n,) + (1,) * (summed.ndim - 1))
    return _sum_of_squares(jnp.where(kept, summed, jnp.zeros((), summed.dtype)))


__all__ = ["RecordGlobalNormState", "record_global_norm", "recorded_global_norm"]
