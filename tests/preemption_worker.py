"""A training process for tests/test_preemption.py, meant to be killed with SIGKILL.

    python tests/preemption_worker.py CHECKPOINT_DIR RESULT_DIR TOTAL_STEPS

Trains the Cases of tests/_cases.py named in `CASE_NAMES` side by side (the jitted
steps of tests/orbax_worker.py). On a fresh start (no checkpoint yet) it first runs all
TOTAL_STEPS uninterrupted, in memory, and pickles that run's final leaves to
RESULT_DIR/reference.pkl: the run the interrupted one must match bit for bit. Then it
trains again from scratch, and after each step i saves all cases' params and optimizer
state as Orbax checkpoint i + 1 (steps done). A restarted process resumes from the
newest complete checkpoint and prints `restored K`. After each checkpoint it prints
`saved K` and waits for a line on stdin before the next step, so the test decides
where the SIGKILL lands: while the process waits, or right after it was told to go
on (inside the next step or its checkpoint write). When all steps are done it
pickles the final leaves to RESULT_DIR/final.pkl and prints `done`.
"""

from __future__ import annotations

import pathlib
import pickle
import sys
from typing import Any

import _checkpoint
import orbax_worker
from _cases import CASES

# One case of each transform family: conditional_accumulator, its sparse variant, agn
# (the delta commit with an outer optimizer), cross_shard_optimizer (groups, sum) and
# drop_stale_gradients, two of them (agn, drop_stale) in their shared form, the state
# stacked over the replicas. tests/test_orbax.py restores every one of the 11 cases but
# the two axis twins from a mid-window checkpoint in a fresh process, through the same
# Orbax restore of the same state types; what this run adds, a SIGKILL while waiting
# or mid step and a restart from the newest complete checkpoint, does not depend on
# the transform's arithmetic, and every launch traces each case again. These 5 are
# among the cases test_orbax restores, so its fresh process finds their compiled steps
# in the XLA cache these launches share with it (`orbax_worker.compile_cache_dir`).
CASE_NAMES = (
    "conditional_accumulator",
    "sparse_conditional_accumulator",
    "agn_delta_shared",
    "cross_shard_optimizer_groups_sum",
    "drop_stale_gradients_shared",
)


def _run(scenarios: dict, trees: dict, i: int) -> dict:
    """Every case's step i."""
    out = {}
    for name, scenario in scenarios.items():
        params, state = scenario.step(i, trees[name]["params"], trees[name]["state"])
        out[name] = {"params": params, "state": state}
    return out


def _dump(path: pathlib.Path, trees: dict[str, Any]) -> None:
    path.write_bytes(pickle.dumps({name: orbax_worker.leaves(t) for name, t in trees.items()}))


def main(argv: list[str]) -> None:
    directory, results, total = pathlib.Path(argv[0]), pathlib.Path(argv[1]), int(argv[2])
    scenarios = {c.name: orbax_worker.from_case(c) for c in CASES if c.name in CASE_NAMES}

    def fresh() -> dict:
        pairs = {name: s.init() for name, s in scenarios.items()}
        return {name: {"params": p, "state": s} for name, (p, s) in pairs.items()}

    manager = _checkpoint.step_manager(directory)
    start, trees = _checkpoint.restore_latest(manager, fresh())
    if start is None:
        reference = fresh()
        for i in range(total):
            reference = _run(scenarios, reference, i)
        _dump(results / "reference.pkl", reference)
        start = 0
    print(f"restored {start}", flush=True)
    for i in range(start, total):
        trees = _run(scenarios, trees, i)
        _checkpoint.save(manager, i + 1, trees)
        print(f"saved {i + 1}", flush=True)
        if i + 1 < total and sys.stdin.readline().strip() != "go":
            raise SystemExit("stdin closed: stopping")
    manager.close()
    _dump(results / "final.pkl", trees)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
