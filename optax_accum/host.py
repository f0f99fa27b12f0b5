"""TF-compatible host accumulators: threads apply gradients, a learner blocks on a take.

TF1's `tf.ConditionalAccumulator` and `tf.sparse.SparseConditionalAccumulator` are
stateful objects shared by threads: actors call `apply_grad(grad, local_step)`, and a
learner calls `take_grad(num_required)`, which blocks until that many up-to-date
gradients have arrived and returns their mean. `ConditionalAccumulator` and
`SparseConditionalAccumulator` are the same objects in Python. The bookkeeping (step,
counter, the queue of waiting takes) is plain Python under one lock; the aggregate
lives on a JAX device and is updated by jitted kernels that donate its buffer (dense
gradients are added up to four at a time in one pass, sparse rows scattered into a
buffer that grows by powers of two), and nothing recompiles for same-shape gradients.

Rules shared by both (TF's, see SEMANTICS.md sections 1 and 2):

- A gradient is accepted iff `local_step >= global_step`; a stale one is dropped
  silently. Every gradient is validated first, stale or not, and a rejected one
  (ValueError/TypeError) leaves the accumulator exactly as it was.
- Takes are served first come, first served, with head-of-line blocking: a waiting
  `take_grad(3)` holds back a later `take_grad(1)`. A take completes inside the apply
  that brings the count to its `num_required`: `global_step` advances at once, the
  aggregate of ALL accepted gradients is reduced (MEAN divides by their number) and
  handed to the waiting thread, and the counter and aggregate reset.
- `take_grad(..., timeout=t)` raises `TimeoutError` after `t` seconds and leaves no
  trace: the abandoned take never consumes gradients later.
  `cancel_waiting_takes()` (TF's session close) makes every waiting take raise
  `concurrent.futures.CancelledError`.
- A non-empty `shared_name` returns the same underlying accumulator for every object
  built with that name while one of them is alive; a different kind, dtype, shape,
  reduction or `skip_nonfinite` under that name is a ValueError.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import operator
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum import _common
from optax_accum.indexed_slices import IndexedSlices

_SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))
_MIN_BUCKET = 8
_MAX_PENDING = 4  # dense gradients added per kernel at most
_INT32_MAX = int(np.iinfo(np.int32).max)

Shape = tuple[int | None, ...]


# --------------------------------------------------------------------------- kernels
# Module-level jits: every accumulator shares their compilation caches.


@functools.partial(jax.jit, static_argnames="dtype")
def _sum_as(grads: tuple[jax.Array, ...], dtype: Any) -> jax.Array:
    """A fresh buffer holding the sum of `grads`, added left to right, in `dtype`."""
    total = jnp.array(grads[0], dtype, copy=True)  # never aliases the caller's array
    for grad in grads[1:]:
        total = total + grad.astype(dtype)
    return total


@functools.partial(jax.jit, donate_argnums=0)
def _add(aggregate: jax.Array, grads: tuple[jax.Array, ...]) -> jax.Array:
    """`aggregate` plus each of `grads` in turn: the rounding of one add at a time."""
    for grad in grads:
        aggregate = aggregate + grad.astype(aggregate.dtype)
    return aggregate


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def _finish(
    aggregate: jax.Array | None,
    grads: tuple[jax.Array, ...],
    count: jax.Array,
    *,
    mean: bool,
    acc_dtype: Any,
    dtype: Any,
) -> jax.Array:
    """The take's answer in one pass: the last pending gradients added, then the MEAN."""
    if aggregate is None:  # a copy: the answer must not alias a (pooled) input
        aggregate, grads = jnp.array(grads[0], acc_dtype, copy=True), grads[1:]
    total = aggregate
    for grad in grads:
        total = total + grad.astype(acc_dtype)
    if mean:
        total = total / count.astype(acc_dtype)
    return total.astype(dtype)


