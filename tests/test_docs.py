"""The API docs: a Google-style docstring with a runnable example on every public name,
and a Sphinx build of the API reference that emits no warning.

The examples themselves run as doctests (pytest's --doctest-modules over optax_accum/).
"""

from __future__ import annotations

import inspect
import pathlib
import subprocess
import sys

import pytest

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_all_names_exist():
    missing = [name for name in optax_accum.__all__ if not hasattr(optax_accum, name)]
    assert not missing


@pytest.mark.parametrize("name", optax_accum.__all__)
def test_public_name_has_a_docstring_with_a_runnable_example(name):
    doc = inspect.getdoc(getattr(optax_accum, name)) or ""
    summary = doc.splitlines()[0] if doc else ""
    assert summary.strip(), f"{name} has no docstring"
    assert "\nExample" in doc, f"{name}'s docstring has no Example: section"
    example = doc.split("\nExample", 1)[1]
    assert ">>> " in example, f"{name}'s Example: section has no doctest"


def test_sphinx_builds_the_api_reference_without_warnings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    api = (tmp_path / "api.html").read_text()
    undocumented = [n for n in optax_accum.__all__ if f'id="optax_accum.{n}"' not in api]
    assert not undocumented
