"""The accumulators inside the Ray actor: the host accumulators' `Core` (step,
counters, the take queue and its rules) summing a tree of NumPy arrays.

The in-process objects keep their aggregate on a JAX device; the actor's process never
imports JAX, so its kinds sum in NumPy, with the same arithmetic: the same dtype to
accumulate in (float32 for float16 and bfloat16), gradients added one at a time in
arrival order, a weight multiplied in the accumulator's dtype, and the same division
(by the count, or the weight sum, as a multiply by its reciprocal, which is how
XLA:CPU divides). The checks are the in-process ones (`_args`), leaf
by leaf, and a tree's leaves are taken together: one count, one step, one take.

Every push carries an identity (a client, and its sequence number): `Clients` keeps
each client's last answer, so a push that comes again (a retry after an ambiguous
failure, or Ray retrying the call) is answered, not counted twice. With a checkpoint
(`log`), an accepted gradient is written before it is counted, and a take's new step
before it is handed its batch.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from optax_accum.host import _args
from optax_accum.host._core import Batch, Core
from optax_accum.host._slots import SlotHints, bucket, sorted_slots, unique_ids
from optax_accum.host._takes import Take
from optax_accum.ray._spec import Spec


class Clients:
    """Each client's last push: its sequence number and answer (accepted or not).

    A client is one handle in one thread, so its pushes come one at a time and its
    numbers only grow: a number not above the last is a push seen before. The table
    keeps the `limit` most recently heard clients. The checkpoint keeps only those
    heard since it last saved the table (`state`, `saved`): an earlier push was
    answered before that save, or is in the log's current batch, which a restarted
    actor replays (so a retry of it is known again).
    """

    limit = 100_000

    def __init__(self) -> None:
        self._last: collections.OrderedDict[str, tuple[int, bool]] = collections.OrderedDict()
        self._recent: set[str] = set()

    def answer(self, client: str, seq: int) -> bool | None:
        """The answer already given to push `seq` of `client`, or None if it is new. An
        older push than the last answered (a retry its client stopped waiting for)
        is not counted again: False."""
        last = self._last.get(client)
        if last is None or seq > last[0]:
            return None
        return last[1] if seq == last[0] else False

    def remember(self, client: str, seq: int, answer: bool) -> None:
        self._last[client] = (seq, answer)
        self._last.move_to_end(client)
        self._recent.add(client)
        while len(self._last) > self.limit:
            self._recent.discard(self._last.popitem(last=False)[0])

    def state(self) -> dict[str, list]:
        """The clients heard since the last `saved`, for the checkpoint."""
        return {client: list(self._last[client]) for client in self._recent}

    def saved(self) -> None:
        self._recent.clear()

    def load(self, state: dict[str, list]) -> None:
        for client, (seq, answer) in state.items():
            self.remember(client, int(seq), bool(answer))


class ActorCore(Core):
    """What the actor's two kinds share: identities, the checkpoint, the apply's order
    (check, admit, log, add, serve). Kinds implement `validate`, `finite`, `fits`,
    `add` and `reduce` on a tuple with one entry per leaf."""

    def __init__(self, spec: Spec) -> None:
        dtypes = tuple(_args.dtype_named(leaf.dtype) for leaf in spec.leaves)
        shapes = tuple(leaf.shape for leaf in spec.leaves)
        self.spec = spec
        self.acc_dtypes = tuple(_args.accumulator_dtype(d) for d in dtypes)
        super().__init__(dtypes, shapes, spec.reduction_type == "MEAN", spec.skip_nonfinite)
        self.clients = Clients()
        self.log: Any = None  # the checkpoint (`_checkpoint.Log`), if any
        self.owners: dict[Take, tuple[str, int]] = {}  # a waiting take's client and number

    def describe(self) -> str:
        return self.spec.describe()

    def leaf_name(self, i: int, arg: str) -> str:
        """How errors name leaf `i`'s `arg`: as in-process for a lone array."""
        return arg + self.spec.leaves[i].path

    def apply(self, client: str, seq: int, local_step: Any, weight: Any, payload: tuple) -> bool:
        """Offers one gradient (a tuple of leaves) under the identity `(client, seq)`;
        returns whether it was accepted, the first answer again for a repeated push.
        The in-process object's errors for a bad gradient, step or weight (nothing
        changes); an OSError if the checkpoint cannot be written (nothing counted)."""
        step = _args.check_step("local_step", local_step)
        weight = _args.check_weight(weight)
        grad = self.validate(payload)
        finite = self.finite(grad) if self.skip_nonfinite else True
        with self.lock:
            known = self.clients.answer(client, seq)
            if known is not None:
                return known
            self.fits(self.batch, grad)
            accepted = self.admit(step, finite)
            if accepted and self.log is not None:
                self.log.record(client, seq, weight, grad)  # raises: nothing counted
            if accepted:
                self.add(self.batch, grad, weight)
            self.clients.remember(client, seq, accepted)
            if accepted:
                self.serve()
        return accepted

    def handing(self, take: Take, new_step: int) -> BaseException | None:
        """Saves the new step (and which take got which gradients) before `take` is
        handed its batch; a take whose step cannot be saved fails, taking nothing."""
        if self.log is None:
            return None
        try:
            self.log.taken(new_step, self.owners.get(take), self.clients)
        except OSError as error:
            return OSError(
                f"take_grad({take.num_required}) could not save the accumulator's new "
                f"global step in its checkpoint_dir ({error}); nothing was taken"
            )
        return None

    def replay(self, entries: list) -> Batch:
        """A batch holding the logged gradients `entries`, added in order."""
        batch = self.new_batch()
        for entry in entries:
            self.add(batch, entry.grad, entry.weight)
        return batch

    def validate(self, payload: tuple) -> tuple:
        raise NotImplementedError

    def finite(self, grad: tuple) -> bool:
        raise NotImplementedError

    def fits(self, batch: Batch, grad: tuple) -> None:
        raise NotImplementedError

    def add(self, batch: Batch, grad: tuple, weight: float | None) -> None:
        raise NotImplementedError

    def _leaves(self, payload: tuple) -> tuple:
        if not isinstance(payload, tuple) or len(payload) != len(self.spec.leaves):
            raise ValueError(
                f"the gradient must have {len(self.spec.leaves)} leaves (the accumulator's "
                f"tree), got {len(payload) if isinstance(payload, tuple) else payload!r}"
            )
        return payload