_FINISH_STATIC = ("mean", "acc_dtype", "dtype")
_finish_in_place = jax.jit(_finish, donate_argnums=0, static_argnames=_FINISH_STATIC)
_finish_copy = jax.jit(_finish, static_argnames=_FINISH_STATIC)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_add(rows: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """Adds `values[i]` to `rows[slots[i]]`; slots out of range are padding, dropped."""
    return rows.at[slots].add(values.astype(rows.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("capacity", "dtype"))
def _scatter_fresh(
    rows: jax.Array | None, slots: jax.Array, values: jax.Array, capacity: int, dtype: Any
) -> jax.Array:
    """`_scatter_add` into a new buffer of `capacity` rows holding `rows` (or zeros)."""
    fresh = jnp.zeros((capacity, *values.shape[1:]), dtype)
    if rows is not None:
        fresh = jax.lax.dynamic_update_slice_in_dim(fresh, rows, 0, axis=0)
    return fresh.at[slots].add(values.astype(dtype), mode="drop")


def _gather(
    rows: jax.Array, order: jax.Array, counts: jax.Array, *, mean: bool, dtype: Any
) -> jax.Array:
    """`rows[order]`, each divided by its count under MEAN (padding counts are 1)."""
    taken = rows[order]
    if mean:
        taken = taken / counts.astype(rows.dtype).reshape((-1,) + (1,) * (rows.ndim - 1))
    return taken.astype(dtype)


_gather_in_place = jax.jit(_gather, donate_argnums=0, static_argnames=("mean", "dtype"))
_gather_copy = jax.jit(_gather, static_argnames=("mean", "dtype"))


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised NumPy array whose data is 64-byte aligned, as XLA's CPU client
    needs to use host memory in place."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _bucket(n: int) -> int:
    """The smallest power of two >= max(n, _MIN_BUCKET): sizes that bound compilations."""
    return max(_MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


# --------------------------------------------------------------------------- arguments


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = None if dtype is None else jnp.dtype(dtype)  # np.dtype(None) is float64
    except TypeError:
        dt = None
    if dt is None or dt not in _SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in _SUPPORTED_DTYPES)
        raise TypeError(f"dtype must be one of {names}, got {dtype!r}")
    return dt


def _check_shape(shape: Any, name: str = "shape") -> Shape | None:
    """None (unknown rank) or a tuple whose unknown dims are None (-1 also means unknown)."""
    if shape is None:
        return None
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    try:
        dims = [] if isinstance(shape, str) else list(shape)
    except TypeError:
        raise TypeError(
            f"{name} must be None or a sequence of ints (None or -1 for unknown dims), "
            f"got {shape!r}"
        ) from None
    out: list[int | None] = []
    for d in dims:
        is_int = isinstance(d, int | np.integer) and not isinstance(d, bool)
        if d is None or (is_int and d == -1):
            out.append(None)
        elif is_int and d >= 0:
            out.append(int(d))
        else:
            break
    if isinstance(shape, str) or len(out) != len(dims):
        raise ValueError(
            f"{name} must hold non-negative ints (None or -1 for unknown dims), got {shape!r}"
        )
    return tuple(out)


def _check_step(name: str, value: Any) -> int:
    if isinstance(value, bool | float | np.floating):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


def _check_num_required(num_required: Any) -> int:
    is_int = isinstance(num_required, int | np.integer) and not isinstance(num_required, bool)
    if is_int and num_required < 1:
        raise ValueError(f"num_required must be positive, but was {num_required}")
    return _common.require_positive_int("num_required", num_required)


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.integer | np.floating):
        raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return float(timeout)


def _fmt(shape: Shape | None) -> str:
    return "unknown" if shape is None else str(tuple("?" if d is None else d for d in shape))


def _compatible(shape: tuple[int, ...], spec: Shape | None) -> bool:
    return spec is None or (
        len(shape) == len(spec)
        and all(s is None or s == d for d, s in zip(shape, spec, strict=True))
    )


def _as_array(x: Any, dtype: np.dtype, what: str) -> Any:
    """`x` as an array: arrays keep their own dtype, which must be `dtype`; Python
    numbers and nested lists are converted to `dtype` (as TF converts them)."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        try:
            converted = np.asarray(x)
        except (TypeError, ValueError):  # ragged lists
            converted = np.asarray(None)
        if converted.dtype.kind not in "iuf":  # None would become NaN, True 1.0
            raise TypeError(f"{what} must be an array or nested list of numbers, got {x!r:.80}")
        x = converted.astype(dtype)
    if jnp.dtype(x.dtype) != dtype:
        raise TypeError(f"{what} must have the accumulator's dtype {dtype.name}, got {x.dtype}")
    return x


# --------------------------------------------------------------------------- shared state


class _Take:
    """One waiting `take_grad`, completed by whichever thread serves it.

    The taker waits on its own event, outside the accumulator's lock, so waking it
    never contends with the appliers. `done` is set under the lock, before the event.
    """

    __slots__ = ("done", "error", "event", "num_required", "result")

    def __init__(self, num_required: int) -> None:
        self.num_required = num_required
        self.done = False
        self.event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True
        self.event.set()


class _StagingPool:
    """Aligned host buffers that NumPy gradients are copied into on a CPU device.

    JAX then uses such a buffer in place. A fresh multi-megabyte allocation costs a
    page fault per page on every apply, so a buffer is handed back once the kernel
    that read it has finished, and reused; at most `keep` idle buffers are kept per
    shape and dtype.
    """

    def __init__(self, keep: int = 2 * _MAX_PENDING) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple, list[np.ndarray]] = {}
        self._keep = keep

    def acquire(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            idle = self._idle.get((tuple(shape), np.dtype(dtype)))
            if idle:
                return idle.pop()
        return _aligned_empty(shape, dtype)

    def release(self, buffers: Sequence[np.ndarray]) -> None:
        with self._lock:
            for buffer in buffers:
                idle = self._idle.setdefault((buffer.shape, buffer.dtype), [])
                if len(idle) < self._keep:
                    idle.append(buffer)


class _Core:
    """Step, counters, aggregate and take queue; shared by objects with one shared_name.

    Subclasses hold the aggregate and implement `_release` (reduce, reset, return).
    Every field is guarded by `lock`.
    """

    def __init__(
        self, dtype: np.dtype, shape: Shape | None, mean: bool, skip_nonfinite: bool
    ) -> None:
        self.dtype = dtype
        self.shape = shape
        self.mean = mean
        self.skip_nonfinite = skip_nonfinite
        # float16/bfloat16 accumulate in float32, as the functional accumulators do.
        self.acc_dtype = _common.accumulator_dtype_for(dtype, None)
        self.device = jax.devices()[0]
        self.staging = _StagingPool() if self.device.platform == "cpu" else None
        self.in_flight: list[np.ndarray] = []  # staging buffers the last kernel reads
        self.lock = threading.Lock()
        self._takes: deque[_Take] = deque()
        self.global_step = 0
        self.count = 0
        self.num_dropped = 0
        self.num_nonfinite = 0

    def signature(self) -> tuple:
        return (type(self), self.dtype, self.shape, self.mean, self.skip_nonfinite)

    def precision(self) -> contextlib.AbstractContextManager:
        """Lets float64 aggregates stay float64 when jax_enable_x64 is off (thread-local)."""
        if self.acc_dtype == np.float64 and not jax.config.jax_enable_x64:
            return jax.enable_x64(True)
        return contextlib.nullcontext()

    def to_device(
        self, x: Any, *, stage: bool = True
    ) -> tuple[jax.Array | np.ndarray, bool, np.ndarray | None]:
        """`x` ready for a kernel: `(array, ours_to_donate, staging_buffer)`.

        NumPy input is copied, since the caller may reuse it; a caller's JAX array is
        never donated. On a CPU device the copy is NumPy's (it releases the GIL, so a
        learner thread is not starved by busy actors) into an aligned buffer, which
        the kernels then read in place. With `stage`, that buffer comes from the
        staging pool, is returned as is (a NumPy array, not ours to donate) and must
        go back through `recycle` once a kernel has read it; without, JAX adopts a
        fresh buffer and the result is a `jax.Array` that owns it.
        """
        with self.precision():
            if isinstance(x, jax.Array):
                if x.sharding.device_set == {self.device}:
                    return x, False, None
                return jax.device_put(x, self.device), True, None
            if self.staging is None:
                return jax.device_put(x), True, None
            if stage:
                buffer = self.staging.acquire(x.shape, x.dtype)
                np.copyto(buffer, x)
                return buffer, False, buffer
            fresh = _aligned_empty(x.shape, x.dtype)
            np.copyto(fresh, x)
            return jax.device_put(fresh, may_alias=True), True, None

    def recycle(self, buffers: Sequence[np.ndarray | None]) -> None:
        """Returns staging buffers that no kernel reads (any more) to the pool."""
        buffers = [b for b in buffers if b is not None]
        if buffers:
            self.staging.release(buffers)

    def settle(self, done: Any) -> None:
        """Waits for `done`, the output of the last kernel, then frees its inputs.

        Waiting on each kernel before dispatching the next also keeps at most one in
        flight, so applies never outrun the device.
        """
        jax.block_until_ready(done)
        self.recycle(self.in_flight)
        self.in_flight = []

    def finite(self, x: Any) -> bool:
        """Whether `x` is finite; only asked under `skip_nonfinite` (it syncs)."""
        if isinstance(x, np.ndarray):
            return bool(np.isfinite(x).all())
        with self.precision():
            return bool(_all_finite(x))

    # ------------------------------------------------------------------ apply

    @contextlib.contextmanager
    def applying(self, local_step: int, finite: bool) -> Iterator[bool]:
        """Holds the lock around one apply and yields whether the gradient is accepted.

        The caller validates against the aggregate, then adds when told to; on leaving,
        an accepted gradient is counted and may complete the head take. Stale and
        (under skip_nonfinite) non-finite gradients are counted as such. An exception
        raised inside (a rejected gradient) leaves every counter as it was.
        """
        with self.lock:
            accept = local_step >= self.global_step and finite
            yield accept
            if accept:
                self.count += 1
                self._serve()
            elif local_step < self.global_step:
                self.num_dropped += 1
            else:
                self.num_nonfinite += 1

    # ------------------------------------------------------------------ take

    def take(self, num_required: Any, timeout: Any) -> Any:
        num_required = _check_num_required(num_required)
        timeout = _check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = _Take(num_required)
        with self.lock:
            self._takes.append(ticket)
            self._serve()
        try:
            while not ticket.event.is_set():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                ticket.event.wait(remaining)
        finally:
            if not ticket.event.is_set():  # timed out, or interrupted (KeyboardInterrupt)
                with self.lock:
                    if not ticket.done:  # not served in the meantime: withdraw it
                        self._takes.remove(ticket)
                        self._serve()  # the take behind it may be satisfied already
                        count = self.count
        if not ticket.done:
            raise TimeoutError(
                f"take_grad({num_required}) timed out after {timeout} s with "
                f"{count} gradient(s) accumulated; nothing was taken"
            )
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _serve(self) -> None:
        """Completes the head take when enough gradients are in (lock held)."""
        if not self._takes or self.count < self._takes[0].num_required:
            return
        ticket = self._takes.popleft()
        try:
            with self.precision():
                result = self._release()
        except Exception as e:  # a device failure: the waiting thread re-raises it
            ticket.finish(error=e)
            return
        self.global_step += 1
        self.count = 0
        ticket.finish(result)

    def _release(self) -> Any:
        raise NotImplementedError

    def cancel_waiting_takes(self) -> int:
        with self.lock:
            cancelled = len(self._takes)
            for ticket in self._takes:
                ticket.finish(
                    error=concurrent.futures.CancelledError(
                        f"take_grad({ticket.num_required}) was cancelled while waiting"
                    )
                )
            self._takes.clear()
        return cancelled

    def num_waiting_takes(self) -> int:
        with self.lock:
            return len(self._takes)

    def num_accumulated(self) -> int:
        with self.lock:
            return self.count

    def set_global_step(self, new_global_step: Any) -> None:
        step = _check_step("new_global_step", new_global_step)
        with self.lock:
            if step < self.global_step:
                warnings.warn(
                    f"set_global_step({step}) lowers the accumulator's global step from "
                    f"{self.global_step}",
                    stacklevel=3,
                )
            self.global_step = step


class _DenseCore(_Core):
    """The aggregate on the device, plus up to `_MAX_PENDING - 1` accepted gradients not
    yet added: they are added in one pass, which reads and writes the aggregate once
    per batch instead of once per gradient (same rounding as one add at a time).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.aggregate: jax.Array | None = None  # None until the first flush after a take
        # (gradient, ours to donate, its staging buffer or None)
        self.pending: list[tuple[jax.Array, bool, np.ndarray | None]] = []
        self.grad_shape: tuple[int, ...] | None = None  # fixed until the next take

    def apply(self, grad: Any, local_step: Any) -> bool:
        step = _check_step("local_step", local_step)
        grad = _as_array(grad, self.dtype, "grad")
        if not _compatible(tuple(grad.shape), self.shape):
            raise ValueError(
                f"grad must have a shape compatible with the accumulator's shape "
                f"{_fmt(self.shape)}, got {tuple(grad.shape)}"
            )
        finite = self.finite(grad) if self.skip_nonfinite else True
        grad, owned, buffer = self.to_device(grad)
        accept = False
        try:
            with self.applying(step, finite) as accept:
                if self.grad_shape is not None and grad.shape != self.grad_shape:
                    raise ValueError(
                        f"grad shape mismatch: expected {self.grad_shape} (fixed by the first "
                        f"gradient since the last take), got {tuple(grad.shape)}"
                    )
                if accept:
                    self.grad_shape = tuple(grad.shape)
                    self.pending.append((grad, owned, buffer))
                    if len(self.pending) == _MAX_PENDING:
                        self._flush()
        finally:
            if not accept:  # nothing will read it
                self.recycle([buffer])
        return accept

    def _flush(self) -> None:
        """Adds the pending gradients to the aggregate in one kernel (lock held)."""
        grads = tuple(g for g, _, _ in self.pending)
        with self.precision():
            if self.aggregate is not None:
                self.settle(self.aggregate)
                self.aggregate = _add(self.aggregate, grads)
            elif len(grads) == 1 and self.pending[0][1] and grads[0].dtype == self.acc_dtype:
                self.aggregate = grads[0]  # our own copy already: adopt it
            else:
                self.aggregate = _sum_as(grads, dtype=self.acc_dtype)
        self.in_flight += [b for _, _, b in self.pending if b is not None]
        self.pending = []

    def _release(self) -> jax.Array:
        aggregate, pending = self.aggregate, self.pending
        self.aggregate, self.pending, self.grad_shape = None, [], None
        if aggregate is None and len(pending) == 1 and pending[0][1]:
            aggregate, pending = pending[0][0], []  # our own copy of the only gradient
        if not pending and (not self.mean or self.count == 1) and aggregate.dtype == self.dtype:
            self.settle(aggregate)  # the last add's inputs are free once it is done
            return aggregate  # nothing to add, divide or cast
        finish = _finish_in_place if self.acc_dtype == self.dtype else _finish_copy
        result = finish(
            aggregate,
            tuple(g for g, _, _ in pending),
            _common.int32(self.count),
            mean=self.mean,
            acc_dtype=self.acc_dtype,
            dtype=self.dtype,
        )
        self.in_flight += [b for _, _, b in pending if b is not None]
        self.settle(result)
        return result


