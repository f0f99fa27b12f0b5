"""Test matrices that stay small: `pairwise` picks the combinations of parametrized
factors that a test runs when every combination would cost a compile each."""

from __future__ import annotations

import itertools


def pairwise(*factors: list) -> list[tuple]:
    """Combinations of `factors` that hold every pair of values of any two factors at
    least once: all of them for two factors, far fewer than the full product for three
    or more (where a test's cost is one compile per combination). Deterministic: the
    first factor's values in order, each completed greedily by the values that cover the
    most pairs not yet covered, ties to the earlier value."""

    def pairs(combo: tuple) -> set:
        return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(combo), 2)}

    wanted = set()
    for (i, f), (j, g) in itertools.combinations(enumerate(factors), 2):
        wanted |= {(i, a, j, b) for a in f for b in g}
    chosen: list[tuple] = []
    while wanted:
        best = max(
            itertools.product(*factors),
            key=lambda combo: (len(pairs(combo) & wanted), -len(chosen)),
        )
        chosen.append(best)
        wanted -= pairs(best)
    return chosen
