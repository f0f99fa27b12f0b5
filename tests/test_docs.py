"""The docs: a Google-style docstring with a runnable example on every public name; a
Sphinx build of docs/ (guide, semantics, versions, design notes, porting, and an API reference
that lists exactly `optax_accum.__all__`) without warnings;
every Python block of the README and of docs/*.md runs and prints what its comment
says; every link resolves to a file here or to an address confirmed to exist.

The docstring examples themselves run as doctests (pytest's --doctest-modules).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import pathlib
import re
import tomllib
import warnings

import jax
import pytest

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (page, i, block)
    for page in PAGES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
    if not block.startswith("# TF1")  # TensorFlow, shown for comparison
]
TF_ORIGINALS = (
    "tf.ConditionalAccumulator",
    "tf.sparse.SparseConditionalAccumulator",
    "tf.tpu.CrossShardOptimizer",
    "tf.contrib.opt.DropStaleGradientOptimizer",
    "tf.contrib.opt.AGNOptimizer",
)
# Every absolute address the docs, the metadata and the notebooks may link to, each
# confirmed to exist. Add one here only after confirming it.
CONFIRMED = {
    "https://github.com/google-deepmind/optax",
    "https://docs.jax.dev/en/latest/installation.html",
    "https://github.com/astral-sh/uv",  # the README's installer
    "http://www.apache.org/licenses/",  # LICENSE
    "http://www.apache.org/licenses/LICENSE-2.0",  # LICENSE
}


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


def test_sphinx_builds_the_docs_without_warnings(tmp_path, capsys):
    # `python -m sphinx -W -q -b html docs OUT`, run in this process: the same build,
    # without a second interpreter importing JAX for autodoc. -W fails on Sphinx's
    # warnings; Python's own (deprecations inside Sphinx and its extensions) are ignored,
    # as the command line would only print them.
    from sphinx.cmd.build import build_main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = build_main(["-W", "-q", "-b", "html", str(ROOT / "docs"), str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-4000:]
    api = (tmp_path / "api.html").read_text()
    documented = re.findall(r'id="optax_accum\.(\w+)"', api)  # top level: methods have a dot
    assert sorted(documented) == sorted(optax_accum.__all__)  # every name once, nothing else
    for page in ("guide", "semantics", "versions", "design", "porting"):
        assert (tmp_path / f"{page}.html").exists(), page


def _expected_output(block: str) -> str | None:
    """The comment on the block's last `print(...)` line, if it has one."""
    prints = [line for line in block.splitlines() if line.startswith("print(")]
    if not prints or "  # " not in prints[-1]:
        return None
    return prints[-1].rsplit("  # ", 1)[1]


@pytest.mark.parametrize(
    ("page", "index", "block"), BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS]
)
def test_python_block_runs_and_prints_what_it_says(page, index, block, request):
    # As a user runs it: standard dtype promotion, a fresh namespace (a script's: Ray
    # sends the functions it defines by value). The test session has 8 simulated CPU
    # devices, as the multi-device blocks ask, and a Ray cluster for the Ray blocks.
    if "import ray" in block or "optax_accum.ray" in block:
        request.getfixturevalue("ray_cluster")
    out = io.StringIO()
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(out):
        exec(compile(block, f"{page.name} python block {index}", "exec"), {"__name__": "__main__"})
    expected = _expected_output(block)
    if expected is not None:
        printed = out.getvalue().strip().splitlines()[-1]
        assert " ".join(printed.replace("[", " [ ").replace("]", " ] ").split()) == " ".join(
            expected.replace("[", " [ ").replace("]", " ] ").split()
        ), f"{page.name} block {index}: printed {printed!r}, its comment says {expected!r}"


def test_readme_keeps_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme
    demo = ci.replace('".[test]"', '".[demo]"').split(" && .venv/bin/python -m pytest")[0]
    assert f"{demo} && .venv/bin/python -m optax_accum.demo" in readme


def test_guide_pairs_each_tf_original_with_optax_accum_code():
    tf_blocks = [
        b
        for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs/guide.md").read_text(), re.S)
        if b.startswith("# TF1")
    ]
    for name in TF_ORIGINALS:
        assert any(name in block for block in tf_blocks), name
        assert name in (ROOT / "README.md").read_text(), name  # the migration table


def _addresses(text: str) -> set[str]:
    return {u.rstrip(".,;") for u in re.findall(r"https?://[^\s)\]\"'>`]+", text)}


def test_every_link_resolves_or_is_confirmed():
    texts = {p: p.read_text() for p in [*PAGES, ROOT / "pyproject.toml", ROOT / "LICENSE"]}
    texts |= {p: p.read_text() for p in (ROOT / "colab").glob("*.ipynb")}
    texts |= {p: p.read_text() for p in (ROOT / "colab").glob("*.py")}  # their sources
    for path, text in texts.items():
        unconfirmed = _addresses(text) - CONFIRMED
        assert not unconfirmed, f"{path.name}: {sorted(unconfirmed)}"
    for page in PAGES:
        for target in re.findall(r"\]\((?!https?://)([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_public_address_lives_in_one_place():
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    for path in [*PAGES, *(ROOT / "colab").glob("*.ipynb"), *(ROOT / "colab").glob("*.py")]:
        text = path.read_text()
        assert "optax-accum/optax_accum" not in text, path.name
        if "Repository" not in urls:  # not known yet: no link to it anywhere
            assert "colab.research.google.com/github" not in text, path.name
            assert "git+https://" not in text, path.name
