"""docs/porting.md: every worked port runs, at the small size the page gives, and
prints what its comments say; each port shows the lines it replaces.

A port is a `## ` section of the page. Its optax_accum blocks (fenced as ```python
port) run in order in one fresh namespace, as a user pasting them one after another
would; its TF1 blocks (fenced as ```python tf1) are shown, never run. A port from
optax instead shows a JAX program (```python before, with `optax.MultiSteps`) and the
same program ported (```python after): both run, in page order among the port blocks,
and the two differ in at most ten lines. The ports assert their own claims
(equalities against one device, a float64 NumPy reference or the program before the
port, drop counts, bytes in the compiled step), so a port that stops matching fails
here. tests/test_docs.py checks the page's links; its own block runner skips these
fences, so nothing runs twice.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import pathlib
import re

import jax
import pytest
from test_docs import _expected_output

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting.md"
TEXT = PAGE.read_text()
SECTIONS = {
    title: body
    for title, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", TEXT, re.S | re.M)
    if "```python port\n" in body
}
TF_CLASSES = {
    "tf.ConditionalAccumulator",
    "tf.contrib.opt.DropStaleGradientOptimizer",
    "tf.tpu.CrossShardOptimizer",
    "tf.sparse.SparseConditionalAccumulator",
    "tf.contrib.opt.AGNOptimizer",
    "tf.train.SyncReplicasOptimizer",
}


def _blocks(body: str, info: str) -> list[str]:
    return re.findall(rf"```python {info}\n(.*?)```", body, re.S)


TF1_PORTS = {t: b for t, b in SECTIONS.items() if "```python tf1\n" in b}
OPTAX_PORTS = {t: b for t, b in SECTIONS.items() if "```python before\n" in b}
MAX_CHANGED_LINES = 10


def test_the_page_has_six_ports_each_beside_its_tf1_lines():
    assert len(TF1_PORTS) == 6, list(TF1_PORTS)
    assert set(SECTIONS) == set(TF1_PORTS) | set(OPTAX_PORTS), list(SECTIONS)
    for title, body in TF1_PORTS.items():
        tf1, port = _blocks(body, "tf1"), _blocks(body, "port")
        assert tf1 and port, title
        # TF1 first, then the code that replaces it.
        assert body.index("```python tf1\n") < body.index("```python port\n"), title
    shown = "".join(b for body in SECTIONS.values() for b in _blocks(body, "tf1"))
    for name in TF_CLASSES:
        assert name in shown, name


@pytest.mark.parametrize("title", list(OPTAX_PORTS))
def test_a_port_from_optax_changes_at_most_ten_lines(title):
    """The program with `optax.MultiSteps` and the same program ported: at most ten
    lines added or changed, and at most ten taken out."""
    (before,), (after,) = (
        _blocks(OPTAX_PORTS[title], "before"),
        _blocks(OPTAX_PORTS[title], "after"),
    )
    assert "optax.MultiSteps" in before and "optax.MultiSteps" not in after
    diff = [d for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[:1] in "+-"]
    added, removed = (sum(d.startswith(sign) for d in diff) for sign in "+-")
    assert 0 < added <= MAX_CHANGED_LINES and removed <= MAX_CHANGED_LINES, diff


def test_the_page_runs_only_its_own_fences():
    # Plain ```python blocks would also run in tests/test_docs.py, each on its own,
    # without the blocks before them.
    assert "```python\n" not in TEXT
    for title, body in SECTIONS.items():
        ported = "".join(_blocks(body, "(?:port|after)"))
        assert re.search(r"^import .*\boptax_accum\b", ported, re.M), title
        assert not re.search(r"optax_accum\.(\w+\.)*_", ported), title  # public API only


@pytest.mark.parametrize("title", list(SECTIONS))
def test_port_runs_and_prints_what_it_says(title, request):
    if "import ray" in SECTIONS[title] or "optax_accum.ray" in SECTIONS[title]:
        request.getfixturevalue("ray_cluster")  # the session's, as `ray.init` would start
    # A script's namespace: Ray sends the classes and functions it defines by value.
    namespace: dict = {"__name__": "__main__"}
    # As a user runs it: standard dtype promotion; the test session has the 8
    # simulated CPU devices the TPU port asks for.
    with jax.numpy_dtype_promotion("standard"):
        for i, block in enumerate(_blocks(SECTIONS[title], "(?:port|before|after)")):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"porting.md, {title}, block {i}", "exec"), namespace)
            expected = _expected_output(block)
            if expected is not None:
                printed = out.getvalue().strip().splitlines()[-1]
                assert printed.split() == expected.split(), (
                    f"{title} block {i}: printed {printed!r}, its comment says {expected!r}"
                )
