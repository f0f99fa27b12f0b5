"""`python -m optax_accum.demo`: --help, every registered section at a small size, and
the results table (method, accuracy, updates applied, gradients dropped, collectives,
time)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import pytest

from optax_accum import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--steps", "12", "--batch", "8"]
COLUMNS = ("section", "method", "accuracy", "updates", "dropped", "collectives", "time")


def _run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optax_accum.demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _table(printed: str) -> list[str]:
    """The table's lines: from the header (the last line naming every column) on."""
    lines = printed.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.split()[:3] == list(COLUMNS[:3])]
    return lines[start:]


def test_help_lists_every_section_and_the_size_flags():
    proc = _run_module("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--section", "--steps", "--batch", "--seed"):
        assert flag in proc.stdout
    for name in demo.SECTIONS:
        assert name in proc.stdout


def test_command_line_runs_one_section_and_prints_the_table():
    proc = _run_module("--section", "accumulate", "--steps", "4", "--batch", "4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    head, rule, *rows = _table(proc.stdout)
    assert all(column in head for column in COLUMNS)
    assert set(rule.replace(" ", "")) == {"-"}
    assert rows and all(row.startswith("accumulate") for row in rows)


def test_an_unknown_section_is_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--section", "no_such_section"])
    assert exit_info.value.code == 2
    assert "no_such_section" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(demo.SECTIONS))
def test_section_runs_at_a_small_size(name, capsys):
    # As users run it: the suite's strict dtype promotion is for the library's own
    # code, and optax's optimizers need standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        rows = demo.main(["--section", name, *SMALL])
    assert rows
    for row in rows:
        assert row.section == name and row.method
        assert 0.0 <= row.accuracy <= 1.0
        assert row.updates >= 0 and row.dropped >= 0
        assert row.seconds > 0
    head, _, *lines = _table(capsys.readouterr().out)
    assert all(column in head for column in COLUMNS)
    assert len(lines) == len(rows)
    for row, line in zip(rows, lines, strict=True):
        assert line.split()[0] == name and row.method in line
