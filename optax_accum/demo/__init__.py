"""`python -m optax_accum.demo`: each behaviour of optax_accum on scikit-learn's digits.

Every section trains a small model and returns `Row`s; `main` runs the chosen
sections, prints one results table with a legend, and saves the test-accuracy curves
as a PNG. A section lives in its own module of this package and is registered in
`SECTIONS` (name -> ("module:function", devices it needs)), where the function takes a
`Sizes` and returns a list of `Row`. It needs the `[demo]` extra:
`pip install "optax-accum[demo]"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import time
from collections.abc import Sequence

SECTIONS: dict[str, tuple[str, int]] = {
    "accumulate": ("optax_accum.demo.accumulate:run", 1),
    "agn": ("optax_accum.demo.agn:run", 1),
    "data_parallel": ("optax_accum.demo.data_parallel:run", 8),
    "sparse": ("optax_accum.demo.sparse:run", 1),
}

TITLES = {
    "accumulate": "stale workers: conditional_accumulator against MultiSteps and async Adam",
    "agn": "agn (local SGD) against synchronous SGD: 8 workers, one shard of digits each",
    "data_parallel": "data parallelism on 8 devices, backup workers, asynchronous workers",
    "sparse": "sparse_conditional_accumulator: an embedding-bag model's row-sparse gradients",
}

# What the [demo] extra brings: import name -> distribution name.
EXTRA = {"sklearn": "scikit-learn", "flax": "flax", "matplotlib": "matplotlib", "tqdm": "tqdm"}
INSTALL = 'pip install "optax-accum[demo]"'
WIDTH = 100  # the table fits in this many columns
# The x axis of a section's panel, where it is not one training step per point.
XLABELS = {
    "accumulate": "gradients delivered (the same stream for every learner)",
    "agn": "local step of each worker",
}

LEGEND = """\
acc.      test accuracy of the trained model (AGN: the centre) on 360 held-out digits
updates   updates the optimizer applied (TF's global step; AGN: communication rounds)
dropped   gradients dropped as stale (sparse: or rejected for overflowing `capacity`)
all-red.  all-reduces (AGN: syncs) in the whole run; "-": one device, none needed
s         wall-clock seconds of the run, compilation included
mild      [accumulate] 4 workers, small Adam steps: a stale gradient still points downhill
heavy     [accumulate] 16 workers, 10x the step: a stale gradient undoes progress"""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Knobs every section reads, set by `--steps`, `--batch` and `--seed`."""

    steps: int = 300
    batch: int = 32
    seed: int = 0


@dataclasses.dataclass
class Row:
    """One line of the results table, and the run's test-accuracy curve.

    `curve` is a list of `(step, accuracy)` pairs; `all_reduces` is None for a run
    on one device. `panel` splits a section: its rows with the same `panel` share a
    block of the table and a panel of the plot, headed by it instead of the section's
    title. `moved`, where a section records it, is a list of `(step, bytes)` pairs, the
    bytes sent so far, drawn on a second axis of the panel.
    """

    section: str
    method: str
    accuracy: float
    updates: int
    dropped: int
    all_reduces: int | None = None
    seconds: float = 0.0
    curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    panel: str = ""
    moved: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _heading(row: Row) -> str:
    """`[section] title`, the heading of the row's block in the table and its plot panel."""
    return f"[{row.section}] {row.panel or TITLES.get(row.section, '')}".rstrip()


def format_table(rows: Sequence[Row]) -> str:
    """The results as text: one block per section, then the legend.

    Raises:
      ValueError: when a line would be wider than `WIDTH` columns (a method name
        too long for the table).
    """
    head = ("method", "acc.", "updates", "dropped", "all-red.", "s")

    def cells(r: Row) -> tuple[str, ...]:
        reduces = "-" if r.all_reduces is None else str(r.all_reduces)
        return (r.method, f"{r.accuracy:.3f}", str(r.updates), str(r.dropped), reduces,
                f"{r.seconds:.1f}")  # fmt: skip

    body = [cells(r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def line(c: Sequence[str]) -> str:
        first = c[0].ljust(widths[0])
        rest = (x.rjust(w) for x, w in zip(c[1:], widths[1:], strict=True))
        return "  " + "  ".join([first, *rest])

    out: list[str] = []
    for heading in dict.fromkeys(_heading(r) for r in rows):
        out += ["", heading, line(head)]
        out += [line(cells(r)) for r in rows if _heading(r) == heading]
    out += ["", *LEGEND.splitlines()]
    too_wide = [x for x in out if len(x) > WIDTH]
    if too_wide:
        raise ValueError(f"results table wider than {WIDTH} columns: {too_wide[0]!r}")
    return "\n".join(out)


def save_plot(rows: Sequence[Row], path: str) -> None:
    """Saves every row's test-accuracy curve as a PNG, one panel per section (and per
    `Row.panel` within a section)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.section, _heading(r)) for r in rows if r.curve))
    if not panels:
        raise ValueError("no section recorded a curve to plot")
    cols = min(2, len(panels))
    rows_ = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(6.5 * cols, 4.2 * rows_), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (section, heading) in zip(axes.flat, panels, strict=False):
        moved = ax.twinx() if any(r.moved for r in rows if _heading(r) == heading) else None
        for r in rows:
            if _heading(r) == heading and r.curve:
                steps, accuracy = zip(*r.curve, strict=True)
                (line,) = ax.plot(steps, accuracy, label=r.method, linewidth=1.3)
                if moved is not None and r.moved:
                    steps, sent = zip(*r.moved, strict=True)
                    moved.plot(steps, sent, color=line.get_color(), linestyle=":", linewidth=1)
        if moved is not None:
            moved.set_yscale("log")
            moved.set_ylabel("bytes sent by each worker (dotted)")
        ax.set_title(heading, fontsize=9)
        ax.set_xlabel(XLABELS.get(section, "training step"))
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.0, 1.0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_section(name: str, sizes: Sizes) -> list[Row]:
    """Imports and runs one registered section, timing it."""
    module, func = SECTIONS[name][0].split(":")
    start = time.perf_counter()
    rows = getattr(importlib.import_module(module), func)(sizes)
    elapsed = time.perf_counter() - start
    for r in rows:
        if not r.seconds:
            r.seconds = elapsed / len(rows)
    return rows


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def missing_extra() -> list[str]:
    """The distributions of the `[demo]` extra that cannot be imported."""
    missing = []
    for module, dist in EXTRA.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    return missing


def _device_problem(names: Sequence[str]) -> str | None:
    """Why the chosen sections cannot run on the devices JAX sees, or None."""
    import jax

    found = jax.device_count()
    short = [n for n in names if SECTIONS[n][1] > found]
    if not short:
        return None
    platform = jax.devices()[0].platform
    need = max(SECTIONS[n][1] for n in short)
    others = [n for n in names if n not in short]
    leave_out = " ".join(f"--section {n}" for n in others) or "--section accumulate"
    return (
        f"section {', '.join(short)} needs {need} devices, but JAX sees {found} "
        f"({platform}). Run `python -m optax_accum.demo`, which simulates {need} CPU "
        f"devices when JAX starts on the CPU; on a machine with fewer GPUs or TPU cores, "
        f"run it with JAX_PLATFORMS=cpu, or run only the other sections: {leave_out}"
    )


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Parses the command line, runs the sections, prints the table, saves the plot."""
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
    parser.add_argument(
        "--steps", type=_positive_int, default=Sizes.steps, help="training steps (>= 1)"
    )
    parser.add_argument(
        "--batch", type=_positive_int, default=Sizes.batch, help="examples per gradient (>= 1)"
    )
    parser.add_argument("--seed", type=_non_negative_int, default=Sizes.seed, help="random seed")
    parser.add_argument(
        "--plot",
        default="optax_accum_demo.png",
        metavar="PATH",
        help="where to save the accuracy curves as a PNG (default: %(default)s); '' for none",
    )
    args = parser.parse_args(argv)
    missing = missing_extra()
    if missing:
        raise SystemExit(
            f"optax_accum.demo needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL}"
        )
    names = args.section or list(SECTIONS)
    problem = _device_problem(names)
    if problem:
        raise SystemExit(problem)
    sizes = Sizes(steps=args.steps, batch=args.batch, seed=args.seed)
    rows: list[Row] = []
    for name in names:
        rows.extend(run_section(name, sizes))
    print(format_table(rows))
    if args.plot:
        save_plot(rows, args.plot)
        print(f"\naccuracy curves saved to {args.plot}")
    return rows