class _SparseCore(_Core):
    """Row slots in arrival order on the device; row ids and per-row counts on the host.

    `slot_rows[s]` is the row id held in slot `s` of `rows` (the device aggregate,
    `capacity` slots, grown by powers of two); `sorted_rows`/`sorted_slots` index the
    slots by row id for lookups and for the sorted answer; `row_counts[s]` is how many
    accepted gradients touched slot `s` (MEAN divides each row by it).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.capacity = 0  # the device buffer's rows (kept across takes)
        self.unsettled = 0  # scatters dispatched since the last wait
        self._reset()

    def _reset(self) -> None:
        self.rows: jax.Array | None = None
        self.values_shape: tuple[int, ...] | None = None  # fixed until the next take
        self.sorted_rows = np.zeros(0, np.int64)
        self.sorted_slots = np.zeros(0, np.int32)
        self.row_counts = np.zeros(0, np.int64)

    def _validate(self, indices: Any, values: Any, grad_shape: Any) -> tuple[np.ndarray, Any]:
        """TF's checks, in TF's order, that need no lock; returns host indices, values."""
        if not hasattr(indices, "shape"):
            listed = np.asarray(indices)
            indices = listed.astype(np.int32) if listed.size == 0 else listed
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"grad_indices must be integers, got dtype {indices.dtype}")
        if len(indices.shape) != 1:
            raise ValueError(f"grad_indices must be a vector, got shape {list(indices.shape)}")
        values = _as_array(values, self.dtype, "grad_values")
        if len(values.shape) == 0:
            raise ValueError("grad_values cannot be 0-dimensional; expected [nnz, ...]")
        if values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"grad_values must have one row per index: expected {indices.shape[0]} "
                f"rows, got {values.shape[0]}"
            )
        known = self.shape
        grad_shape = _check_shape(grad_shape, "grad_shape")
        if grad_shape and known is not None:
            if len(grad_shape) < len(known):
                raise ValueError(
                    f"grad_shape must have rank at least {len(known)} (the accumulator's "
                    f"shape {_fmt(known)}), got {_fmt(grad_shape)}"
                )
            for i, (k, g) in enumerate(zip(known, grad_shape, strict=False)):
                if k is not None and g is not None and k != g:
                    raise ValueError(
                        f"grad_shape dim {i} must be {k} (the accumulator's shape "
                        f"{_fmt(known)}), got {g}"
                    )
        host = np.asarray(jax.device_get(indices)).astype(np.int64, copy=False)
        if host.size:
            low = int(host.argmin())
            if host[low] < 0:
                raise ValueError(
                    f"grad_indices[{low}] = {host[low]} is negative; indices must be row ids"
                )
            high = int(host.argmax())
            limit = known[0] if known else None
            if limit is not None and host[high] >= limit:
                raise ValueError(
                    f"grad_indices[{high}] = {host[high]} exceeds the accumulator's "
                    f"shape[0] = {limit}"
                )
            if grad_shape and grad_shape[0] is not None and host[high] >= grad_shape[0]:
                raise ValueError(
                    f"grad_indices[{high}] = {host[high]} exceeds grad_shape[0] = {grad_shape[0]}"
                )
            if host[high] > _INT32_MAX:
                raise ValueError(f"grad_indices[{high}] = {host[high]} does not fit in int32")
        if known is not None:
            if len(values.shape) < len(known):
                raise ValueError(
                    f"grad_values must have rank at least {len(known)} (the accumulator's "
                    f"shape {_fmt(known)}), got shape {list(values.shape)}"
                )
            for i in range(1, len(known)):
                if known[i] is not None and known[i] != values.shape[i]:
                    raise ValueError(
                        f"grad_values dim {i} must be {known[i]} (the accumulator's shape "
                        f"{_fmt(known)}), got {values.shape[i]}"
                    )
        return host, values

    def apply(self, indices: Any, values: Any, grad_shape: Any, local_step: Any) -> bool:
        step = _check_step("local_step", local_step)
        host, values = self._validate(indices, values, grad_shape)
        nnz = host.shape[0]
        slots_needed = _bucket(nnz)
        if nnz and nnz != slots_needed:  # pad rows to a bucketed count
            padded = np.zeros((slots_needed, *values.shape[1:]), values.dtype)
            padded[:nnz] = np.asarray(values)
            values = padded
        finite = self.finite(values) if self.skip_nonfinite else True
        values, _, _ = self.to_device(values, stage=False)  # its own buffer: no recycling
        if (host[1:] > host[:-1]).all():  # sorted and unique already, as TF expects
            unique, inverse = host, np.arange(nnz)
        else:
            unique, inverse = np.unique(host, return_inverse=True)
        with self.applying(step, finite) as accept:
            if self.values_shape is not None and (
                len(values.shape) != len(self.values_shape)
                or values.shape[1:] != self.values_shape[1:]
            ):
                raise ValueError(
                    f"grad_values rows must have shape {list(self.values_shape[1:])} (fixed "
                    f"by the first gradient since the last take), got {list(values.shape[1:])}"
                )
            if accept:
                if self.values_shape is None:
                    self.values_shape = (0, *values.shape[1:])
                if nnz:
                    with self.precision():
                        self._add_rows(unique, inverse, values, nnz)
        return accept

    def _add_rows(
        self, unique: np.ndarray, inverse: np.ndarray, values: jax.Array, nnz: int
    ) -> None:
        n = self.sorted_rows.shape[0]
        pos = np.searchsorted(self.sorted_rows, unique)
        found = np.zeros(unique.shape, bool)
        inside = pos < n
        found[inside] = self.sorted_rows[pos[inside]] == unique[inside]
        new_rows = unique[~found]
        slots = np.empty(unique.shape, np.int32)
        slots[found] = self.sorted_slots[pos[found]]
        slots[~found] = np.arange(n, n + new_rows.shape[0], dtype=np.int32)
        self.sorted_rows = np.insert(self.sorted_rows, pos[~found], new_rows)
        self.sorted_slots = np.insert(self.sorted_slots, pos[~found], slots[~found])
        self.row_counts = np.concatenate([self.row_counts, np.zeros(new_rows.shape[0], np.int64)])
        self.row_counts[slots] += 1
        needed = n + new_rows.shape[0]
        fresh = self.rows is None or needed > self.capacity
        if fresh:  # a new buffer: the first rows since the take, or grown
            self.capacity = max(self.capacity if self.rows is None else 0, _bucket(needed))
        per_value = np.full(values.shape[0], self.capacity, np.int32)  # padding: dropped
        per_value[:nnz] = slots[inverse.reshape(-1)]
        self.unsettled += 1
        if self.rows is not None and self.unsettled > _MAX_PENDING:
            self.rows.block_until_ready()  # a few scatters in flight at most
            self.unsettled = 0
        if fresh:
            self.rows = _scatter_fresh(
                self.rows, per_value, values, capacity=self.capacity, dtype=self.acc_dtype
            )
        else:
            self.rows = _scatter_add(self.rows, per_value, values)

    def _release(self) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        n = self.sorted_rows.shape[0]
        dims = (self.shape[0] if self.shape and self.shape[0] is not None else -1,)
        dims += tuple(self.values_shape[1:])
        indices, _, _ = self.to_device(self.sorted_rows.astype(np.int32), stage=False)
        if n == 0:
            values = jnp.zeros((0, *self.values_shape[1:]), self.dtype)
        else:
            counts = self.row_counts[self.sorted_slots]
            in_order = bool((self.sorted_slots == np.arange(n)).all())
            if (
                in_order
                and (not self.mean or (counts == 1).all())
                and self.rows.dtype == self.dtype
            ):
                taken = self.rows  # slots already sorted, nothing to divide: no kernel
            else:
                order = np.zeros(self.capacity, np.int32)
                order[:n] = self.sorted_slots
                gather = _gather_in_place if self.rows.dtype == self.dtype else _gather_copy
                padded_counts = np.ones(self.capacity, np.int32)
                padded_counts[:n] = counts
                taken = gather(self.rows, order, padded_counts, mean=self.mean, dtype=self.dtype)
            # Cut to the n real rows on the host: a device slice compiles once per n. On
            # a CPU device the cut is a view of `taken`, which nothing writes again.
            cut = np.asarray(taken)[:n]
            if self.staging is None:
                values, _, _ = self.to_device(cut, stage=False)
            else:
                values = jax.device_put(cut, may_alias=True)
            self.settle(taken)
        self._reset()
        return indices, values, dims


_registry: weakref.WeakValueDictionary[str, _Core] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def _core_for(shared_name: Any, make: Any) -> _Core:
    """A new core, or the live one registered under a non-empty `shared_name`."""
    if shared_name is not None and not isinstance(shared_name, str):
        raise TypeError(f"shared_name must be None or a str, got {shared_name!r}")
    core = make()
    if not shared_name:
        return core
    with _registry_lock:
        existing = _registry.get(shared_name)
        if existing is None:
            _registry[shared_name] = core
            return core
    if existing.signature() != core.signature():
        kind = {_DenseCore: "ConditionalAccumulator", _SparseCore: "SparseConditionalAccumulator"}

        def describe(c: _Core) -> str:
            return (
                f"{kind[type(c)]}(dtype={c.dtype.name}, shape={_fmt(c.shape)}, "
                f"reduction_type={'MEAN' if c.mean else 'SUM'}, "
                f"skip_nonfinite={c.skip_nonfinite})"
            )

        raise ValueError(
            f"shared_name {shared_name!r} is already used by a {describe(existing)}; "
            f"got a {describe(core)}"
        )
    return existing


# --------------------------------------------------------------------------- public objects


class _HostAccumulator:
    """What the dense and sparse objects share: construction, takes, steps, counters."""

    _core_type: type[_Core]

    def __init__(
        self,
        dtype: Any,
        shape: Any,
        shared_name: str | None,
        name: str,
        reduction_type: str,
        skip_nonfinite: bool,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        dtype = _check_dtype(dtype)
        shape = _check_shape(shape)
        mean = _common.canonical_reduction(reduction_type, argname="reduction_type") == "mean"
        skip_nonfinite = _common.require_bool("skip_nonfinite", skip_nonfinite)
        self._core = _core_for(
            shared_name, lambda: self._core_type(dtype, shape, mean, skip_nonfinite)
        )
        self._name = name

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the gradients accumulated (and of the taken aggregates)."""
        return self._core.dtype

    @property
    def shape(self) -> Shape | None:
        """The accumulator's shape: a tuple with None for unknown dims, or None."""
        return self._core.shape

    @property
    def name(self) -> str:
        """The name given at construction."""
        return self._name

    @property
    def reduction_type(self) -> str:
        """ "MEAN" or "SUM"."""
        return "MEAN" if self._core.mean else "SUM"

    @property
    def accumulator_ref(self) -> Any:
        """The underlying accumulator, shared by every object with this `shared_name`."""
        return self._core

    @property
    def global_step(self) -> int:
        """The accumulator's global step (not in TF, which only sets it)."""
        with self._core.lock:
            return self._core.global_step

    @property
    def num_dropped(self) -> int:
        """Stale gradients dropped so far (not in TF)."""
        with self._core.lock:
            return self._core.num_dropped

    @property
    def num_nonfinite(self) -> int:
        """Gradients skipped for holding NaN or Inf (only with `skip_nonfinite=True`)."""
        with self._core.lock:
            return self._core.num_nonfinite

    def num_accumulated(self) -> int:
        """The number of gradients accepted since the last take."""
        return self._core.num_accumulated()

    def set_global_step(self, new_global_step: int) -> None:
        """Sets the global step; a lower value is allowed and warns, as in TF.

        It changes neither the counter nor the aggregate.

        Raises:
          TypeError: if `new_global_step` is not an int.
        """
        self._core.set_global_step(new_global_step)

    def num_waiting_takes(self) -> int:
        """How many `take_grad` calls are blocked right now (not in TF)."""
        return self._core.num_waiting_takes()

    def cancel_waiting_takes(self) -> int:
        """Cancels every waiting take, as closing TF's session does.

        Each blocked `take_grad` raises `concurrent.futures.CancelledError` in its
        thread and consumes nothing. Gradients already accumulated stay, and the
        accumulator remains usable.

        Returns:
          The number of takes cancelled.
        """
        return self._core.cancel_waiting_takes()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dtype={self.dtype.name}, shape={_fmt(self.shape)}, "
            f"name={self.name!r}, reduction_type={self.reduction_type!r})"
        )


