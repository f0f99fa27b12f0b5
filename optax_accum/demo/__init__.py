"""`python -m optax_accum.demo`: each behaviour of optax_accum on scikit-learn's digits.

Every section trains a small model and returns `Row`s; `main` runs the chosen
sections and prints one results table. A section lives in its own module of this
package and is registered in `SECTIONS` (name -> "module:function"), where the function
takes a `Sizes` and returns a list of `Row`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from collections.abc import Sequence

SECTIONS: dict[str, str] = {
    "accumulate": "optax_accum.demo.accumulate:run",
    "agn": "optax_accum.demo.agn:run",
    "data_parallel": "optax_accum.demo.data_parallel:run",
    "sparse": "optax_accum.demo.sparse:run",
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Knobs every section reads, set by `--steps`, `--batch` and `--seed`."""

    steps: int = 300
    batch: int = 32
    seed: int = 0


@dataclasses.dataclass
class Row:
    """One line of the results table."""

    section: str
    method: str
    accuracy: float
    updates: int
    dropped: int
    collectives: str = "-"
    seconds: float = 0.0


def format_table(rows: Sequence[Row]) -> str:
    """The results table as aligned text."""
    head = ("section", "method", "accuracy", "updates", "dropped", "collectives", "time (s)")
    body = [
        (
            r.section,
            r.method,
            f"{r.accuracy:.3f}",
            str(r.updates),
            str(r.dropped),
            r.collectives,
            f"{r.seconds:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *map(line, body)])


def run_section(name: str, sizes: Sizes) -> list[Row]:
    """Imports and runs one registered section, timing it."""
    module, func = SECTIONS[name].split(":")
    start = time.perf_counter()
    rows = getattr(importlib.import_module(module), func)(sizes)
    elapsed = time.perf_counter() - start
    for r in rows:
        if not r.seconds:
            r.seconds = elapsed / len(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Parses the command line, runs the sections, prints the table."""
    parser = argparse.ArgumentParser(
        prog="python -m optax_accum.demo",
        description="optax_accum's behaviours, each training a small model on digits.",
    )
    parser.add_argument(
        "--section",
        action="append",
        choices=sorted(SECTIONS),
        help="run only this section (repeatable); default: all",
    )
    parser.add_argument("--steps", type=int, default=Sizes.steps, help="training steps")
    parser.add_argument("--batch", type=int, default=Sizes.batch, help="examples per gradient")
    parser.add_argument("--seed", type=int, default=Sizes.seed, help="random seed")
    args = parser.parse_args(argv)
    sizes = Sizes(steps=args.steps, batch=args.batch, seed=args.seed)
    rows: list[Row] = []
    for name in args.section or list(SECTIONS):
        rows.extend(run_section(name, sizes))
    print()
    print(format_table(rows))
    return rows
