"""`python -m optax_accum.demo`: --help, argument checks, the device and extra checks,
every registered section at a small size, the results table (at most 100 columns,
with a legend) and the PNG of the accuracy curves.

One test starts a real `python -m optax_accum.demo` process (too few devices: JAX's
device count is fixed when it starts); the rest run in this process, where the
sections' compiled steps are shared: the command line through `runpy`, as
`python -m` runs it, --help and the missing-extra message through `demo.main`. A
process each would only add seconds of importing JAX (and compiling accumulate again).
"""

from __future__ import annotations

import ast
import os
import pathlib
import runpy
import subprocess
import sys

import jax
import pytest

from optax_accum import demo

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["--steps", "12", "--batch", "8"]
HEAD = ["method", "acc.", "updates", "dropped", "all-red.", "s"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run_module(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optax_accum.demo", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _blocks(printed: str) -> dict[str, list[str]]:
    """The table's rows per block: the lines under each `[section] ...` heading's header,
    keyed by the heading."""
    blocks, current = {}, None
    for line in printed.splitlines():
        if line.startswith("[") and "]" in line:
            current = line
            blocks[current] = []
        elif current is not None and line.split() == HEAD:
            continue
        elif current is not None and line.startswith("  ") and line.strip():
            blocks[current].append(line)
        else:
            current = None
    return blocks


def _section_rows(printed: str, section: str) -> list[str]:
    """The table's rows of every block of `section`, in order."""
    blocks = _blocks(printed)
    return [row for head in blocks if head.startswith(f"[{section}]") for row in blocks[head]]


def test_help_lists_every_section_and_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m optax_accum.demo")
    for flag in ("--section", "--steps", "--batch", "--seed", "--plot"):
        assert flag in out
    for name in demo.SECTIONS:
        assert name in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-3"], "argument --steps: expected a positive integer, got -3"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--batch", "0"], "argument --batch: expected a positive integer, got 0"),
        (["--batch", "two"], "argument --batch: expected a positive integer, got 'two'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
        (["--section", "no_such_section"], "argument --section: invalid choice"),
    ],
)
def test_bad_arguments_get_a_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m optax_accum.demo")
    assert message in err


def test_command_line_runs_one_section_prints_the_table_and_saves_the_plot(
    tmp_path, monkeypatch, capsys
):
    # `python -m optax_accum.demo ...` in this process: runpy runs the package's
    # __main__ as `python -m` does (test_fewer_devices_... starts a real process). The
    # batch is the comparison test's, so its compiled steps serve here too; a
    # user's session has standard dtype promotion.
    argv = ["--section", "accumulate", "--steps", "4", "--batch", "8"]
    monkeypatch.setattr(sys, "argv", ["python -m optax_accum.demo", *argv])
    monkeypatch.chdir(tmp_path)
    with jax.numpy_dtype_promotion("standard"):
        runpy.run_module("optax_accum.demo", run_name="__main__", alter_sys=True)
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert list(_blocks(stdout)) == [
        "[accumulate] mild staleness: 4 workers (one 6x slower), Adam lr 3e-3",
        "[accumulate] heavy staleness: 16 workers (one 6x slower), Adam lr 3e-2",
    ]
    for rows in _blocks(stdout).values():
        rows = [row.strip().rsplit(None, 5) for row in rows]
        assert [r[0] for r in rows] == [
            "async adam, every gradient",
            "MultiSteps(adam, 3), every gradient",
            "conditional_accumulator(adam, 3)",
        ]
        for _, accuracy, _, _, all_reduces, seconds in rows:
            assert 0.0 <= float(accuracy) <= 1.0 and float(seconds) >= 0  # 0.0: compiled
            assert all_reduces == "-"  # one device
        (_, _, *adam), (_, _, *multi), (_, _, *acc) = [(*r[:2], int(r[2]), int(r[3])) for r in rows]
        assert adam == [4, 0] and multi == [1, 0]  # 4 gradients: 4 updates; 1 of 3, 1 pending
        assert 0 <= 4 - acc[1] - 3 * acc[0] <= 2  # fresh gradients, 3 per update, 0-2 pending
    for word in ("acc.", "updates", "dropped", "all-red.", "s ", "mild", "heavy"):  # legend
        assert any(line.startswith(word) for line in lines), word
    plot = tmp_path / "optax_accum_demo.png"
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert f"saved to {plot.name}" in stdout


def test_fewer_devices_than_a_section_needs_is_explained_not_run():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = _run_module("--section", "data_parallel", "--steps", "2", env=env)
    assert proc.returncode == 1
    assert "section data_parallel needs 8 devices, but JAX sees 2 (cpu)" in proc.stderr
    assert "JAX_PLATFORMS=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "[data_parallel]" not in proc.stdout  # no table row


def test_missing_extra_names_the_install_command(monkeypatch):
    # As if scikit-learn were not installed: an import of it fails. main exits with the
    # message (SystemExit with a string: Python prints it, no traceback, and exits 1)
    # before any section runs.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(SystemExit) as exit_info:
        demo.main([])
    message = exit_info.value.code
    assert isinstance(message, str)
    assert "optax_accum.demo needs scikit-learn" in message
    assert 'pip install "optax-accum[demo]"' in message


