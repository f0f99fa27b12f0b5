"""What every benchmark hands the runner, and the report the runner writes.

A benchmark module registered in `benchmarks/__main__.py` exposes
`report_rows(scale: Scale) -> tuple[list[Row], dict]`: the figures worth a line of
the report, and every figure it measured (kept in `report.json` under `details`).
This module imports neither JAX nor optax_accum, so the runner can set XLA's flags
before anything else starts JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Progress = Callable[..., Iterable]


def no_progress(iterable: Iterable, desc: str = "", total: int | None = None) -> Iterable:
    return iterable


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a run: `quick` (tiny sizes, a smoke test), and whether the device is an
    accelerator (add the accelerator sizes). `progress(iterable, desc=...)` wraps the
    long loops of a benchmark in a progress bar."""

    quick: bool = False
    accelerator: bool = False
    progress: Progress = no_progress
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Row:
    """One figure: `value` in `unit` ("x" for a ratio), for `case` of `benchmark`.

    `target` is the figure's target, e.g. ">= 2.5" or "<= 1.2" ("" for none), and
    `met` whether `value` meets it (None without a target).
    """

    benchmark: str
    case: str
    figure: str
    value: float
    unit: str = "x"
    target: str = ""
    met: bool | None = None

    @classmethod
    def checked(
        cls, benchmark: str, case: str, figure: str, value: float, target: Any = None, **kw: Any
    ) -> Row:
        """A row with its target, given as `(bound, "min" | "max")` or None."""
        if target is None:
            return cls(benchmark, case, figure, float(value), **kw)
        bound, kind = target
        if kind not in ("min", "max"):
            raise ValueError(f"target kind must be 'min' or 'max', got {kind!r}")
        met = value >= bound if kind == "min" else value <= bound
        sign = ">=" if kind == "min" else "<="
        return cls(benchmark, case, figure, float(value), target=f"{sign} {bound:g}", met=met, **kw)


# --------------------------------------------------------------------------- the report


def machine(devices: Sequence[Any], jax_version: str, date: str) -> dict[str, Any]:
    """Where and when the figures were taken."""
    device = devices[0]
    return {
        "date": date,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "devices": len(devices),
        "jax": jax_version,
        "python": platform.python_version(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_at_start": os.getloadavg(),
    }


def _number(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text}x" if unit == "x" else f"{text} {unit}"


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table, one section per benchmark."""
    m = report["machine"]
    lines = [
        "# optax_accum benchmarks",
        "",
        f"- Device: {m['device_kind']} ({m['platform']}, {m['devices']} devices), "
        f"host {m['host']}, load average at start {m['load_average_at_start'][0]:.2f}",
        f"- jax {m['jax']}, Python {m['python']}; {m['date']}",
        f"- Command: `{report['command']}`"
        + (
            " (tiny sizes: no figure means anything, no target is judged)"
            if report["quick"]
            else ""
        ),
        "",
    ]
    for name, bench in report["benchmarks"].items():
        seconds = bench.get("seconds")
        lines += [f"## {name}", "", bench["question"], ""]
        if seconds is not None:
            lines += [f"Took {seconds:.0f} s.", ""]
        if bench.get("error"):
            lines += [f"**Failed:** `{bench['error']}`", ""]
            continue
        lines += ["| case | figure | value | target | |", "|---|---|---|---|---|"]
        for r in bench["rows"]:
            verdict = "" if r["met"] is None else ("met" if r["met"] else "**missed**")
            lines.append(
                f"| {r['case']} | {r['figure']} | {_number(r['value'], r['unit'])} "
                f"| {r['target']} | {verdict} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Every ratio (unit "x") of every benchmark as a bar from 1 to its value, one panel
    per benchmark, on a log scale, with its target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        name: [r for r in bench.get("rows", []) if r["unit"] == "x" and r["value"] > 0]
        for name, bench in report["benchmarks"].items()
    }
    panels = {k: v for k, v in panels.items() if v}
    heights = [max(1.2, 0.28 * len(rows) + 0.8) for rows in panels.values()] or [1.0]
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(11, sum(heights) + 1.0), height_ratios=heights, squeeze=False
    )
    for ax, (name, rows) in zip(axes[:, 0], panels.items(), strict=False):
        labels = [f"{r['case']}: {r['figure']}" for r in rows]
        colours = [
            "tab:gray" if r["met"] is None else ("tab:green" if r["met"] else "tab:red")
            for r in rows
        ]
        y = range(len(rows))
        values = [r["value"] for r in rows]
        ax.hlines(list(y), 1.0, values, colors=colours, lw=3)
        ax.scatter(values, list(y), c=colours, s=25, zorder=3)
        for i, r in enumerate(rows):
            if r["target"]:
                ax.plot([float(r["target"].split()[1])] * 2, [i - 0.4, i + 0.4], "k-", lw=2)
        ax.axvline(1.0, color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(True, axis="x", which="both", alpha=0.3)
    m = report["machine"]
    fig.suptitle(
        f"optax_accum benchmarks: {m['device_kind']} ({m['platform']}), jax {m['jax']}, "
        f"{m['date']}{' (quick: tiny sizes)' if report['quick'] else ''}\n"
        "ratios (bars from 1), log scale; green: target met, red: missed, grey: no target; "
        "black tick: the target",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict[str, Any], out: Path, png: bool = True) -> None:
    """`out/report.json`, `out/report.md` and (unless `png=False`) `out/report.png`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    if png:
        plot(report, out / "report.png")
