"""Every notebook in colab/ is its percent-format script, stored clean, and runs top to
bottom (nbclient), on 8 devices and, where its own code follows the device count, on 1.

The scripts colab/*.py are the notebooks' source; `jupytext --update --to ipynb
colab/*.py` writes the .ipynb files from them. Each .ipynb must hold its script's cells
(same types, sources and tags) and no outputs. The cells the notebooks share are the
same text in each: the setup cell, whose constants follow pyproject.toml, and the data
cell, which imports the data (and the model) from optax_accum.demo.notebook.

Each notebook is executed in a fresh Jupyter kernel on the CPU, with the number of
simulated devices its first cell sets taken from OPTAX_ACCUM_CPU_DEVICES (1 stands for
a GPU or a single TPU chip, 8 for a TPU v2-8's cores), the kernel's inline (Agg)
matplotlib backend, and a cell that shrinks `STEPS` inserted below the cell tagged
"parameters" (and, in the Ray notebook, `WORKERS`: two worker processes take the same
path as four, for two fewer processes importing JAX and compiling). A cell that raises
fails the test. The Colab install step is checked without a network: it must pin the
runtime's jax and jaxlib.

What a run costs is the kernel's imports (about 4 CPU seconds) and its compiles, not
its steps: halving QUICK_STEPS changes nothing measurable, so it stays where every
curve gets its points and AGN's period 16 gets a round.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import tomllib
import types

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
SCRIPTS = sorted(COLAB.glob("*.py"))
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICK_STEPS = 24
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The project's public address, when pyproject.toml's [project.urls] has it.
REPOSITORY = PYPROJECT["project"].get("urls", {}).get("Repository")
SYNC = "jupytext --update --to ipynb colab/*.py"


def _cells(nb) -> list[tuple[str, str, list[str]]]:
    return [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]


def _setup_source(path: pathlib.Path) -> str:
    return jupytext.read(path).cells[1].source


def test_there_are_the_six_notebooks():
    names = {
        "accumulation_with_staleness",
        "data_parallel_cross_shard",
        "sparse_embeddings",
        "agn_vs_sync_sgd",
        "host_accumulator_threads",
        "ray_async_workers",
    }
    assert {p.stem for p in SCRIPTS} == names
    assert {p.stem for p in NOTEBOOKS} == names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_notebook_is_its_script_without_outputs(script):
    path = script.with_suffix(".ipynb")
    assert path.exists(), f"{path.name} is missing: run `{SYNC}`"
    stored = nbformat.read(path, as_version=4)
    nbformat.validate(stored)
    assert _cells(stored) == _cells(jupytext.read(script)), f"{path.name}: run `{SYNC}`"
    assert stored.metadata.get("kernelspec", {}).get("name") == "python3"
    assert stored.metadata.get("colab", {}).get("name") == path.name
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name


def test_a_changed_script_is_a_mismatch(tmp_path):
    # The comparison above can fail: one edited line of a script is a different notebook.
    script = SCRIPTS[0]
    edited = tmp_path / script.name
    edited.write_text(script.read_text().replace("# %%\n", "# %%\nSTEPS = 1\n", 1))
    stored = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    assert _cells(stored) != _cells(jupytext.read(edited))


def test_shared_cells_are_the_same_in_every_notebook():
    notebooks = [jupytext.read(p) for p in SCRIPTS]
    for i, role in [(1, "setup"), (3, "data")]:
        sources = {nb.cells[i].source for nb in notebooks}
        assert len(sources) == 1, f"the {role} cells differ between the notebooks"
    data = notebooks[0].cells[3].source
    assert "from optax_accum.demo import notebook" in data
    assert "parameters" in notebooks[0].cells[2].metadata.get("tags", [])


def test_setup_cell_follows_pyproject():
    tree = ast.parse(_setup_source(SCRIPTS[0]))
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        if node.targets[0].id in ("REPOSITORY", "MIN_JAX")
    }
    floor = next(
        re.fullmatch(r"jax>=([\d.]+)", d)[1]
        for d in PYPROJECT["project"]["dependencies"]
        if d.startswith("jax>=")
    )
    assert constants == {"REPOSITORY": REPOSITORY, "MIN_JAX": floor}


def test_first_cells_say_how_to_open_and_install():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        intro, setup = nb.cells[0].source, nb.cells[1].source
        if REPOSITORY:
            assert "colab.research.google.com/assets/colab-badge.svg" in intro, path.name
            assert f"/blob/main/colab/{path.name}" in intro, path.name
        else:  # no address to link to: no badge, and how to get the notebook there
            assert "colab.research.google.com" not in intro, path.name
            assert "File > Upload notebook" in intro, path.name
        assert "google.colab" in setup and "OPTAX_ACCUM_CPU_DEVICES" in setup, path.name
        assert "JAX_PLATFORMS" not in setup, path.name  # a GPU runtime keeps its GPU


def _install_step(tmp_path, wheels):
    """The setup cell's install function, with pip, glob and the pin file faked."""
    setup = _setup_source(SCRIPTS[0])
    namespace: dict = {}
    exec(
        compile(setup[: setup.index('if "google.colab" in sys.modules')], "setup", "exec"),
        namespace,
    )
    calls = []

    def fake_run(cmd, check):
        pins = (tmp_path / pathlib.Path(cmd[cmd.index("-c") + 1]).name).read_text()
        calls.append((cmd, pins))

    def fake_open(path, mode="r"):
        return open(tmp_path / pathlib.Path(path).name, mode)

    # The function's globals are `namespace`: these names shadow the real modules there.
    namespace["subprocess"] = types.SimpleNamespace(run=fake_run)
    namespace["glob"] = types.SimpleNamespace(glob=lambda pattern: wheels)
    namespace["open"] = fake_open
    return namespace["install_optax_accum"], calls