def _module_level_imports(tree: ast.Module) -> set[str]:
    """The top-level packages a module imports when it runs: its statements, and those
    under a module-level `if` or `try`, but not inside functions (imported on call)."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return found


def test_the_package_and_its_entry_point_import_none_of_the_extra():
    # What `python -m optax_accum.demo` runs before main's check, without the extra:
    # the package's __init__ and __main__ must not import it at module level.
    for name in ("__init__.py", "__main__.py"):
        tree = ast.parse((ROOT / "optax_accum" / "demo" / name).read_text())
        imported = _module_level_imports(tree)
        assert "optax_accum" in imported or name == "__init__.py"  # the walk sees imports
        assert not imported & set(demo.EXTRA), (name, imported & set(demo.EXTRA))


def test_table_is_at_most_100_columns_and_a_too_long_method_is_an_error():
    row = demo.Row("accumulate", "m", 0.5, 1, 0, None, 1.0)
    assert max(len(line) for line in demo.format_table([row]).splitlines()) <= 100
    with pytest.raises(ValueError, match="wider than 100 columns"):
        demo.format_table([demo.Row("accumulate", "m" * 80, 0.5, 1, 0, None, 1.0)])


def _run_section(name: str, sizes: list[str], capsys, tmp_path) -> list:
    """`demo.main` on one section, as users run it (the suite's strict dtype promotion
    is for the library's own code; optax's optimizers need standard promotion): checks
    every returned row, the printed table (at most 100 columns, a line per row) and the
    plot, and returns the rows."""
    plot = tmp_path / "curves.png"
    with jax.numpy_dtype_promotion("standard"):
        rows = demo.main(["--section", name, *sizes, "--plot", str(plot)])
    assert rows
    for row in rows:
        assert row.section == name and row.method
        assert 0.0 <= row.accuracy <= 1.0
        assert row.updates >= 0 and row.dropped >= 0
        assert row.seconds > 0
        assert row.curve and row.curve[-1][1] == row.accuracy
        assert all(0.0 <= acc <= 1.0 for _, acc in row.curve)
    printed = capsys.readouterr().out
    table = printed.split("\naccuracy curves saved to")[0]
    assert max(len(line) for line in table.splitlines()) <= 100
    lines = _section_rows(printed, name)
    assert len(lines) == len(rows)
    for row, line in zip(rows, lines, strict=True):
        assert line.strip().startswith(row.method)
        assert f"{row.accuracy:.3f}" in line
    assert plot.read_bytes().startswith(PNG_MAGIC)
    return rows


# accumulate runs through `demo.main` in the comparison test below, at its larger size:
# running it here as well would compile the section once more for no new path.
@pytest.mark.parametrize("name", [n for n in demo.SECTIONS if n != "accumulate"])
def test_section_runs_at_a_small_size(name, capsys, tmp_path):
    _run_section(name, SMALL, capsys, tmp_path)


def _mean_gap(order: list[int]) -> float:
    """Gradients delivered between a worker's pull and its delivery, on average: how many
    updates old async Adam's gradients are."""
    last, gaps = {}, []
    for i, w in enumerate(order):
        gaps.append(i - last.get(w, 0))
        last[w] = i + 1
    return sum(gaps) / len(gaps)


def test_arrival_order_has_a_straggler_and_more_workers_make_staler_gradients():
    from optax_accum.demo import accumulate

    steps = 300
    for regime in accumulate.REGIMES:
        order = accumulate.arrival_order(
            steps, seed=0, workers=regime.workers, slowdown=regime.slowdown
        )
        assert len(order) == steps and set(order) == set(range(regime.workers))
        assert order.count(0) < steps / regime.workers  # worker 0 straggles
    mild, heavy = (
        _mean_gap(accumulate.arrival_order(steps, 0, workers=r.workers, slowdown=r.slowdown))
        for r in (accumulate.MILD, accumulate.HEAVY)
    )
    assert 2 < mild < 4 and 12 < heavy < 16  # the module's docstring says 3 and 14


def test_accumulate_compares_three_learners_on_one_stale_stream_in_two_regimes(capsys, tmp_path):
    # The same delivered gradients for every learner of a regime; plain Adam applies
    # each, MultiSteps one update per 3, the accumulator drops the stale ones and applies
    # one update per 3 fresh ones. Every curve has the same x axis. Run through
    # `demo.main`, so this is also accumulate's small-size section run (rows, table, plot).
    from optax_accum.demo import accumulate

    steps = 40
    rows = _run_section("accumulate", ["--steps", str(steps), "--batch", "8"], capsys, tmp_path)
    assert [r.panel for r in rows] == [r.label for r in accumulate.REGIMES for _ in range(3)]
    assert rows[0].panel == "mild staleness: 4 workers (one 6x slower), Adam lr 3e-3"
    assert rows[3].panel == "heavy staleness: 16 workers (one 6x slower), Adam lr 3e-2"
    for adam, multi, acc in (rows[:3], rows[3:]):
        assert "adam" in adam.method and "MultiSteps" in multi.method
        assert acc.method == "conditional_accumulator(adam, 3)"
        assert (adam.updates, adam.dropped) == (steps, 0)
        assert (multi.updates, multi.dropped) == (steps // 3, 0)
        assert acc.dropped > 0  # gradients computed before the last release are stale
        assert 0 <= steps - acc.dropped - 3 * acc.updates <= 2
    assert len({tuple(s for s, _ in r.curve) for r in rows}) == 1
    assert rows[5].dropped > rows[2].dropped  # more workers: more stale gradients


def test_a_section_split_in_panels_prints_a_block_for_each():
    rows = [
        demo.Row("accumulate", "a", 0.5, 1, 0, panel="first panel"),
        demo.Row("accumulate", "b", 0.5, 1, 0, panel="second panel"),
        demo.Row("agn", "c", 0.5, 1, 0),
    ]
    assert list(_blocks(demo.format_table(rows))) == [
        "[accumulate] first panel",
        "[accumulate] second panel",
        f"[agn] {demo.TITLES['agn']}",
    ]
