"""The wire format of a cross-replica sum: what a reduction sends, and in which type.

`reduced(tree, axis_name, communication_dtype=...)` sums (or averages) every leaf of
`tree` over a mapped axis (`jax.pmap`, `jax.shard_map`, `jax.vmap`; a tuple of names
too). Without a `communication_dtype` it is `lax.psum`. With a narrow one the values
travel narrow and are never summed narrow:

1. a leaf of rank 2 or more whose rows hold at least `BLOCK` (256) values and split
   evenly over the replicas is sent row by row, each row a block, in its own layout
   (and its own collectives); every other leaf is flattened and padded to whole
   blocks of `BLOCK` values, and their blocks are laid end to end (a block never spans
   two leaves) and padded to a whole number of blocks per replica;
2. each block is encoded on its own: int8 and float8 (`jnp.float8_e4m3fn`) as
   `round(x / scale)` with a float32 `scale = max|block| / qmax` (127, 448), the
   scales in collectives of their own beside the values'; bfloat16 as it is, without
   scales;
3. one all-to-all gives replica r the r-th share of every replica's blocks; it decodes
   them to float32 and sums them there, in float32 (divides by the replica count for
   a mean), then encodes the share's sum (new scales) and one all-gather hands every
   replica every share. All replicas decode the same bytes: the result is the same
   bits everywhere.

Error (against the exact sum, per value of a block): int8 rounds each replica's value
to within `scale / 2 = max|block| / 254`, and the sum once more to within its own
block's `max / 254`; float8 e4m3 keeps 3 mantissa bits, a relative error of at most
1/16 per rounding (and `scale / 1024` absolute near zero); bfloat16 8 bits, 1/256. So
the error of a sum of n replicas is at most the n first roundings plus the last one.
A NaN or Inf spreads to its block (its scale is not finite); a block whose largest
value is below about 1e-36 (a float32 scale that underflows) sends zeros.

Cost: per device, a ring all-reduce of float32 moves `2 (n-1)/n * 4` bytes a value;
the all-to-all and the all-gather move `(n-1)/n * (1 + 4/B)` each for int8 and
float8 (blocks of B values: 256, or a row), `(n-1)/n * 2` each for bfloat16: at most
1/3.94 and 1/2 of float32's, more with the padding (a leaf's last block, and up to
n-1 blocks to share the blocks evenly). Row by row, a leaf is never copied into blocks
and back: on TPU that halves the release's temporaries (docs/guide.md).
Read from compiled programs in tests/test_wire.py and docs/guide.md, "Quantized
releases".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_accum import _collectives, _compat

BLOCK = 256  # values per scale: 4 bytes of scale for 256 of payload (1.6%)

# The narrow types, with the largest encoded magnitude (None: sent without scales).
_QMAX = {
    np.dtype(jnp.int8): 127.0,
    np.dtype(jnp.float8_e4m3fn): 448.0,
    np.dtype(jnp.bfloat16): None,
}
_NAMES = "None, jnp.float32, jnp.bfloat16, jnp.int8 or jnp.float8_e4m3fn"


def wire_dtype(name: str, value: Any) -> np.dtype | None:
    """Checks a `communication_dtype` argument: None (or float32: a plain `psum`),
    bfloat16, int8 or float8_e4m3fn, as a dtype or its name. Returns the narrow dtype,
    or None for a plain `psum`.

    Raises:
      TypeError: for a value that is no dtype; ValueError for a dtype not listed.
    """
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name} must be {_NAMES}, got {value!r} ({type(value).__name__})") from e
    if dtype == np.dtype(np.float32):
        return None
    if dtype not in _QMAX:
        raise ValueError(
            f"{name} must be {_NAMES}, got {dtype}: float16 overflows where float32 "
            "gradients do not, and a sum is never taken in the narrow type (use bfloat16)"
        )
    return dtype


# --------------------------------------------------------------------------- encoding


def _encoded(blocks: jax.Array, dtype: np.dtype) -> tuple:
    """float32 `(..., BLOCK)` blocks encoded: `(values, scales)`, the values in
    `dtype` as bytes (bfloat16 as uint16: XLA:CPU would move a bfloat16 collective in
    float32) and one float32 scale per block (none for bfloat16). The two travel in
    collectives of their own: bytes laid beside the scales along the blocks' minor
    axis would make the TPU lay the blocks out transposed, a copy of each leaf."""
    qmax = _QMAX[dtype]
    if qmax is None:
        return lax.bitcast_convert_type(blocks.astype(dtype), jnp.uint16), None
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = amax / jnp.float32(qmax)
    safe = jnp.where(scale > 0, scale, jnp.ones((), jnp.float32))
    x = jnp.clip(blocks / safe[..., None], -qmax, qmax)
    values = jnp.round(x).astype(jnp.int8) if dtype == np.dtype(jnp.int8) else x.astype(dtype)
    return lax.bitcast_convert_type(values, jnp.uint8), scale


def _decoded(sent: tuple, dtype: np.dtype) -> jax.Array:
    """`_encoded`'s blocks back in float32."""
    values, scale = sent
    decoded = lax.bitcast_convert_type(values, dtype).astype(jnp.float32)
    return decoded if scale is None else decoded * scale[..., None]


