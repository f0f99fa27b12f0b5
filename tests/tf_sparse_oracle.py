"""Random programs run through TF's own SparseConditionalAccumulator (the oracle).

Run with a Python that has TensorFlow (not a dependency of optax_accum):

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu
    /tmp/tfvenv/bin/python tests/tf_sparse_oracle.py tests/data/sparse_tf_oracle.json

Each program is a stream of sparse gradients (sorted, unique row ids, where TF's merge
and the dense meaning agree; random local steps, some stale, some from the future)
applied to `tf.compat.v1.SparseConditionalAccumulator` in a v1 Session; whenever
`num_required` gradients have been accepted, `take_grad(num_required)` runs and its
result is recorded. `tests/test_sparse_tf_oracle.py` replays the recorded programs
through `sparse_conditional_accumulator` at every capacity and compares; with
`OPTAX_ACCUM_TF_PYTHON` set to such a Python, it also runs fresh programs live.

This file only imports TensorFlow inside `run_tf`, so pytest can collect it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROWS = (5, 7)
DIM = 2
STEPS = 14


def make_program(rng: np.random.Generator) -> dict:
    """One random program: its shape, its rule, and the gradients in order."""
    rows = int(rng.choice(ROWS))
    program: dict[str, Any] = {
        "rows": rows,
        "dim": DIM,
        "num_required": int(rng.integers(1, 4)),
        "reduction": str(rng.choice(["MEAN", "SUM"])),
        "steps": [],
    }
    for _ in range(STEPS):
        nnz = int(rng.integers(0, min(rows, 4) + 1))
        ids = sorted(int(i) for i in rng.choice(rows, size=nnz, replace=False))
        values = rng.normal(size=(nnz, DIM)).astype(np.float32)
        program["steps"].append(
            {
                "ids": ids,
                "values": values.tolist(),
                "lag": int(rng.choice([-1, 0, 0, 0, 1, 4])),  # local step = GS + lag
            }
        )
    return program


def run_tf(programs: list[dict]) -> list[dict]:
    """Runs each program through TF and records, per step, the local step used, the
    count after the step, and the take's result (or None)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    out = []
    for program in programs:
        rows, dim, k = program["rows"], program["dim"], program["num_required"]
        graph = tf.Graph()
        with graph.as_default():
            acc = tf.compat.v1.SparseConditionalAccumulator(
                tf.float32, shape=(rows, dim), reduction_type=program["reduction"]
            )
            indices = tf.compat.v1.placeholder(tf.int64, [None])
            values = tf.compat.v1.placeholder(tf.float32, [None, dim])
            local_step = tf.compat.v1.placeholder(tf.int64, [])
            apply = acc.apply_grad(indices, values, local_step=local_step)
            take = acc.take_grad(k)
            count = acc.num_accumulated()
        global_step = 0
        recorded = []
        with tf.compat.v1.Session(graph=graph) as session:
            for step in program["steps"]:
                ls = global_step + step["lag"]
                feed = {
                    indices: np.asarray(step["ids"], np.int64),
                    values: np.asarray(step["values"], np.float32).reshape(-1, dim),
                    local_step: ls,
                }
                session.run(apply, feed)
                taken = None
                if session.run(count) >= k:
                    got_ids, got_values, _ = session.run(take)
                    taken = {"ids": got_ids.tolist(), "values": got_values.tolist()}
                    global_step += 1
                recorded.append(
                    {**step, "local_step": ls, "count": int(session.run(count)), "take": taken}
                )
        out.append({**program, "steps": recorded, "tensorflow": tf.__version__})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON ('-' for stdout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--programs", type=int, default=30)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    result = run_tf([make_program(rng) for _ in range(args.programs)])
    text = json.dumps({"seed": args.seed, "programs": result})
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
