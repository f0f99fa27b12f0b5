"""The API docs: a Google-style docstring with a runnable example on every public name,
and a Sphinx build of the API reference that emits no warning.

The examples themselves run as doctests (pytest's --doctest-modules over optax_accum/).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
TF1_BLOCKS = [b for b in PYTHON_BLOCKS if b.startswith("# TF1")]
EXAMPLES = [b for b in PYTHON_BLOCKS if not b.startswith("# TF1")]  # runnable
COLAB_URL = "https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/"
TF_ORIGINALS = (
    "tf.ConditionalAccumulator",
    "tf.sparse.SparseConditionalAccumulator",
    "tf.tpu.CrossShardOptimizer",
    "tf.contrib.opt.DropStaleGradientOptimizer",
    "tf.contrib.opt.AGNOptimizer",
)


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


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_python_example_runs(index):
    # As a user runs it: standard dtype promotion, a fresh namespace.
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})


def test_readme_pairs_each_tf_original_with_optax_accum_code():
    tf_blocks = [
        b for b in re.findall(r"```python\n(.*?)```", README, re.S) if b.startswith("# TF1")
    ]
    for name in TF_ORIGINALS:
        assert any(name in block for block in tf_blocks), name


def test_readme_links_every_notebook_with_its_colab_badge():
    notebooks = sorted((ROOT / "colab").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        assert f"](colab/{path.name})" in README, path.name
        assert (
            f"colab.research.google.com/github/optax-accum/optax_accum/blob/main/colab/{path.name}"
            in README
        )
    for target in re.findall(r"\]\((?!https?://)([^)#]+)\)", README):
        assert (ROOT / target).exists(), target