def _part(x: np.ndarray, weight: float | None, acc: np.dtype) -> np.ndarray | None:
    """What a gradient adds, in `acc`: `weight * x` (None: `x`; 0: nothing)."""
    w = _args.kernel_weight(weight)
    if w is None:
        return x.astype(acc, copy=False)
    if w == 0:
        return None
    return x.astype(acc) * acc.type(w)


def _reciprocal(divisor: Any, acc: np.dtype) -> Any:
    """`1 / divisor` in `acc`: a mean multiplies by it, as XLA:CPU computes the
    in-process objects' division, so the answers are theirs bit for bit."""
    return acc.type(1) / np.asarray(divisor).astype(acc)


# --------------------------------------------------------------------------- dense


class DenseBatch(Batch):
    """Per leaf, its sum (None until a gradient of non-zero weight came) and shape
    (fixed by the batch's first gradient); the float32 weight sum, and whether any
    gradient came with a weight."""

    __slots__ = ("shapes", "sums", "weight_sum", "weighted")

    def __init__(self, n: int) -> None:
        super().__init__()
        self.sums: list[np.ndarray | None] = [None] * n
        self.shapes: tuple | None = None
        self.weight_sum = 0.0
        self.weighted = False


class DenseActorCore(ActorCore):
    kind = "ConditionalAccumulator"

    def new_batch(self) -> DenseBatch:
        return DenseBatch(len(self.spec.leaves))

    def validate(self, payload: tuple) -> tuple:
        grad = []
        for i, x in enumerate(self._leaves(payload)):
            name = self.leaf_name(i, "grad")
            array = np.asarray(_args.as_array(x, self.dtype[i], name))
            if not _args.compatible(array.shape, self.shape[i]):
                raise ValueError(
                    f"{name} must have a shape compatible with the accumulator's shape "
                    f"{_args.fmt(self.shape[i])}, got {array.shape}"
                )
            grad.append(array)
        return tuple(grad)

    def finite(self, grad: tuple) -> bool:
        return all(bool(np.isfinite(x).all()) for x in grad)

    def fits(self, batch: DenseBatch, grad: tuple) -> None:
        if batch.shapes is None:
            return
        for i, (x, shape) in enumerate(zip(grad, batch.shapes, strict=True)):
            if x.shape != shape:
                raise ValueError(
                    f"{self.leaf_name(i, 'grad')} shape mismatch: expected {shape} (fixed by "
                    f"the first gradient since the last take), got {x.shape}"
                )

    def add(self, batch: DenseBatch, grad: tuple, weight: float | None) -> None:
        for i, x in enumerate(grad):
            part = _part(x, weight, self.acc_dtypes[i])
            if part is None:
                continue
            if batch.sums[i] is None:
                batch.sums[i] = np.array(part, self.acc_dtypes[i], copy=True)
            else:
                np.add(batch.sums[i], part, out=batch.sums[i])
        batch.shapes = tuple(x.shape for x in grad)
        batch.weight_sum = float(
            np.float32(batch.weight_sum) + np.float32(1 if weight is None else weight)
        )
        batch.weighted = batch.weighted or weight is not None
        batch.count += 1

    def _divisor(self, batch: DenseBatch) -> np.float32 | None:
        """As the in-process object divides: None under SUM or when it is 1; else the
        count, or with weights their sum (none when it is 0: the sum is 0 too)."""
        if not self.mean:
            return None
        if batch.weighted:
            weight_sum = np.float32(batch.weight_sum)
            return None if weight_sum in (0, 1) else weight_sum
        return None if batch.count == 1 else np.float32(batch.count)

    def reduce(self, batch: DenseBatch) -> list[np.ndarray]:
        divisor = self._divisor(batch)
        out = []
        for i, total in enumerate(batch.sums):
            if total is None:  # every gradient weighed 0
                out.append(np.zeros(batch.shapes[i], self.dtype[i]))
                continue
            if divisor is not None:
                np.multiply(total, _reciprocal(divisor, self.acc_dtypes[i]), out=total)
            out.append(total.astype(self.dtype[i], copy=False))
        return out


