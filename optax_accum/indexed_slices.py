"""Row-sparse gradients: `IndexedSlices`, `apply_updates`, `densify` and `sparse_sgd`.

An embedding table's gradient touches a few rows of a large table. `IndexedSlices`
holds just those rows: `values[i]` is the gradient of row `indices[i]` of a tensor of
shape `dense_shape`. It is a pytree whose leaves are `indices` and `values`, with the
static `dense_shape` in its tree definition, so it passes through `jax.jit`, `lax.scan`
and Orbax unchanged and its shapes never depend on data.

Static shapes mean a fixed number of rows. Unused rows are padding: they carry the
index `dense_shape[0]` (one past the last row), and every consumer here
(`to_dense`, `apply_updates`, the sparse accumulator) ignores any index outside
`[0, dense_shape[0])`. A repeated index means the sum of its rows, as in `to_dense`.

Optax's own transforms are element-wise over pytree leaves, so they must never see a
raw `IndexedSlices`: `optax.sgd` would scale the indices as well as the values. Put
`densify()` in front of a dense optimizer, or use `sparse_sgd`, which scales only the
values. The mistake is caught where it can be: an `IndexedSlices` refuses arithmetic,
and rebuilding one whose indices came back with a floating dtype (what any float
scaling does) raises a TypeError. An integer-preserving map (`optax.scale(2)`) cannot
be told apart from a legitimate one and is not caught.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum import _compat, _row_ids


def _is_array_like(x: Any) -> bool:
    """True for arrays, tracers and ShapeDtypeStructs: leaves whose shape we can check."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_dense_shape(dense_shape: Any) -> tuple[int, ...]:
    def is_int(d: Any) -> bool:
        return isinstance(d, int | np.integer) and not isinstance(d, bool)

    if not isinstance(dense_shape, tuple | list) or not all(is_int(d) for d in dense_shape):
        raise TypeError(
            f"dense_shape must be a tuple of ints, got {dense_shape!r} "
            f"({type(dense_shape).__name__})"
        )
    shape = tuple(int(d) for d in dense_shape)
    if not shape:
        raise ValueError("dense_shape must have at least one dimension (the rows), got ()")
    if shape[0] < -1 or any(d < 0 for d in shape[1:]):
        raise ValueError(
            f"dense_shape must hold non-negative sizes (dim 0 may be -1 for unknown), got {shape}"
        )
    return shape


def _check_leaf_kind(name: str, leaf: Any) -> None:
    """TypeError for a Python list, tuple or number given as `indices` or `values`.

    Such leaves would otherwise pass construction unchecked and fail later, deep inside
    JAX. Other objects (arrays, tracers, `PartitionSpec` or sharding leaves of a spec
    tree) are accepted.
    """
    if type(leaf) in (list, tuple) or isinstance(leaf, bool | int | float | complex):
        raise TypeError(
            f"IndexedSlices {name} must be an array (jax.Array or numpy.ndarray), got "
            f"{type(leaf).__name__}; wrap it in jnp.asarray"
        )


