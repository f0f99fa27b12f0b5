"""Row-sparse gradients of embedding lookups, straight from `jax.value_and_grad`.

The gradient of a loss with respect to an embedding table is zero except on the rows
the batch looked up, yet `jax.grad` returns (and XLA materialises) the whole table.
`embedding_value_and_grad` differentiates with respect to the gathered rows instead
and pairs their gradients with the ids, giving an `IndexedSlices` per table, ready for
`sparse_conditional_accumulator`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.extend.core import Literal

from optax_accum import _checks, _row_ids
from optax_accum.indexed_slices import IndexedSlices


def _table_paths(loss_fn: Callable, params: Any, args: tuple, kwargs: dict) -> list:
    """Traces `loss_fn` once (no computation) and returns, per `nn.Embed` call in order,
    the key path of its table in `params` and the shape of the ids it looked up.

    The trace returns the table each call reads; in the traced program, that output is
    one of the program's inputs, a leaf of `params`, whose position gives its path. A
    table computed inside `loss_fn` (transformed, or not a param) is no input, and an
    error."""
    calls: list = []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]

    def probe(params: Any) -> list:
        tables: list = []

        def record(next_fun: Callable, a: tuple, kw: dict, ctx: Any) -> Any:
            if isinstance(ctx.module, nn.Embed):
                if ctx.method_name == "attend":
                    raise ValueError(
                        f"embedding_value_and_grad: nn.Embed at {ctx.module.path} is used "
                        "by attend() (a dense use of the whole table), so its gradient is "
                        "not row-sparse; use jax.value_and_grad for this model"
                    )
                if ctx.method_name == "__call__":
                    tables.append(ctx.module.embedding)
                    calls.append((ctx.module.path, tuple(jnp.shape(a[0]))))
            return next_fun(*a, **kw)

        with nn.intercept_methods(record):
            loss_fn(params, *args, **kwargs)
        return tables

    program = jax.make_jaxpr(probe)(params).jaxpr
    inputs = dict(zip(program.invars, range(len(program.invars)), strict=True))
    paths = []
    for (module_path, ids_shape), table in zip(calls, program.outvars, strict=True):
        position = None if isinstance(table, Literal) else inputs.get(table)
        if position is None:
            raise ValueError(
                f"embedding_value_and_grad: the table of nn.Embed at {module_path} is not a "
                "leaf of the params given (was it transformed inside loss_fn?)"
            )
        paths.append((flat[position][0], ids_shape))
    return paths


def embedding_value_and_grad(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
    """`jax.value_and_grad` for Flax models, with row-sparse embedding gradients.

    `loss_fn(params, *args, **kwargs)` runs a Flax linen model (for example through
    `model.apply({"params": params}, batch)`) and returns a scalar loss (or
    `(loss, aux)` with `has_aux`). The returned function computes the same value and
    gradients as `jax.value_and_grad(loss_fn, has_aux=has_aux)`, except that the
    gradient of each `nn.Embed` table is an `IndexedSlices`: one row per id looked up
    (ids repeated as often as they occur, every call of that table concatenated), with
    `dense_shape` the table's shape. No table-sized gradient is ever built.

    How: the model is traced once to find its `nn.Embed` calls; then each call is
    intercepted to return `table[ids] + delta`, with the table held constant and
    `delta` a zero input of the rows' shape, and the loss is differentiated with
    respect to `delta` and the other params. The gradient of `delta` is the gradient
    of the gathered rows.

    Limits: only `nn.Embed.__call__` lookups are made sparse; a table also used
    through `attend` (tied output embeddings) raises a ValueError, and one read in
    any other way (e.g. `self.embed.embedding @ x`) would get no gradient for that use,
    so do not use this helper for such models. Ids outside the table give NaN rows in
    the forward pass, as `nn.Embed` does, and are padding in the gradient (the id
    `rows`); ids of any integer dtype are returned as int32 row ids.

    TF counterpart: TF's gradient of `tf.nn.embedding_lookup` (a `tf.gather`) is a
    `tf.IndexedSlices` by itself; this gives JAX and Flax the same.

    Args:
      loss_fn: `loss_fn(params, *args, **kwargs) -> loss` (or `(loss, aux)`).
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Returns:
      A function of `(params, *args, **kwargs)` returning `(value, grads)`, where
      `value` is the loss (or `(loss, aux)`) and `grads` has the structure of `params`.

    Example:
      >>> import jax.numpy as jnp, flax.linen as nn, optax_accum
      >>> model = nn.Embed(num_embeddings=1000, features=2)
      >>> params = model.init(jax.random.key(0), jnp.zeros(1, int))["params"]
      >>> loss = lambda p, ids: model.apply({"params": p}, ids).sum()
      >>> value, grads = optax_accum.embedding_value_and_grad(loss)(params, jnp.array([7, 3, 7]))
      >>> grads["embedding"].indices.tolist(), grads["embedding"].values.tolist()
      ([7, 3, 7], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
      >>> grads["embedding"].dense_shape
      (1000, 2)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {loss_fn!r} ({type(loss_fn).__name__})")
    has_aux = _checks.require_bool("has_aux", has_aux)

    def value_and_grad_fn(params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        calls = _table_paths(loss_fn, params, args, kwargs)
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        tables = {path for path, _ in calls}
        leaves = [x for _, x in flat]
        is_table = [path in tables for path, _ in flat]
        by_path = {path: x for path, x in flat}
        deltas = [
            jnp.zeros((*ids_shape, *jnp.shape(by_path[path])[1:]), jnp.result_type(by_path[path]))
            for path, ids_shape in calls
        ]

        def differentiable(rest: list, deltas: list) -> tuple[Any, Any]:
            it = iter(rest)  # the tables are closed over: constants, never differentiated
            full = [x if t else next(it) for x, t in zip(leaves, is_table, strict=True)]
            looked_up: list = []

            def substitute(next_fun: Callable, a: tuple, kw: dict, ctx: Any) -> Any:
                if not (isinstance(ctx.module, nn.Embed) and ctx.method_name == "__call__"):
                    return next_fun(*a, **kw)
                ids = a[0]
                rows = jnp.take(ctx.module.embedding, ids, axis=0) + deltas[len(looked_up)]
                looked_up.append(ids)
                if ctx.module.dtype is not None:
                    rows = rows.astype(ctx.module.dtype)
                return rows

            with nn.intercept_methods(substitute):
                out = loss_fn(jax.tree.unflatten(treedef, full), *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, looked_up)

        rest = [x for x, t in zip(leaves, is_table, strict=True) if not t]
        (loss, (aux, looked_up)), (rest_grads, delta_grads) = jax.value_and_grad(
            differentiable, argnums=(0, 1), has_aux=True
        )(rest, deltas)

        sparse = {}
        for path in tables:
            table = by_path[path]
            mine = [k for k, (p, _) in enumerate(calls) if p == path]
            ids = jnp.concatenate([jnp.ravel(looked_up[k]) for k in mine])
            ids = _row_ids.row_ids(ids, jnp.shape(table)[0])  # exact for every id dtype
            rows = jnp.concatenate(
                [delta_grads[k].reshape((-1, *jnp.shape(table)[1:])) for k in mine]
            )
            sparse[path] = IndexedSlices(ids, rows, jnp.shape(table))
        it = iter(rest_grads)
        grads = [sparse[path] if path in tables else next(it) for path, _ in flat]
        value = (loss, aux) if has_aux else loss
        return value, jax.tree.unflatten(treedef, grads)

    return value_and_grad_fn


__all__ = ["embedding_value_and_grad"]