# --------------------------------------------------------------------------- packing


def _row_wise(x: jax.Array, n: int) -> bool:
    """Whether a leaf is sent row by row: rank 2 or more, rows of at least `BLOCK`
    values (a scale per row then costs at most 4 bytes in 256), and rows that split
    evenly over the `n` replicas. Its rows are then its blocks, in its own layout (the
    TPU keeps a leaf tiled by its last two axes: cut into blocks of 256 it must be
    copied, and copied back)."""
    shape = jnp.shape(x)
    return len(shape) >= 2 and shape[-1] >= BLOCK and (x.size // shape[-1]) % n == 0


def _blocks(x: jax.Array) -> jax.Array:
    """A leaf's values as float32 blocks `(count, BLOCK)`, its last block padded."""
    flat = jnp.ravel(x).astype(jnp.float32)
    return jnp.pad(flat, (0, -flat.size % BLOCK)).reshape(-1, BLOCK)


def _each(fn: Any, sent: tuple) -> tuple:
    """`fn` on the values and the scales (if any) of encoded blocks."""
    return tuple(None if a is None else fn(a) for a in sent)


def _exchanged(parts: list, axis_name: Any, n: int, dtype: np.dtype, mean: bool) -> list:
    """Float32 blocks `(count_i, width)` (one width for all) summed over `axis_name`
    through `dtype`: encoded, laid end to end and split in `n` equal shares, one
    all-to-all, each replica's share decoded and summed in float32, encoded again, one
    all-gather, decoded. The scales travel in a pair of collectives of their own."""
    encoded = [_encoded(p, dtype) for p in parts]
    counts = [p.shape[0] for p in parts]
    share = -(-sum(counts) // n)

    def shares(pieces: list) -> jax.Array:  # laid end to end, padded, split in n shares
        whole = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        if share * n != whole.shape[0]:
            pad = [(0, share * n - whole.shape[0])] + [(0, 0)] * (whole.ndim - 1)
            whole = jnp.pad(whole, pad)
        return whole.reshape(n, share, *whole.shape[1:])

    sent = tuple(None if e[0] is None else shares(list(e)) for e in zip(*encoded, strict=True))
    names = frozenset(_collectives.names(axis_name))
    if names <= set(jax.sharding.get_abstract_mesh().manual_axes):
        # an invariant value is each replica's own
        sent = _each(lambda a: _compat.make_varying(a, names), sent)
    got = _each(lambda a: lax.all_to_all(a, axis_name, 0, 0), sent)  # [j]: replica j's
    total = _decoded(_each(lambda a: a[0], got), dtype)
    for j in range(1, n):  # in replica order, the same in every program (a reduce's is not)
        total = total + _decoded(_each(lambda a, j=j: a[j], got), dtype)
    if mean:
        total = total / jnp.float32(n)
    gathered = _each(
        lambda a: _collectives.all_gather(a, axis_name, invariant=True).reshape(
            n * share, *a.shape[1:]
        ),
        _encoded(total, dtype),
    )
    out, start = [], 0
    for count in counts:
        part = _each(lambda a, start=start, count=count: a[start : start + count], gathered)
        out.append(_decoded(part, dtype))
        start += count
    return out


def _narrow_sum(leaves: list, axis_name: Any, dtype: np.dtype, mean: bool) -> list:
    """The leaves summed (averaged) over `axis_name` through `dtype` (see the module
    docstring): each leaf whose rows are long enough sent row by row (`_row_wise`), in
    an exchange of its own, the others in blocks of `BLOCK`, all in one. Each leaf is
    encoded and decoded on its own, so only the narrow bytes are laid end to end."""
    n = _collectives.axis_size(axis_name)
    out: list = [None] * len(leaves)
    packed = [i for i, x in enumerate(leaves) if not _row_wise(x, n)]
    for i in (i for i in range(len(leaves)) if i not in packed):
        x = leaves[i]
        rows = x.astype(jnp.float32).reshape(-1, x.shape[-1])
        (total,) = _exchanged([rows], axis_name, n, dtype, mean)
        out[i] = total.reshape(x.shape).astype(x.dtype)
    if packed:
        parts = [_blocks(leaves[i]) for i in packed]
        for i, total in zip(packed, _exchanged(parts, axis_name, n, dtype, mean), strict=True):
            x = leaves[i]
            out[i] = total.reshape(-1)[: x.size].reshape(jnp.shape(x)).astype(x.dtype)
    return out


# --------------------------------------------------------------------------- reductions


def reduced(
    tree: Any, axis_name: Any, *, communication_dtype: Any = None, mean: bool = False
) -> Any:
    """Every leaf of `tree` summed (with `mean`, averaged) over the mapped axis
    `axis_name` (a name or a tuple of names), the same on every replica.

    `communication_dtype` None (or float32) is `lax.psum` (XLA may pack the leaves'
    all-reduces into one). bfloat16, int8 or float8_e4m3fn send the values in that type
    (int8 and float8 with a float32 scale per block of `BLOCK` values, or per row of a
    leaf whose rows are longer), sum them in float32 and send the sum back the same way:
    one all-to-all and one all-gather for the leaves cut into blocks, one each for every
    leaf sent row by row (and as many again for the scales). The leaves come back in
    their own dtypes. The module docstring gives the error and the bytes.
    """
    dtype = wire_dtype("communication_dtype", communication_dtype)
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    if dtype is None:
        out = lax.psum(leaves, axis_name)
        if mean:
            n = _collectives.axis_size(axis_name)
            out = [x / jnp.asarray(n, x.dtype) for x in out]
        return treedef.unflatten(out)
    return treedef.unflatten(_narrow_sum(leaves, axis_name, dtype, mean))


def unreduced_total(tree: Any, *, communication_dtype: Any = None) -> Any:
    """Every leaf of `tree` typed unreduced over mesh axes (`jax.jit` with explicit
    sharding: each device holds a partial sum) reduced to the plain type, the wire in
    `communication_dtype`; leaves not typed unreduced come back as they are.

    None (or float32) is the reshard that all-reduces each leaf. A narrow type runs
    `reduced` over the leaf's unreduced axes inside a `jax.shard_map` over the whole
    mesh (jax 0.10 takes unreduced specs in full manual mode only), each device holding
    its shard of the partial sum; one map per set of unreduced axes.
    """
    dtype = wire_dtype("communication_dtype", communication_dtype)
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        axes = _compat.sum_types(x)[1]
        if axes:
            groups.setdefault(axes, []).append(i)
    for axes, at in groups.items():
        if dtype is None:
            for i in at:
                out[i] = _compat.retyped(leaves[i], reduced=_compat.sum_types(leaves[i])[0])
            continue
        for i, x in zip(at, _manual_narrow_sum([leaves[i] for i in at], axes, dtype), strict=True):
            out[i] = x
    return treedef.unflatten(out)


def _manual_narrow_sum(leaves: list, axes: frozenset, dtype: np.dtype) -> list:
    """`_narrow_sum` over the mesh axes `axes` of leaves typed unreduced over them, in a
    `jax.shard_map` over the whole mesh (its vma checks off: inside, each device's
    block is its partial sum, not yet typed so on jax 0.10)."""
    mesh = _compat.explicit_sharding(jax.typeof(leaves[0])).mesh
    specs = [jax.typeof(x).sharding.spec for x in leaves]
    in_specs = [
        jax.sharding.PartitionSpec(*s.partitions, unreduced=s.unreduced, reduced=s.reduced)
        for s in specs
    ]
    out_specs = [jax.sharding.PartitionSpec(*s.partitions) for s in specs]
    order = tuple(a for a in mesh.axis_names if a in axes)
    names = order[0] if len(order) == 1 else order

    def body(*local: jax.Array) -> list:
        return _narrow_sum(list(local), names, dtype, False)

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        axis_names=set(mesh.axis_names),
        check_vma=False,
    )
    return [
        _compat.retyped(x, reduced=s.reduced) if s.reduced else x
        for x, s in zip(mapped(*leaves), specs, strict=True)
    ]


__all__ = ["BLOCK", "reduced", "unreduced_total", "wire_dtype"]
