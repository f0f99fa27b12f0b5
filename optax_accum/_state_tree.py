"""Finding an optax_accum state inside whatever state the user holds, and replacing it.

A user holds the state of a composed optimizer: an `optax.chain` tuple, an
`optax.inject_hyperparams` or `optax.MultiSteps` state, a dict of them, or the state
of a batch of optimizers made under `jax.vmap`. The accessors look through these
containers (tuples, NamedTuples, lists and dicts) for a node of a given type.
"""

from __future__ import annotations

from typing import Any


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _children(node: Any) -> list[tuple[Any, Any]]:
    """The (key, child) pairs of a container node that may hold a state."""
    if isinstance(node, dict):
        return list(node.items())
    if _is_namedtuple(node):
        return [(f, getattr(node, f)) for f in node._fields]
    if isinstance(node, list | tuple):
        return list(enumerate(node))
    return []


def locate(node: Any, types: type | tuple[type, ...]) -> tuple[tuple, Any] | None:
    """`(path, found)`: the outermost node of `node` that is an instance of `types`
    (breadth first) and the keys that lead to it; None if there is none."""
    frontier: list[tuple[tuple, Any]] = [((), node)]
    while frontier:
        nxt = []
        for path, n in frontier:
            if isinstance(n, types):
                return path, n
            nxt.extend(((*path, key), child) for key, child in _children(n))
        frontier = nxt
    return None


def find(node: Any, types: type | tuple[type, ...]) -> Any | None:
    """The outermost node of `node` that is an instance of `types` (breadth first), or
    None."""
    located = locate(node, types)
    return None if located is None else located[1]


def replace(node: Any, path: tuple, new: Any) -> Any:
    """`node` with the node at `path` (the keys `locate` gives) replaced by `new`."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(node, dict):
        return type(node)((k, replace(v, rest, new) if k == key else v) for k, v in node.items())
    if _is_namedtuple(node):
        return node._replace(**{key: replace(getattr(node, key), rest, new)})
    return type(node)(replace(v, rest, new) if i == key else v for i, v in enumerate(node))
