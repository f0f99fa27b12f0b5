"""Orbax helpers shared by the checkpoint suites (tests/test_orbax.py, test_preemption.py).

A restore needs a target with the fresh process's own shapes, dtypes and shardings, and
a training loop that checkpoints every step needs a manager that writes atomically
(a checkpoint cut short by a kill is never picked up as the latest).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
    """`jax.ShapeDtypeStruct`s (with shardings) of `tree`'s arrays: an Orbax restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def step_manager(directory: pathlib.Path, *, keep: int = 2) -> ocp.CheckpointManager:
    """A synchronous manager keeping the `keep` newest step checkpoints under `directory`."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def save(manager: ocp.CheckpointManager, step: int, tree: Any) -> None:
    """Saves `tree` as checkpoint `step` and returns once it is complete on disk."""
    manager.save(step, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, like: Any) -> tuple[int | None, Any]:
    """(step, tree) of the newest complete checkpoint, restored into `like`'s layout;
    (None, like) when there is none."""
    step = manager.latest_step()
    if step is None:
        return None, like
    return step, manager.restore(step, args=ocp.args.StandardRestore(abstract_like(like)))