def test_colab_install_keeps_the_runtime_jax(tmp_path):
    wheel = "/content/optax_accum-0.1.0-py3-none-any.whl"
    install, calls = _install_step(tmp_path, [wheel])
    if REPOSITORY:
        pytest.fail("update this test: the repository address is known now")
    install()
    cmd, pins = calls[0]
    assert cmd[cmd.index("install") :][-1] == wheel  # the uploaded wheel, no extras forced
    for dist in ("jax", "jaxlib"):
        assert f"{dist}=={importlib.metadata.version(dist)}" in pins.split()


def test_colab_install_without_a_source_says_what_to_upload(tmp_path):
    install, calls = _install_step(tmp_path, [])
    with pytest.raises(RuntimeError, match=r"optax_accum is not installed\. Build a wheel"):
        install()
    assert not calls


# Each notebook on 8 devices (a TPU v2-8's cores), and the data-parallel one on 1 too (a
# GPU or a single chip: its replicas and its global batch follow the device count; the
# others' device-count paths are the library's, which its tests cover on 1 device and
# on 8). ray_async_workers on 1 only: its workers are Ray processes whatever the
# devices, and a run starts a Ray cluster (tens of seconds).
RUNS = [(p, 1 if p.stem == "ray_async_workers" else 8) for p in NOTEBOOKS]
RUNS += [(p, 1) for p in NOTEBOOKS if p.stem == "data_parallel_cross_shard"]


# Parameters the runs set below the "parameters" cell, besides STEPS.
QUICK_PARAMETERS = {"ray_async_workers": "WORKERS = 2"}


@pytest.mark.parametrize(("path", "devices"), RUNS, ids=[f"{p.stem}-{d}" for p, d in RUNS])
def test_notebook_runs_top_to_bottom(path, devices, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    quick = "\n".join([f"STEPS = {QUICK_STEPS}", QUICK_PARAMETERS.get(path.stem, "")]).strip()
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(quick))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline (Agg) backend
    # The notebook's own first cell sets the devices; unoptimised machine code, as for
    # every test (conftest.py says why).
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setenv("OPTAX_ACCUM_CPU_DEVICES", str(devices))
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    printed = "".join(
        out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.outputs
    )
    assert f"{devices} CPU device{'s' if devices > 1 else ''}, jax " in printed
    images = [
        out
        for c in nb.cells
        if c.cell_type == "code"
        for out in c.outputs
        if "image/png" in out.get("data", {})
    ]
    assert images, "the notebook shows no plot"