class ConditionalAccumulator(_HostAccumulator):
    """A thread-safe accumulator of step-tagged dense gradients (TF's object).

    Threads call `apply_grad(grad, local_step)`; a gradient is accepted iff
    `local_step >= global_step`, and a stale one is dropped silently. A learner calls
    `take_grad(num_required)`, which blocks until that many gradients have been
    accepted, then returns their mean (or sum), advances `global_step` by one, and
    resets the counter and aggregate. Takes queue first come, first served. See the
    module docstring for the shared rules (timeouts, cancellation, `shared_name`).

    The aggregate is a JAX array on the default device, updated in place by jitted,
    buffer-donating adds (up to four accepted gradients wait to be added in one pass;
    the take adds the rest and divides in the same pass); `take_grad` returns a
    `jax.Array` of `dtype`. NumPy gradients are copied at once, so actors may reuse
    their buffers; on a CPU device the copies go to a pool of aligned host buffers that
    is reused, so memory holds the aggregate plus up to eight gradient-sized buffers.

    Differences from TF: every gradient is validated, stale or not; float16 and
    bfloat16 accumulate in float32 (returned in `dtype`); bfloat16 is supported and
    integer dtypes are a TypeError; an array gradient must already have `dtype`
    (Python numbers and lists are converted); float64 stays float64 even when
    `jax_enable_x64` is off; `reduction_type` may be lower case; `take_grad` takes a
    `timeout`; `skip_nonfinite` is new.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the gradients' shape; None dims (or -1) are unknown, and `shape=None`
        means any shape. The first gradient accepted after a take fixes the shape
        until the next take.
      shared_name: if non-empty, every accumulator built with this name (while one is
        alive) is the same accumulator.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: if True, a fresh gradient holding NaN or Inf is skipped and
        counted in `num_nonfinite` instead of accepted (costs one device sync per
        apply). Default False: accumulated as given, as TF does.

    Raises:
      TypeError / ValueError: for a bad argument, naming it; ValueError when
        `shared_name` is in use by an accumulator of another kind, dtype, shape,
        reduction or `skip_nonfinite`.

    Example:
      >>> import threading, numpy as np, optax_accum
      >>> acc = optax_accum.ConditionalAccumulator(np.float32, shape=(2,))
      >>> workers = [
      ...     threading.Thread(target=acc.apply_grad, args=(np.full(2, x, np.float32),))
      ...     for x in (1.0, 2.0, 6.0)
      ... ]
      >>> for w in workers:
      ...     w.start()
      >>> acc.take_grad(3, timeout=10.0)  # blocks until three gradients are in
      Array([3., 3.], dtype=float32)
      >>> for w in workers:
      ...     w.join()
      >>> acc.apply_grad(np.ones(2, np.float32), local_step=0)  # stale now: dropped
      False
      >>> acc.global_step, acc.num_accumulated()
      (1, 0)
    """

    _core_type = _DenseCore

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, skip_nonfinite)

    def apply_grad(self, grad: Any, local_step: int = 0) -> bool:
        """Offers a gradient computed at `local_step`; returns whether it was accepted.

        A stale gradient (`local_step < global_step`) is dropped silently (returns
        False). If the apply brings the count to the `num_required` of the oldest
        waiting take, that take completes here and `global_step` advances at once.

        Args:
          grad: a NumPy or JAX array of the accumulator's dtype (or Python numbers).
          local_step: the global step the gradient was computed at.

        Returns:
          True if accepted, False if dropped (stale, or non-finite under
          `skip_nonfinite`).

        Raises:
          TypeError: for a wrong dtype or a non-int `local_step`.
          ValueError: for a shape incompatible with the accumulator's, or differing
            from the gradients accumulated since the last take. Nothing changes.
        """
        return self._core.apply(grad, local_step)

    def take_grad(self, num_required: int, timeout: float | None = None) -> jax.Array:
        """Blocks until `num_required` gradients are in, then returns their aggregate.

        Takes are served in the order they were called: a waiting take holds back
        every later one. On completion the global step advances by one and the counter
        and aggregate reset. MEAN divides by every accepted gradient, which can be
        more than `num_required`.

        Args:
          num_required: a positive int.
          timeout: seconds to wait at most; None waits forever.

        Returns:
          A `jax.Array` of the accumulator's dtype.

        Raises:
          ValueError / TypeError: for a bad `num_required` or `timeout` (no change).
          TimeoutError: when `timeout` passed first; the take is withdrawn.
          concurrent.futures.CancelledError: if `cancel_waiting_takes` was called.
        """
        return self._core.take(num_required, timeout)


