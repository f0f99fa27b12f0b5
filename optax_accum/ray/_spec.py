"""What an accumulator on Ray is (`Spec`) and how its actor was created (`Options`):
plain values that the handles and the actor compare, and that the checkpoint keeps.

NumPy and Python only, as all of the actor's side: the actor process never imports
JAX. A tree of gradients is described leaf by leaf (its dtypes, shapes and key paths,
and its structure as a string); the tree itself stays with the handles.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from optax_accum.host import _args

# The Ray namespace of named accumulators unless a handle names another: every
# driver of the cluster that joins without naming one reaches them.
NAMESPACE = "optax_accum"


class Leaf(NamedTuple):
    """One array of the accumulator: its dtype's name, its shape (None dims unknown,
    or None for any shape), and its key path in the tree ("" for a lone array)."""

    dtype: str
    shape: tuple | None
    path: str


class Spec(NamedTuple):
    """What an accumulator is; two handles under one `shared_name` must agree on it."""

    kind: str  # "dense" or "sparse"
    leaves: tuple[Leaf, ...]
    tree: str | None  # the tree's structure (str of its treedef); None: one array
    reduction_type: str
    skip_nonfinite: bool

    @property
    def class_name(self) -> str:
        return "ConditionalAccumulator" if self.kind == "dense" else "SparseConditionalAccumulator"

    def describe(self) -> str:
        if self.tree is None:
            leaf = self.leaves[0]
            what = f"dtype={leaf.dtype}, shape={_args.fmt(leaf.shape)}"
        else:
            parts = ", ".join(f"{x.path}: {x.dtype}{_args.fmt(x.shape)}" for x in self.leaves)
            what = f"tree={self.tree} ({parts})"
        return (
            f"{self.class_name}({what}, reduction_type={self.reduction_type}, "
            f"skip_nonfinite={self.skip_nonfinite})"
        )


class Options(NamedTuple):
    """How the actor was created: compared with what a later handle asks for."""

    shared_name: str | None
    namespace: str | None
    checkpoint_dir: str | None
    max_restarts: int
    lifetime: str  # "detached" (ended by kill()) or "owner" (ends with its creator)

    def differences(self, asked: dict[str, Any]) -> list[str]:
        """The options in `asked` (name -> value; None: not asked) that differ."""
        return [
            f"{name}={value!r} (the live accumulator's: {getattr(self, name)!r})"
            for name, value in asked.items()
            if value is not None and value != getattr(self, name)
        ]
