"""Getting gradients onto the device as buffers the accumulator owns.

An accumulator never keeps a reference to a caller's array past `apply_grad`: NumPy
input is copied at once (the caller may reuse it), and a caller's JAX array is either
copied to the device or read by a kernel dispatched before the apply returns (the
caller may donate it to a jit afterwards; JAX orders that after our read).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from optax_accum import _compat, _sums


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised NumPy array whose data is 64-byte aligned, as XLA's CPU client
    needs to use host memory in place."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class StagingPool:
    """Aligned host buffers that NumPy gradients are copied into on a CPU device.

    JAX then uses such a buffer in place. A fresh multi-megabyte allocation costs a
    page fault per page on every apply, so a buffer is handed back once the kernel
    that read it has finished, and reused; at most `keep` idle buffers are kept per
    shape and dtype.
    """

    def __init__(self, keep: int) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple, list[np.ndarray]] = {}
        self._keep = keep

    def acquire(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        with self._lock:
            idle = self._idle.get((tuple(shape), np.dtype(dtype)))
            if idle:
                return idle.pop()
        return aligned_empty(shape, dtype)

    def release(self, buffers: Iterable[np.ndarray | None]) -> None:
        with self._lock:
            for buffer in buffers:
                if buffer is None:
                    continue
                idle = self._idle.setdefault((buffer.shape, buffer.dtype), [])
                if len(idle) < self._keep:
                    idle.append(buffer)


class Device:
    """The device an accumulator computes on, and how inputs get there."""

    def __init__(self, acc_dtype: np.dtype, keep: int) -> None:
        self.device = jax.devices()[0]
        self.is_cpu = self.device.platform == "cpu"
        self.staging = StagingPool(keep) if self.is_cpu else None
        self._x64 = acc_dtype == np.float64

    def precision(self) -> contextlib.AbstractContextManager:
        """Lets float64 aggregates stay float64 when jax_enable_x64 is off (thread-local)."""
        if self._x64 and not jax.config.jax_enable_x64:
            return _compat.enable_x64(True)
        return contextlib.nullcontext()

    def is_callers(self, x: Any) -> bool:
        """Whether `x` is a caller's JAX array already on our device: usable as it is,
        but only by a kernel dispatched before the apply returns."""
        return isinstance(x, jax.Array) and x.sharding.device_set == {self.device}

    def stage(self, x: np.ndarray, rows: int | None = None) -> np.ndarray:
        """A pooled, aligned copy of NumPy `x` (CPU only), zero-padded to `rows` rows if
        given; `recycle` it once no kernel reads it."""
        if rows is None or rows == x.shape[0]:
            buffer = self.staging.acquire(x.shape, x.dtype)
            np.copyto(buffer, x)
            return buffer
        buffer = self.staging.acquire((rows, *x.shape[1:]), x.dtype)
        np.copyto(buffer[: x.shape[0]], x)
        buffer[x.shape[0] :] = 0
        return buffer

    def recycle(self, buffers: Iterable[np.ndarray | None]) -> None:
        if self.staging is not None:
            self.staging.release(buffers)

    def own(self, x: Any) -> jax.Array:
        """A device array holding `x` whose buffer is ours alone (a copy if need be)."""
        with self.precision():
            if isinstance(x, jax.Array):
                if self.is_callers(x):
                    return jax.device_put(x, self.device, may_alias=False)
                return jax.device_put(x, self.device)
            if not self.is_cpu:
                return jax.device_put(x, self.device)
            # NumPy's copy releases the GIL (actors do not starve the learner); JAX then
            # adopts the aligned buffer, which nothing else references.
            fresh = aligned_empty(x.shape, x.dtype)
            np.copyto(fresh, x)
            return jax.device_put(fresh, may_alias=True)


class OnDevice:
    """A mixin for the kinds of `_core.Core` whose aggregate lives on a JAX device: it
    sets their accumulator dtype (float16/bfloat16 accumulate in float32, as the
    functional accumulators do) and `device`, keeping `staging_keep` idle staging
    buffers per shape, and reduces in the device's precision."""

    staging_keep = 8

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.acc_dtype = _sums.accumulator_dtype_for(self.dtype, None)
        self.device = Device(self.acc_dtype, self.staging_keep)

    def reducing(self) -> contextlib.AbstractContextManager:
        return self.device.precision()
