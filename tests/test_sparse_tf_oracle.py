"""sparse_conditional_accumulator against TF's SparseConditionalAccumulator itself.

`tf_sparse_oracle.py` ran random programs through TensorFlow 2.21 and recorded every
take in `data/sparse_tf_oracle.json` (regenerate with the command in that script).
Here each program is replayed at the capacities where the code changes, from a row
buffer (one per rows/num_required/reduction group, just fitting the group's largest
window: see `_buffers`) to beyond the table (see `_capacities`), with the default
`sparse` (a row buffer while the capacity is below the table's rows, a dense leaf
from there on): every release must be TF's take, and the counts and global step must
follow TF's. Releases are compared in NumPy (`_dense`), so only the setups compile.

TensorFlow is not a dependency. To check fresh programs, run the oracle script with
another seed and point `OPTAX_ACCUM_TF_ORACLE` at its output:

    /tmp/tfvenv/bin/python tests/tf_sparse_oracle.py /tmp/fresh.json --seed 7
    OPTAX_ACCUM_TF_ORACLE=/tmp/fresh.json python -m pytest tests/test_sparse_tf_oracle.py
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from _compiled import compiled_once

import optax_accum
from optax_accum import IndexedSlices

HERE = Path(__file__).resolve().parent
NNZ = 4  # the most rows a recorded gradient has
RECORDED = Path(os.environ.get("OPTAX_ACCUM_TF_ORACLE", HERE / "data" / "sparse_tf_oracle.json"))


@functools.cache
def _update(rows: int, dim: int, num_required: int, reduction: str, capacity: int):
    """The initial state and compiled update of one setup. Each setup is traced and
    lowered (cheap); setups that lower to the same program share one compile (XLA's
    compile is the cost): beyond the table the dense leaf runs, and lowers to, the very
    program it does at the table's rows, since it never reads the capacity."""
    tx = optax_accum.sparse_conditional_accumulator(
        optax.identity(), num_required, capacity=capacity, reduction=reduction
    )
    state = tx.init(jnp.zeros((rows, dim)))
    g = IndexedSlices(jnp.zeros(NNZ, jnp.int32), jnp.zeros((NNZ, dim), jnp.float32), (rows, dim))
    update = compiled_once(lambda g, s, ls: tx.update(g, s, local_step=ls), g, state, jnp.int32(0))
    return state, update


def _window_rows(program: dict) -> int:
    """The most distinct rows accepted between two takes."""
    most, rows, global_step = 0, set(), 0
    for step in program["steps"]:
        if step["local_step"] >= global_step:
            rows |= set(step["ids"])
        most = max(most, len(rows))
        if step["take"] is not None:
            rows, global_step = set(), global_step + 1
    return most


def _buffers(programs: list[dict]) -> dict[tuple, int]:
    """One row buffer's capacity per (rows, num_required, reduction) group: the most
    rows any of the group's programs touches in a window, among those whose windows
    fit below the table's rows. That program's buffer just fits (one row fewer would
    overflow); the group's other programs run in a larger buffer, as they would at one
    below the table's rows: nothing branches on a row buffer's capacity between the
    fewest rows that fit and the table's rows. One buffer per group is one compile per
    group, not one per program."""
    buffers: dict[tuple, int] = {}
    for p in programs:
        window = max(_window_rows(p), 1)
        if window < p["rows"]:
            group = (p["rows"], p["num_required"], p["reduction"])
            buffers[group] = max(buffers.get(group, 0), window)
    return buffers


def _capacities(program: dict, buffers: dict[tuple, int]) -> list[int]:
    """The group's row buffer (when the program's windows fit below the table's rows),
    the table's rows (dense) and, for the programs releasing every gradient, beyond the
    table.

    These are where the code changes (see `_buffers` for the row buffer); a dense leaf
    never reads the capacity, so beyond the table it runs the program it runs at the
    table's rows (each distinct program compiles once, and that is the cost: the
    programs releasing every gradient stand for the others there, and `_update` checks
    that they lower to the table's program and reuses its compile).
    """
    rows = program["rows"]
    window = max(_window_rows(program), 1)
    buffer = (
        [buffers[(rows, program["num_required"], program["reduction"])]] if window < rows else []
    )
    beyond = [rows + 2] if program["num_required"] == 1 else []
    return sorted({*buffer, rows, *beyond})


