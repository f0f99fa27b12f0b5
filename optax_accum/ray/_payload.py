"""How arguments travel to the accumulator's actor: as host NumPy, never as device
arrays, and the large ones by reference through Ray's object store."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray

from optax_accum import _compat

# Arrays of at least this many bytes go by reference (`ray.put`); smaller ones are
# sent inline with the call, as Ray sends small arguments.
BY_REFERENCE_BYTES = 100 * 1024


def to_host(x: Any) -> Any:
    """`x` with a `jax.Array` brought to host NumPy (one transfer); anything else,
    NumPy arrays and Python values included, as it came (the actor checks it)."""
    if isinstance(x, jax.Array):
        return np.asarray(x)
    return x


def send(x: Any) -> Any:
    """`to_host(x)`, put in the object store when it is a large NumPy array: the call
    then carries its reference, which Ray resolves to a read-only view in the actor."""
    x = to_host(x)
    if isinstance(x, np.ndarray) and x.nbytes >= BY_REFERENCE_BYTES:
        return ray.put(x)
    return x


def from_host(x: np.ndarray) -> jax.Array:
    """A taken array, returned as the in-process classes return it: a `jax.Array` on
    the caller's default device, of the same dtype (float64 too when jax_enable_x64
    is off, as the in-process objects keep it)."""
    if x.dtype == np.float64 and not jax.config.jax_enable_x64:
        with _compat.enable_x64(True):
            return jnp.asarray(x)
    return jnp.asarray(x)
