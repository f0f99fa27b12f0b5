"""Every notebook in colab/ runs top to bottom (nbclient) on 1 and on 8 devices, and is
stored clean.

Each notebook is executed in a fresh Jupyter kernel on the CPU, with the number of
simulated devices its first cell sets taken from OPTAX_ACCUM_CPU_DEVICES (1 stands for
a GPU or a single TPU chip, 8 for a TPU v2-8's cores), the kernel's inline (Agg)
matplotlib backend, and a cell that shrinks `STEPS` inserted below the cell tagged
"parameters". A cell that raises fails the test. The notebooks must match what
colab/make_notebooks.py writes. The Colab install step is checked without a network:
it must pin the runtime's jax and jaxlib.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import types

import nbformat
import pytest
from nbclient import NotebookClient

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICK_STEPS = 24


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", COLAB / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_the_four_notebooks_at_least():
    names = {p.stem for p in NOTEBOOKS}
    assert {
        "accumulation_with_staleness",
        "data_parallel_cross_shard",
        "sparse_embeddings",
        "agn_vs_sync_sgd",
    } <= names


def test_notebooks_are_generated_and_stored_without_outputs():
    generator = _generator()
    assert {p.stem for p in NOTEBOOKS} == set(generator.NOTEBOOKS)
    for path in NOTEBOOKS:
        stored = nbformat.read(path, as_version=4)
        assert stored == generator.build(path.stem), f"{path.name}: re-run make_notebooks.py"
        for cell in stored.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


def test_first_cells_say_how_to_open_and_install():
    generator = _generator()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        intro, setup = nb.cells[0].source, nb.cells[1].source
        if generator.REPOSITORY:
            assert "colab.research.google.com/assets/colab-badge.svg" in intro, path.name
            assert f"/blob/main/colab/{path.name}" in intro, path.name
        else:  # no address to link to: no badge, and how to get the notebook there
            assert "colab.research.google.com" not in intro, path.name
            assert "File > Upload notebook" in intro, path.name
        assert "google.colab" in setup and "OPTAX_ACCUM_CPU_DEVICES" in setup, path.name
        assert "JAX_PLATFORMS" not in setup, path.name  # a GPU runtime keeps its GPU


def _install_step(tmp_path, wheels):
    """The setup cell's install function, with pip, glob and the pin file faked."""
    generator = _generator()
    setup = generator.SETUP
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
    return namespace["install_optax_accum"], calls, generator


def test_colab_install_keeps_the_runtime_jax(tmp_path):
    wheel = "/content/optax_accum-0.1.0-py3-none-any.whl"
    install, calls, generator = _install_step(tmp_path, [wheel])
    if generator.REPOSITORY:
        pytest.fail("update this test: the repository address is known now")
    install()
    cmd, pins = calls[0]
    assert cmd[cmd.index("install") :][-1] == wheel  # the uploaded wheel, no extras forced
    for dist in ("jax", "jaxlib"):
        assert f"{dist}=={importlib.metadata.version(dist)}" in pins.split()


def test_colab_install_without_a_source_says_what_to_upload(tmp_path):
    install, calls, _ = _install_step(tmp_path, [])
    with pytest.raises(RuntimeError, match=r"optax_accum is not installed\. Build a wheel"):
        install()
    assert not calls


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, devices, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(f"STEPS = {QUICK_STEPS}"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline (Agg) backend
    monkeypatch.setenv("XLA_FLAGS", "")  # the notebook's own first cell sets the devices
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
