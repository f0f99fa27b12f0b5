"""What a release spends: the stores' arrays it consumes, and what it leaves in them.

A release spends its running sums: after it they hold no meaningful values, and the
next step restarts them (`_sums.restarted`). So their buffers are free for the
release's own values, which then need none of their own:

- `spent`: the array of each store a release spends (a dense sum; a dense leaf's
  values, not its per-row counts) and how to put an array back in its store.
- `reduced_first`: the sums typed unreduced (params `as_reduced` under `jax.jit`),
  all-reduced before the kinds release them, each into its own buffer on TPU
  (`_branch.reduced_in_place`); `cleared`: what a release that applies its updates
  itself leaves in those buffers.
- `typed`, `behind_barrier`, `out_of_stores`: updates that travel out of the branch
  in the stores' buffers (the canonical step on params `as_reduced`), typed as the
  stores inside it and like the params after it.

docs/design.md ("Updates typed as the sums, in the sums' buffers"; "The release's
all-reduces on TPU") has the measurements behind each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
from jax import lax

from optax_accum import _branch, _protocol, _unreduced

if TYPE_CHECKING:
    from optax_accum._engine import Layout, Storage


def spent(layout: Layout, storage: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The arrays a release spends, in the storage's tree, and `put` (`Storage.spent_in`)."""
    stores = layout.stores(storage)
    parts = layout.map(lambda kind, _, store: kind.spent_in(store), stores, stores)
    put = lambda spent: layout.treedef.unflatten(  # noqa: E731
        [p(a) for (_, p), a in zip(parts, layout.stores(spent), strict=True)]
    )
    return layout.treedef.unflatten([a for a, _ in parts]), put


class Reduced(NamedTuple):
    """The spent tree after `reduced_first`.

    Attributes:
      left: what its buffers hold (the sums, or on TPU the totals typed as the sums).
      totals: the tree with the reduced sums' totals in their places, typed as
        `_unreduced.reduced_sum` gives them (a kind's `reduced_sum` of one then moves
        nothing), the other arrays as they were.
      at: the positions (in the layout's order) of the arrays reduced.
    """

    left: Any
    totals: Any
    at: tuple[int, ...]


def _replaced(items: list, at: tuple[int, ...], new: list) -> list:
    """`items` with `new[j]` in place of `items[at[j]]`."""
    out = list(items)
    for i, x in zip(at, new, strict=True):
        out[i] = x
    return out


# Sums with fewer elements are left to their kinds' releases: an all-reduce's own
# output is then small, and on TPU the nesting changed how the compiler stages small
# sums through its vector memory (v5e, 8 leaves of 128 x 64, `apply_gradients`: 7.25
# params-sized trees of HBM traffic a held step before, 9.0 nested; of 512 x 512: 2.5
# and 2.9). From 2048 x 2048 the nested release kept fewer temporaries and the same
# traffic (benchmarks/README.md).
_IN_PLACE_MIN_SIZE = 1 << 20


def reduced_first(layout: Layout, spent: Any, released: jax.Array) -> Reduced:
    """The spent arrays of the kinds that sum (`Storage.summed`), typed unreduced and
    of at least `_IN_PLACE_MIN_SIZE` elements, all-reduced before the kinds' releases,
    inside the branch whose predicate is `released`: on TPU each into its own buffer,
    elsewhere each into a new array, as a kind's release would
    (`_branch.reduced_in_place`)."""
    arrays = layout.stores(spent)
    at = tuple(
        i
        for i, (k, a) in enumerate(zip(layout.of, arrays, strict=True))
        if layout.kinds[k].summed and _unreduced.unreduced_axes(a) and a.size >= _IN_PLACE_MIN_SIZE
    )
    if not at:
        return Reduced(spent, spent, at)
    left, totals = _branch.reduced_in_place([arrays[i] for i in at], released)
    unflatten = layout.treedef.unflatten
    return Reduced(
        unflatten(_replaced(arrays, at, left)), unflatten(_replaced(arrays, at, totals)), at
    )


def cleared(layout: Layout, reduced: Reduced, spent: Any, after: Any) -> Any:
    """What a release that applies its updates itself (so that none travels in the
    spent buffers) returns in them: `reduced.left`, with the arrays it reduced cleared
    after the inner optimizer made `after` (its new state) from their totals
    (`_branch.cleared_after`)."""
    if not reduced.at:
        return reduced.left
    sums, totals, left = (layout.stores(t) for t in (spent, reduced.totals, reduced.left))
    out = _branch.cleared_after(
        [totals[i] for i in reduced.at],
        [sums[i] for i in reduced.at],
        [left[i] for i in reduced.at],
        after,
    )
    return layout.treedef.unflatten(_replaced(left, reduced.at, out))


def typed(kind: Storage, in_stores: bool) -> Callable[[Any, Any], Any]:
    """How `kind` types a released update: to travel in its store's buffer
    (`in_stores`), or like its param."""
    return kind.spent_as if in_stores and kind.spent_as is not None else kind.retyped


def behind_barrier(operand: tuple) -> tuple:
    """The branch's `(inner_state, storage)` with each store read through an
    optimization barrier of its own.

    The partitioner puts copies around a value typed unreduced (the branch's stores)
    and around the cast after it (`_unreduced.out_of_sum_type`); the TPU compiler's
    conditional code motion sinks them into both branches, which then return the
    stores twice (TPU v5e, 8 leaves of 4096 x 8192: a params-sized tree of
    temporaries more). It moves nothing across a barrier. One barrier around all the
    stores was itself sunk at 2 leaves (a leaf more); a barrier per store was not, at
    1 to 16 leaves.
    """
    kept, spent = operand
    return kept, jax.tree.map(lax.optimization_barrier, spent)


def out_of_stores(updates: Any) -> Any:
    """Updates that travelled in the stores' buffers (arrays, or a `Selection` of
    them), typed like the params again (`_unreduced.out_of_sum_type`)."""
    if not isinstance(updates, _protocol.Selection):
        return jax.tree.map(_unreduced.out_of_sum_type, updates)
    take = updates.take
    return updates._replace(
        take=lambda state: jax.tree.map(_unreduced.out_of_sum_type, take(state))
    )


__all__ = [
    "Reduced",
    "behind_barrier",
    "cleared",
    "out_of_stores",
    "reduced_first",
    "spent",
    "typed",
]