# --------------------------------------------------------------------------- sparse


class _Rows:
    """One leaf's rows since the last take: `rows` (None until the first row) holds
    them in slots, in arrival order; `slot_ids[s]` is slot `s`'s row id,
    `row_counts[s]` how many gradients touched it, `row_weights[s]` their weight sum
    (None while no gradient came with a weight); `values_shape` is fixed by the
    batch's first gradient."""

    __slots__ = ("row_counts", "row_weights", "rows", "slot_ids", "values_shape")

    def __init__(self) -> None:
        self.rows: np.ndarray | None = None
        self.slot_ids = np.zeros(0, np.int64)
        self.row_counts = np.zeros(0, np.int64)
        self.row_weights: np.ndarray | None = None
        self.values_shape: tuple | None = None


class SparseBatch(Batch):
    __slots__ = ("leaves",)

    def __init__(self, n: int) -> None:
        super().__init__()
        self.leaves = [_Rows() for _ in range(n)]


class SparseActorCore(ActorCore):
    kind = "SparseConditionalAccumulator"

    def __init__(self, spec: Spec) -> None:
        super().__init__(spec)
        self.hints = [SlotHints() for _ in spec.leaves]

    def new_batch(self) -> SparseBatch:
        return SparseBatch(len(self.spec.leaves))

    def validate(self, payload: tuple) -> tuple:
        grad = []
        for i, leaf in enumerate(self._leaves(payload)):
            indices, values, grad_shape = leaf
            try:
                ids, values = _args.check_sparse_grad(
                    indices, values, grad_shape, self.shape[i], self.dtype[i]
                )
            except (TypeError, ValueError) as error:
                path = self.spec.leaves[i].path
                if not path:
                    raise
                raise type(error)(f"{path}: {error}") from None
            unique, inverse = unique_ids(ids)
            grad.append((unique, inverse, np.asarray(values)))
        return tuple(grad)

    def finite(self, grad: tuple) -> bool:
        return all(bool(np.isfinite(values).all()) for _, _, values in grad)

    def fits(self, batch: SparseBatch, grad: tuple) -> None:
        for i, (_, _, values) in enumerate(grad):
            known = batch.leaves[i].values_shape
            try:
                _args.check_rows_like(values, known)
            except ValueError as error:
                path = self.spec.leaves[i].path
                if not path:
                    raise
                raise ValueError(f"{path}: {error}") from None

    def add(self, batch: SparseBatch, grad: tuple, weight: float | None) -> None:
        for i, (unique, inverse, values) in enumerate(grad):
            leaf = batch.leaves[i]
            leaf.values_shape = (0, *values.shape[1:])
            if values.shape[0]:
                self._add_rows(i, leaf, unique, inverse, values, weight)
        batch.count += 1

    def _add_rows(
        self,
        i: int,
        leaf: _Rows,
        unique: np.ndarray,
        inverse: np.ndarray | None,
        values: np.ndarray,
        weight: float | None,
    ) -> None:
        acc = self.acc_dtypes[i]
        ids, counts, weights, slot_of = self.hints[i].place(
            leaf.slot_ids, leaf.row_counts, leaf.row_weights, unique, inverse, weight
        )
        rows = leaf.rows
        if rows is None or ids.shape[0] > rows.shape[0]:  # grows by powers of two
            grown = np.zeros((bucket(ids.shape[0]), *values.shape[1:]), acc)
            if rows is not None:
                grown[: rows.shape[0]] = rows
            rows = grown
        part = _part(values, weight, acc)
        if part is not None and inverse is None:  # one value per slot
            rows[slot_of] += part
        elif part is not None:
            np.add.at(rows, slot_of, part)
        leaf.rows, leaf.slot_ids, leaf.row_counts, leaf.row_weights = rows, ids, counts, weights

    def reduce(self, batch: SparseBatch) -> list[tuple]:
        return [self._reduce_leaf(i, leaf) for i, leaf in enumerate(batch.leaves)]

    def _reduce_leaf(self, i: int, leaf: _Rows) -> tuple:
        """A leaf's `(indices, values, dense shape)`, as the in-process take returns it."""
        shape, dtype = self.shape[i], self.dtype[i]
        dims = (shape[0] if shape and shape[0] is not None else -1, *leaf.values_shape[1:])
        if leaf.rows is None:
            return np.zeros(0, np.int32), np.zeros(leaf.values_shape, dtype), dims
        ids, order, segments = sorted_slots(leaf.slot_ids)
        taken = leaf.rows[order]
        if segments is not None:  # a row id in several slots: added together
            merged = np.zeros((ids.shape[0], *taken.shape[1:]), taken.dtype)
            np.add.at(merged, segments, taken)
            taken = merged
        if self.mean:
            divisors = _reciprocal(self._divisors(leaf, order, segments), taken.dtype)
            taken *= divisors.reshape((-1,) + (1,) * (taken.ndim - 1))
        return ids.astype(np.int32), taken.astype(dtype, copy=False), dims

    @staticmethod
    def _divisors(leaf: _Rows, order: np.ndarray, segments: np.ndarray | None) -> np.ndarray:
        """Each row's divisor: the gradients that touched it, or their weight sum (1
        where it is 0: that row's sum is 0 too)."""
        weighted = leaf.row_weights is not None
        per_slot = leaf.row_weights if weighted else leaf.row_counts
        divisors = per_slot[order]
        if segments is not None:
            divisors = np.bincount(segments, weights=divisors).astype(per_slot.dtype)
        if weighted:
            divisors = np.where(divisors > 0, divisors, np.float32(1))
        return divisors


def core_for(spec: Spec) -> ActorCore:
    """A fresh actor accumulator of `spec`."""
    return (DenseActorCore if spec.kind == "dense" else SparseActorCore)(spec)
