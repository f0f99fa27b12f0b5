"""The sparse host accumulator's slot table: which row id each slot of the device
buffer holds, on the host, in NumPy.

A batch's rows live in slots, in arrival order: `slot_ids[s]` is the row id in slot
`s`, `row_counts[s]` how many accepted gradients touched it and `row_weights[s]` the
sum of their weights. `SlotHints` finds a gradient's slots in O(nnz) and
`SlotHints.place` gives new row ids new slots; `sorted_slots` puts the slots in row-id
order for a take. Sizes are bucketed to
powers of two (`bucket`), so the device kernels compile a bounded number of times.
"""

from __future__ import annotations

import numpy as np

_MIN_BUCKET = 8
_DENSE_IDS = 32  # row ids below 32x their count are sorted through a table, not a sort


def bucket(n: int) -> int:
    """The smallest power of two >= max(n, 8): sizes that bound compilations."""
    return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


def unique_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A gradient's sorted unique row ids and, unless `ids` already were (as TF
    expects), the index of each id among them."""
    if ids.shape[0] < 2 or (ids[1:] > ids[:-1]).all():
        return ids, None
    return np.unique(ids, return_inverse=True)


class SlotHints:
    """Where each row id was last given a slot: a table indexed by row id (or, past
    `limit` entries, by its low bits), so finding a gradient's slots costs O(nnz),
    not a merge with every row of the batch.

    A hint is only a guess: a batch trusts it only when its `slot_ids` confirm it, so
    the table is never cleared, outlives batches, and can be written before a kernel
    that may fail. A row id whose hint was overwritten by another's (only past
    `limit`) gets a second slot; the take adds such slots together.
    """

    limit = 1 << 22  # entries at most (16 MiB)

    def __init__(self) -> None:
        self.table = np.zeros(0, np.int32)

    def _keys(self, ids: np.ndarray) -> np.ndarray:
        return ids & (self.table.shape[0] - 1)

    def find(self, ids: np.ndarray, slot_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the sorted unique `ids` and a batch whose slots hold `slot_ids`: a slot
        for each (a fresh int32 vector), and where it has none (its entry there is then
        meaningless). Few NumPy calls: this runs under the accumulator's lock, and each
        call over a long vector hands the GIL to another thread and waits to get it back."""
        n, table = slot_ids.shape[0], self.table
        if n == 0 or ids.shape[0] == 0 or table.shape[0] == 0:
            return np.zeros(ids.shape, np.int32), np.ones(ids.shape, bool)
        hint = table[ids if ids[-1] < table.shape[0] else self._keys(ids)]
        hint = np.where(hint < n, hint, 0)
        return hint, slot_ids[hint] != ids

    def remember(self, ids: np.ndarray, slots: np.ndarray, slot_ids: np.ndarray) -> None:
        """Records that sorted `ids` are in `slots` of a batch whose slots hold
        `slot_ids` (used to refill a table that grows)."""
        if ids.shape[0] == 0:
            return
        top = int(ids[-1])
        size = min(bucket(top + 1), self.limit)
        if size > self.table.shape[0]:
            self.table = np.zeros(size, np.int32)
            self.table[self._keys(slot_ids)] = np.arange(slot_ids.shape[0], dtype=np.int32)
        self.table[ids if top < self.table.shape[0] else self._keys(ids)] = slots

    def place(
        self,
        slot_ids: np.ndarray,
        row_counts: np.ndarray,
        row_weights: np.ndarray | None,
        unique: np.ndarray,
        inverse: np.ndarray | None,
        weight: float | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """A batch's `slot_ids`, `row_counts` and `row_weights` (float32) with the sorted
        `unique` row ids of one gradient of `weight` (None: 1) added, as new arrays (row
        ids it has no slot for get the next ones), and the slot of each of the
        gradient's values (`inverse` as `unique_ids` returns it). `row_weights` is None
        while no gradient of the batch had a weight (they are then the counts)."""
        n = slot_ids.shape[0]
        slots, new = self.find(unique, slot_ids)
        fresh = unique[new]
        added = fresh.shape[0]
        given = np.arange(n, n + added, dtype=np.int32)
        slots[new] = given
        ids = np.concatenate([slot_ids, fresh])
        # `slots` are unique: `add.at` adds as `counts[slots] += 1` would, and keeps the
        # GIL (the fancy get and set hand it away, under the lock).
        counts = np.concatenate([row_counts, np.zeros(added, np.int64)])
        np.add.at(counts, slots, 1)
        weights = row_weights
        if weight is not None and weights is None:  # the first weight: so far, the counts
            weights = row_counts.astype(np.float32)
        if weights is not None:
            weights = np.concatenate([weights, np.zeros(added, np.float32)])
            np.add.at(weights, slots, np.float32(1 if weight is None else weight))  # as in jit
        self.remember(fresh, given, ids)
        slot_of = slots if inverse is None else slots[inverse.reshape(-1)]
        return ids, counts, weights, slot_of


def sorted_slots(slot_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The sorted unique row ids of a batch's slots, the slots in row-id order, and,
    when a row id has several slots, the index of its unique id for each of them.

    Run under the lock at every hand-off, so the common cases skip the sort: slots
    already in row order (one gradient), and unique row ids dense enough to invert
    through a table as long as the largest id."""
    n = slot_ids.shape[0]
    if n < 2 or (slot_ids[1:] > slot_ids[:-1]).all():
        return slot_ids, np.arange(n, dtype=np.int32), None
    top = int(slot_ids.max()) + 1
    if top <= _DENSE_IDS * n:
        where = np.full(top, -1, np.int32)
        where[slot_ids] = np.arange(n, dtype=np.int32)
        ids = np.flatnonzero(where >= 0)
        if ids.shape[0] == n:  # unique: a row id with several slots is left to the sort
            return ids, where[ids], None
    keys = np.sort((slot_ids.astype(np.int64) << 32) | np.arange(n, dtype=np.int64), kind="stable")
    ids, order = keys >> 32, (keys & 0xFFFFFFFF).astype(np.int32)
    first = np.ones(n, bool)
    first[1:] = ids[1:] != ids[:-1]
    if first.all():
        return ids, order, None
    return ids[first], order, np.cumsum(first) - 1