@jax.tree_util.register_pytree_with_keys_class
class IndexedSlices:
    """Rows `values` of a tensor of shape `dense_shape`, at row ids `indices`.

    The sparse gradient of TF (`tf.IndexedSlices`) as a JAX pytree. `indices` and
    `values` are its leaves; `dense_shape` is static (a tuple of ints) and part of
    the tree definition. `dense_shape[0]` may be -1, meaning the number of rows is
    unknown (TF's host accumulator returns that); such slices cannot be turned into a
    dense array on their own, but `apply_updates` takes the rows from the params.

    Indices outside `[0, dense_shape[0])` are padding and are ignored by every
    consumer; by convention padding uses `dense_shape[0]`. Repeated indices add up.
    Unlike TF, negative indices are never wrapped around: they are padding too.

    `indices` and `values` must not be Python lists, tuples or numbers (a TypeError).
    When both are arrays (or tracers), the constructor checks that `indices` is an
    integer vector, that `values` has one row per index, and that each row has the
    shape `dense_shape[1:]`. Pytree operations (`jax.tree.map`,
    `jax.jit`, `jax.vmap`) rebuild the node without these checks, so leaves may be
    anything there, except that floating-point indices are refused (see the module
    docstring: that is an optax transform applied to raw slices).

    An `IndexedSlices` refuses arithmetic (`+`, `*`, ...): it would be ambiguous
    whether to touch the indices.

    Attributes:
      indices: vector `[nnz]` of row ids, of any integer dtype (ids are compared with
        the row count exactly, so a uint8 255 is row 255 of a 300-row table).
      values: array `[nnz, *dense_shape[1:]]`, the rows.
      dense_shape: tuple of ints, the shape of the dense tensor.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> g = optax_accum.IndexedSlices(
      ...     jnp.array([2, 0, 2]), jnp.array([[1.0, 1.0], [2.0, 0.0], [3.0, 0.0]]), (3, 2))
      >>> g.to_dense()
      Array([[2., 0.],
             [0., 0.],
             [4., 1.]], dtype=float32)
    """

    __slots__ = ("dense_shape", "indices", "values")

    def __init__(self, indices: Any, values: Any, dense_shape: Any) -> None:
        shape = _check_dense_shape(dense_shape)
        _check_leaf_kind("indices", indices)
        _check_leaf_kind("values", values)
        if _is_array_like(indices) and _is_array_like(values):
            _row_ids.check_rows(indices, values, shape)
        self.indices = indices
        self.values = values
        self.dense_shape = shape

    # ------------------------------------------------------------------ pytree

    def tree_flatten_with_keys(self) -> tuple[tuple, tuple[int, ...]]:
        keys = jax.tree_util.GetAttrKey
        return ((keys("indices"), self.indices), (keys("values"), self.values)), self.dense_shape

    @classmethod
    def tree_unflatten(cls, dense_shape: tuple[int, ...], children: Any) -> IndexedSlices:
        indices, values = children
        _row_ids.check_index_dtype(indices)
        node = object.__new__(cls)
        node.indices, node.values, node.dense_shape = indices, values, dense_shape
        return node

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_dense(cls, dense: Any, num_rows: int | None = None) -> IndexedSlices:
        """The nonzero rows of `dense`, sorted, in a fixed number `num_rows` of slots.

        Rows holding any nonzero (or NaN) element are kept in increasing order; the
        remaining slots are padding (index `dense.shape[0]`, zero values). With
        `num_rows=None`, every row is kept (`indices = arange(rows)`).

        Args:
          dense: an array of rank >= 1.
          num_rows: how many rows the result holds (a Python int >= 0), or None.

        Returns:
          An `IndexedSlices` with `num_rows` rows and `dense_shape == dense.shape`.

        Raises:
          ValueError: if `dense` has more than `num_rows` nonzero rows and is concrete
            (under `jax.jit` the rows with the smallest ids are kept and the others cut,
            so size `num_rows` for the worst case), or for a bad `num_rows`.

        Example:
          >>> import jax.numpy as jnp, optax_accum
          >>> g = optax_accum.IndexedSlices.from_dense(jnp.array([[0.0], [5.0], [0.0]]), 2)
          >>> g.indices, g.values
          (Array([1, 3], dtype=int32), Array([[5.], [0.]], dtype=float32))
        """
        dense = jnp.asarray(dense)
        if dense.ndim < 1:
            raise ValueError(f"dense must have rank >= 1, got shape {dense.shape}")
        rows = dense.shape[0]
        if num_rows is None:
            return cls(jnp.arange(rows, dtype=jnp.int32), dense, dense.shape)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int | np.integer) or num_rows < 0:
            raise ValueError(f"num_rows must be None or an int >= 0, got {num_rows!r}")
        touched = (dense != 0).reshape(rows, -1).any(axis=1)
        if not isinstance(touched, jax.core.Tracer) and int(touched.sum()) > num_rows:
            raise ValueError(
                f"dense has {int(touched.sum())} nonzero rows, more than num_rows={num_rows}"
            )
        (indices,) = jnp.nonzero(touched, size=int(num_rows), fill_value=rows)
        indices = indices.astype(jnp.int32)
        values = jnp.take(dense, indices, axis=0, mode="fill", fill_value=0)
        return cls(indices, values, dense.shape)

    # ------------------------------------------------------------------ conversions

    @property
    def padding_index(self) -> int:
        """The index that marks an unused row: `dense_shape[0]` (or int32 max if unknown)."""
        return self.dense_shape[0] if self.dense_shape[0] >= 0 else int(np.iinfo(np.int32).max)

    def to_dense(self) -> jax.Array:
        """The dense tensor: rows scatter-added at their indices, padding ignored.

        Raises:
          ValueError: if `dense_shape[0]` is -1 (unknown number of rows).
        """
        if self.dense_shape[0] < 0:
            raise ValueError(
                f"IndexedSlices.to_dense() needs a known number of rows, but dense_shape is "
                f"{self.dense_shape} (dim 0 unknown, as TF's accumulators return); use "
                "optax_accum.apply_updates with params, or rebuild with a known dense_shape"
            )
        return _scatter_add(jnp.zeros(self.dense_shape, self.values.dtype), self)

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(indices={self.indices!r}, values={self.values!r}, "
            f"dense_shape={self.dense_shape})"
        )

    # ------------------------------------------------------------------ no arithmetic

    def _no_arithmetic(self, *args: Any) -> Any:
        raise TypeError(
            "IndexedSlices does not support arithmetic (it would be ambiguous whether the "
            "indices change); transform .values and rebuild, or call .to_dense()"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __neg__ = __pow__ = __matmul__ = _no_arithmetic

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("IndexedSlices is not an array; call .to_dense() to make one")

    def __jax_array__(self) -> Any:
        raise TypeError("IndexedSlices is not an array; call .to_dense() to make one")


def _is_indexed_slices(x: Any) -> bool:
    """True for an `IndexedSlices` (use as `is_leaf` in `jax.tree` maps)."""
    return isinstance(x, IndexedSlices)


def _scatter_add(target: jax.Array, slices: IndexedSlices) -> jax.Array:
    """`target` plus the rows of `slices` (cast to `target`'s dtype); padding ignored."""
    values = slices.values.astype(target.dtype)
    ids = _row_ids.row_ids(slices.indices, target.shape[0])
    # Under explicit sharding the sum keeps `target`'s layout: each device adds the
    # rows that fall in its shard.
    return target.at[ids].add(values, mode="drop", out_sharding=_compat.sharding_of(target))


def _zeros_laid_out_like(param: Any, dtype: Any) -> jax.Array:
    """Zeros of `param`'s shape in `dtype`, laid out like `param` (under explicit
    sharding each device builds its own shard, never the whole table) and typed plain
    (a param typed reduced gives plain zeros: no data moves)."""
    zeros = jnp.zeros_like(param, dtype=dtype)
    reduced, unreduced = _compat.sum_types(zeros)
    return _compat.retyped(zeros, unreduced=unreduced) if reduced else zeros


def _check_against(param: Any, slices: IndexedSlices, where: str) -> None:
    """Trace-time check that `slices` is a valid sparse update of `param`."""
    _row_ids.check_indices(slices, what=where)
    shape = tuple(jnp.shape(param))
    rows, tail = slices.dense_shape[0], slices.dense_shape[1:]
    if not shape or tail != shape[1:] or rows not in (-1, shape[0]):
        raise ValueError(
            f"{where} has dense_shape {slices.dense_shape}, which does not match the "
            f"param's shape {shape}"
        )


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
    """`optax.apply_updates` that also scatter-adds `IndexedSlices` updates.

    A drop-in replacement: dense leaves are added exactly as `optax.apply_updates`
    does, and an `IndexedSlices` leaf adds its rows into its param (repeated indices
    add up, padding and out-of-range indices are ignored), touching no other row.
    `dense_shape[0] == -1` takes the row count from the param.

    TF counterpart: what `Optimizer.apply_gradients` does with a `tf.IndexedSlices`
    gradient, a scatter-add of its rows (`tf.compat.v1.scatter_add`).

    Args:
      params: the parameters (dense arrays).
      updates: the same tree, with any leaf possibly an `IndexedSlices`.

    Returns:
      The updated params, in the params' dtypes (updates of another floating dtype
      are added in the wider one, then cast back, as `optax.apply_updates` does).

    Raises:
      ValueError / TypeError: at trace time, when an `IndexedSlices` does not match its
        param's shape, or its indices are not integer.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> params = {"emb": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
      >>> updates = {
      ...     "emb": optax_accum.IndexedSlices(jnp.array([1, 3]), jnp.ones((2, 2)), (3, 2)),
      ...     "b": jnp.ones(2),
      ... }
      >>> new = optax_accum.apply_updates(params, updates)
      >>> new["emb"].tolist(), new["b"].tolist()
      ([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], [1.0, 1.0])
    """

    leaf = lambda x: x is None or _is_indexed_slices(x)  # noqa: E731
    expected, got = (
        jax.tree.structure(params, is_leaf=leaf),
        jax.tree.structure(updates, is_leaf=leaf),
    )
    if expected != got:
        raise ValueError(
            f"updates must have the tree structure of params: expected {expected}, got {got}"
        )

    def apply(path: Any, p: Any, u: Any) -> Any:
        if isinstance(u, IndexedSlices):
            _check_against(p, u, f"updates{jax.tree_util.keystr(path)}")
            return _scatter_add(jnp.asarray(p), u)
        if p is None or u is None or not hasattr(u, "dtype") or u.dtype == jnp.result_type(p):
            return optax.apply_updates(p, u)
        # Mixed precision (float32 updates on bfloat16 params, say): added in the
        # promoted dtype and cast back, as optax does, with the promotion spelled out.
        with jax.numpy_dtype_promotion("standard"):
            total = jnp.promote_types(jnp.result_type(p), u.dtype)
        return (jnp.asarray(p).astype(total) + u.astype(total)).astype(jnp.result_type(p))

    return jax.tree_util.tree_map_with_path(apply, params, updates, is_leaf=leaf)


def densify() -> optax.GradientTransformationExtraArgs:
    """A stateless transform that turns `IndexedSlices` leaves into dense arrays.

    Put it in front of any dense Optax optimizer (`optax.chain(densify(), optax.adam(
    1e-3))`) to use that optimizer inside `sparse_conditional_accumulator`, or
    anywhere sparse gradients meet a transform that expects arrays. Dense leaves pass
    through. Slices with an unknown row count take it from the params.

    TF counterpart: `tf.convert_to_tensor` of a `tf.IndexedSlices`, which sums its rows
    into a dense tensor.

    Returns:
      An `optax.GradientTransformationExtraArgs` with an empty state.

    Example:
      >>> import jax.numpy as jnp, optax, optax_accum
      >>> tx = optax.chain(optax_accum.densify(), optax.sgd(0.5))
      >>> g = optax_accum.IndexedSlices(jnp.array([0, 0]), jnp.ones((2, 1)), (2, 1))
      >>> updates, _ = tx.update(g, tx.init(jnp.zeros((2, 1))))
      >>> updates.ravel().tolist()
      [-1.0, -0.0]
    """

    def to_dense(path: Any, u: Any, p: Any = None) -> Any:
        if not isinstance(u, IndexedSlices):
            return u
        where = f"updates{jax.tree_util.keystr(path)}"
        if p is not None:
            _check_against(p, u, where)
            return _scatter_add(_zeros_laid_out_like(p, u.values.dtype), u)
        _row_ids.check_indices(u, what=where)
        return u.to_dense()

    def densify_tree(updates: optax.Updates, params: optax.Params | None) -> optax.Updates:
        trees = (updates,) if params is None else (updates, params)
        return jax.tree_util.tree_map_with_path(to_dense, *trees, is_leaf=_is_indexed_slices)

    return optax.with_extra_args_support(optax.stateless(densify_tree))


def sparse_sgd(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformationExtraArgs:
    """SGD that scales only the values of `IndexedSlices` (and dense leaves as usual).

    `optax.sgd` must not see raw `IndexedSlices`: it would scale the row ids too. This
    is `optax.sgd(learning_rate)` (without momentum) for trees that mix `IndexedSlices`
    and arrays: each update is `-learning_rate * gradient`, and sparse updates stay
    sparse, so `sparse_conditional_accumulator(sparse_sgd(lr), ...)` followed by
    `optax_accum.apply_updates` writes only the rows some gradient touched.

    TF counterpart: `tf.train.GradientDescentOptimizer` applied to `tf.IndexedSlices`
    gradients, which updates only their rows.

    Args:
      learning_rate: a scalar (may be traced, for `optax.inject_hyperparams`) or an
        `optax.Schedule` of the update count.

    Returns:
      An `optax.GradientTransformationExtraArgs`, with the state of
      `optax.scale_by_learning_rate`.

    Example:
      >>> import jax.numpy as jnp, optax_accum
      >>> g = optax_accum.IndexedSlices(jnp.array([3]), jnp.array([[2.0]]), (5, 1))
      >>> tx = optax_accum.sparse_sgd(0.5)
      >>> u, _ = tx.update(g, tx.init(jnp.zeros((5, 1))))
      >>> u.indices.tolist(), u.values.tolist()
      ([3], [[-1.0]])
    """
    scale = optax.scale_by_learning_rate(learning_rate)

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        del params, extra_args
        values = jax.tree.map(
            lambda u: u.values if isinstance(u, IndexedSlices) else u,
            updates,
            is_leaf=_is_indexed_slices,
        )
        scaled, state = scale.update(values, state)
        rebuilt = jax.tree.map(
            lambda u, s: (
                IndexedSlices(u.indices, s, u.dense_shape) if isinstance(u, IndexedSlices) else s
            ),
            updates,
            scaled,
            is_leaf=_is_indexed_slices,
        )
        return rebuilt, state

    return optax.GradientTransformationExtraArgs(scale.init, update_fn)


__all__ = ["IndexedSlices", "apply_updates", "densify", "sparse_sgd"]