def _kind(program: dict, capacity: int) -> str:
    rows = program["rows"]
    if capacity >= rows:
        return "table" if capacity == rows else "beyond"
    return "fits" if capacity == max(_window_rows(program), 1) else "buffer"


def _dense(u, rows: int, dim: int) -> np.ndarray:
    """A release's dense meaning in NumPy (rows scatter-added, padding ignored), as
    `IndexedSlices.to_dense` gives it, without compiling a scatter per shape."""
    if not isinstance(u, IndexedSlices):
        return np.asarray(u)
    ids, values = np.asarray(u.indices), np.asarray(u.values)
    real = (ids >= 0) & (ids < rows)
    dense = np.zeros((rows, dim), values.dtype)
    np.add.at(dense, ids[real], values[real])
    return dense


def replay(program: dict, buffers: dict[tuple, int]) -> int:
    """Replays one recorded program at every capacity; returns the takes compared."""
    rows, dim = program["rows"], program["dim"]
    compared = 0
    for capacity in _capacities(program, buffers):
        state, update = _update(rows, dim, program["num_required"], program["reduction"], capacity)
        global_step = 0
        for t, step in enumerate(program["steps"]):
            # Padded to NNZ rows (padding id `rows`, zero values): one compile per setup.
            ids = np.full(NNZ, rows, np.int32)
            ids[: len(step["ids"])] = step["ids"]
            values = np.zeros((NNZ, dim), np.float32)
            values[: len(step["ids"])] = np.asarray(step["values"], np.float32).reshape(-1, dim)
            g = IndexedSlices(jnp.asarray(ids), jnp.asarray(values), (rows, dim))
            u, state = update(g, state, jnp.int32(step["local_step"]))
            where = f"capacity {capacity}, step {t}"
            assert int(state.count) == step["count"], where
            assert int(state.num_overflowed) == 0, where
            taken = step["take"]
            assert bool(state.emitted) == (taken is not None), where
            if taken is None:
                continue
            global_step += 1
            expected = np.zeros((rows, dim), np.float32)
            expected[taken["ids"]] = np.asarray(taken["values"], np.float32).reshape(-1, dim)
            dense = _dense(u, rows, dim)
            np.testing.assert_allclose(dense, expected, rtol=1e-6, atol=1e-7, err_msg=where)
            if isinstance(u, IndexedSlices):
                real = np.asarray(u.indices)[np.asarray(u.indices) < rows]
                assert real.tolist() == taken["ids"], where
            compared += 1
        assert int(optax_accum.global_step(state)) == global_step
    return compared


def test_recorded_tf_programs_agree_at_every_capacity():
    recorded = json.loads(RECORDED.read_text())
    programs = recorded["programs"]
    assert len(programs) >= 30
    buffers = _buffers(programs)
    compared = sum(replay(p, buffers) for p in programs)
    takes = [sum(s["take"] is not None for s in p["steps"]) for p in programs]
    assert sum(takes) >= 150  # every take, at each of its program's capacities:
    assert compared == sum(
        t * len(_capacities(p, buffers)) for t, p in zip(takes, programs, strict=True)
    )
    # Every kind of capacity is replayed: a row buffer that just fits, the largest row
    # buffer, the table's rows and beyond.
    kinds = {_kind(p, c) for p in programs for c in _capacities(p, buffers)}
    assert kinds == {"fits", "buffer", "table", "beyond"}, kinds
    # Beyond the table, the setup lowered to the table's program (one compile for both).
    for p in programs:
        if "beyond" in {_kind(p, c) for c in _capacities(p, buffers)}:
            setup = (p["rows"], p["dim"], p["num_required"], p["reduction"])
            assert _update(*setup, p["rows"])[1] is _update(*setup, p["rows"] + 2)[1]
    # The programs exercise both kinds of leaf, stale and future gradients, both rules.
    assert {p["reduction"] for p in programs} == {"MEAN", "SUM"}
    lags = {s["lag"] for p in programs for s in p["steps"]}
    assert {-1, 0, 1} <= lags