class SparseConditionalAccumulator(_HostAccumulator):
    """A thread-safe accumulator of step-tagged row-sparse gradients (TF's object).

    The sparse sibling of `ConditionalAccumulator`, with the same step, take-queue,
    timeout, cancellation and `shared_name` rules. A gradient is
    `(indices, values, dense_shape)`: `values[i]` is a row of the gradient at row id
    `indices[i]`. MEAN is per row: each row of the answer is divided by the number of
    accepted gradients that touched that row. The answer's indices are sorted and
    unique; its shape is the accumulator's `shape[0]` (or -1 when unknown) followed
    by the values' row dims.

    The rows live on a JAX device in a buffer that grows by powers of two (no fixed
    capacity); gradients' row counts are padded to powers of two, so compilations
    stay bounded however the sizes vary. Row bookkeeping is NumPy on the host.

    Differences from TF: a gradient means its dense tensor, so duplicate indices
    within one gradient are summed into one row that counts once, and unsorted input
    is fine (TF returns duplicate rows there); negative indices are rejected; a values
    dtype other than the accumulator's is a TypeError (TF crashes the process); every
    gradient is validated, stale or not; plus the dense object's differences.

    Args:
      dtype: float16, bfloat16, float32 or float64.
      shape: the dense shape of the gradients; None dims (or -1) are unknown. Indices
        must be below `shape[0]` when it is known.
      shared_name: as for `ConditionalAccumulator`.
      name: a name, for display.
      reduction_type: "MEAN" (default) or "SUM", in any case.
      skip_nonfinite: as for `ConditionalAccumulator`.

    Raises:
      TypeError / ValueError: as for `ConditionalAccumulator`.

    Example:
      >>> import numpy as np, optax_accum
      >>> acc = optax_accum.SparseConditionalAccumulator(np.float32, shape=(4, 2))
      >>> acc.apply_grad([0, 1], np.array([[1, 0], [0, 2]], np.float32))
      True
      >>> acc.apply_grad([2, 0], np.array([[3, 0], [0, 1]], np.float32))
      True
      >>> indices, values, shape = acc.take_grad(2, timeout=10.0)
      >>> indices.tolist(), values.tolist(), shape
      ([0, 1, 2], [[0.5, 0.5], [0.0, 2.0], [3.0, 0.0]], (4, 2))
    """

    _core_type = _SparseCore

    def __init__(
        self,
        dtype: Any,
        shape: Any = None,
        shared_name: str | None = None,
        name: str = "sparse_conditional_accumulator",
        reduction_type: str = "MEAN",
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__(dtype, shape, shared_name, name, reduction_type, skip_nonfinite)

    def apply_grad(
        self,
        grad_indices: Any,
        grad_values: Any,
        grad_shape: Sequence[int] | None = None,
        local_step: int = 0,
    ) -> bool:
        """Offers a sparse gradient computed at `local_step`; returns whether accepted.

        Checked in TF's order (indices a vector; values at least 1-D with one row per
        index; `grad_shape` against the accumulator's known dims; indices within
        `shape[0]` and not negative; values' rows against the accumulator and the
        gradients since the last take). An empty gradient (no rows) is accepted and
        counts. Duplicate indices are summed and count once.

        Args:
          grad_indices: an integer vector of row ids (NumPy, JAX or a list).
          grad_values: `[len(grad_indices), ...]` rows of the accumulator's dtype.
          grad_shape: the gradient's dense shape, or None / empty.
          local_step: the global step the gradient was computed at.

        Returns:
          True if accepted, False if dropped (stale, or non-finite under
          `skip_nonfinite`).

        Raises:
          TypeError: for a wrong values dtype, non-integer indices or `local_step`.
          ValueError: for any shape or index check above. Nothing changes.
        """
        return self._core.apply(grad_indices, grad_values, grad_shape, local_step)

    def apply_indexed_slices_grad(self, grad: IndexedSlices, local_step: int = 0) -> bool:
        """`apply_grad` for an `IndexedSlices` gradient.

        Rows at the padding index (`grad.padding_index`: `dense_shape[0]`, or the
        int32 maximum when the row count is unknown, as the functional
        `sparse_conditional_accumulator` pads) are left out; every other index is
        checked as in `apply_grad`.

        Args:
          grad: the gradient.
          local_step: the global step the gradient was computed at.

        Returns:
          True if accepted, False if dropped.

        Raises:
          TypeError: if `grad` is not an `IndexedSlices`; otherwise as `apply_grad`.
        """
        if not isinstance(grad, IndexedSlices):
            raise TypeError(f"grad must be an optax_accum.IndexedSlices, got {type(grad).__name__}")
        indices, values = grad.indices, grad.values
        if hasattr(indices, "shape") and len(indices.shape) == 1:
            keep = np.asarray(jax.device_get(indices)) != grad.padding_index
            if not keep.all():
                indices, values = np.asarray(indices)[keep], np.asarray(values)[keep]
        return self._core.apply(indices, values, grad.dense_shape, local_step)

    def take_grad(
        self, num_required: int, timeout: float | None = None
    ) -> tuple[jax.Array, jax.Array, tuple[int, ...]]:
        """Blocks until `num_required` gradients are in; returns their aggregate rows.

        Served first come, first served, as `ConditionalAccumulator.take_grad`.

        Args:
          num_required: a positive int.
          timeout: seconds to wait at most; None waits forever.

        Returns:
          `(indices, values, shape)`: sorted unique int32 row ids, their rows (MEAN
          per row, or SUM) in the accumulator's dtype, and the dense shape as a tuple
          of ints (dim 0 is -1 when the accumulator's is unknown).

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return self._core.take(num_required, timeout)

    def take_indexed_slices_grad(
        self, num_required: int, timeout: float | None = None
    ) -> IndexedSlices:
        """`take_grad`, returning an `IndexedSlices`.

        Args:
          num_required: a positive int.
          timeout: seconds to wait at most; None waits forever.

        Returns:
          `IndexedSlices(indices, values, shape)` as `take_grad` returns them.

        Raises:
          As `ConditionalAccumulator.take_grad`.
        """
        return IndexedSlices(*self.take_grad(num_required, timeout))


__all__ = ["ConditionalAccumulator", "SparseConditionalAccumulator"]
