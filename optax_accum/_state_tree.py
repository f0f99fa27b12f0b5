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


def _children(node: Any) -> list[Any]:
    """The children of a container node that may hold a state."""
    if isinstance(node, dict):
        return list(node.values())
    if _is_namedtuple(node):
        return [getattr(node, f) for f in node._fields]
    if isinstance(node, list | tuple):
        return list(node)
    return []


def find(node: Any, types: type | tuple[type, ...]) -> Any | None:
    """The outermost node of `node` that is an instance of `types` (breadth first), or
    None."""
    frontier = [node]
    while frontier:
        nxt = []
        for n in frontier:
            if isinstance(n, types):
                return n
            nxt.extend(_children(n))
        frontier = nxt
    return None


def replace(node: Any, target: Any, new: Any) -> Any:
    """`node` with the object `target` (found by identity) replaced by `new`."""
    if node is target:
        return new
    if isinstance(node, dict):
        return type(node)((k, replace(v, target, new)) for k, v in node.items())
    if _is_namedtuple(node):
        return node._replace(**{f: replace(getattr(node, f), target, new) for f in node._fields})
    if isinstance(node, list | tuple):
        return type(node)(replace(v, target, new) for v in node)
    return node
