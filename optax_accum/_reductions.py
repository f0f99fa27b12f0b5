"""How each leaf of an accumulator's window combines: "sum", "mean", "max" or "min".

The accumulators' `reduction` is one of the four names (any case) for every leaf, a
tree of them shaped like the params (or a prefix of that tree: `{"params": "mean",
"fp8_meta": "max"}`), or a function of a leaf's path (the key tuple
`jax.tree_util.tree_flatten_with_path` gives) returning one. `Reduction` checks it when
the transform is built and says, for a tree of params or gradients, what each leaf
takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from optax_accum.indexed_slices import IndexedSlices

NAMES = ("mean", "sum", "max", "min")
EXTREMA = ("max", "min")
_EXPECTED = (
    'reduction must be "mean", "sum", "max" or "min" (any case), a tree of them shaped '
    "like the params (or a prefix of it), or a function of a leaf's path returning one"
)


def _is_slices(x: Any) -> bool:
    return isinstance(x, IndexedSlices)


def _name(value: Any, where: str) -> str:
    if isinstance(value, str) and value.lower() in NAMES:
        return value.lower()
    raise ValueError(f"{_EXPECTED}; got {value!r}{where}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One leaf's reduction, and where the leaf is (for errors). Not a pytree node: a
    tree of choices is shaped like the params."""

    how: str
    where: str


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A checked `reduction` argument (see the module docstring)."""

    spec: Any  # a name, a tree of names, or a function of the path

    @classmethod
    def of(cls, reduction: Any) -> Reduction:
        """Checks `reduction` at construction: a name, a callable, or a non-empty tree
        whose leaves are names. Raises ValueError (TypeError for a bad leaf type)."""
        if callable(reduction) and not isinstance(reduction, str):
            return cls(reduction)
        if isinstance(reduction, str):
            return cls(_name(reduction, ""))
        leaves, _ = jax.tree_util.tree_flatten_with_path(reduction)
        if not leaves:
            raise ValueError(f"{_EXPECTED}; got {reduction!r}")
        for path, leaf in leaves:
            if not isinstance(leaf, str):
                raise TypeError(
                    f"{_EXPECTED}; got {leaf!r} ({type(leaf).__name__}) at "
                    f"reduction{jax.tree_util.keystr(path)}"
                )
            _name(leaf, f" at reduction{jax.tree_util.keystr(path)}")
        return cls(jax.tree.map(str.lower, reduction))

    @property
    def uniform(self) -> str | None:
        """The one name every leaf takes, or None when leaves may differ."""
        return self.spec if isinstance(self.spec, str) else None

    def choices(self, tree: Any, *, what: str = "params") -> list[Choice]:
        """Each leaf's `Choice`, in `tree`'s leaf order (`IndexedSlices` whole).

        Raises:
          ValueError: when a tree of names does not fit `tree` as a prefix, or a
            function returns something else than one of the names.
        """
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_slices)
        wheres = [f"{what}{jax.tree_util.keystr(path)}" for path, _ in flat]
        if isinstance(self.spec, str):
            return [Choice(self.spec, w) for w in wheres]
        if callable(self.spec):
            return [
                Choice(_name(self.spec(path), f" from reduction({path!r}) for {w}"), w)
                for (path, _), w in zip(flat, wheres, strict=True)
            ]
        prefix = jax.tree.structure(self.spec)
        try:
            subtrees = prefix.flatten_up_to(treedef.unflatten([0] * treedef.num_leaves))
        except ValueError as e:
            raise ValueError(
                f"reduction must be a tree shaped like the {what} (or a prefix of it): "
                f"got structure {prefix} for {what} of structure {treedef}"
            ) from e
        names = jax.tree.leaves(self.spec)
        hows = [
            name
            for name, sub in zip(names, subtrees, strict=True)
            for _ in range(len(jax.tree.leaves(sub)))
        ]
        return [Choice(h, w) for h, w in zip(hows, wheres, strict=True)]

    def tree(self, params: Any) -> Any:
        """`params`' tree with each leaf's `Choice` in its place."""
        treedef = jax.tree.structure(params, is_leaf=_is_slices)
        return treedef.unflatten(self.choices(params))

    def means(self) -> Callable[[Any], tuple[bool, ...]]:
        """The function the engine is given: whether each leaf of the gradient (in its
        leaf order) is released as a mean."""
        return lambda updates: tuple(c.how == "mean" for c in self.choices(updates, what="updates"))


__all__ = ["EXTREMA", "NAMES", "Choice", "Reduction"]
