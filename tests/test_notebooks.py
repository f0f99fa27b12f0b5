"""Every notebook in colab/ runs top to bottom (nbclient), and is stored clean.

Each notebook is executed in a fresh Jupyter kernel on the CPU (8 simulated devices,
set by its own first cell), with the kernel's inline (Agg) matplotlib backend, after a cell
that shrinks `STEPS` is inserted below the cell tagged "parameters". A cell that
raises fails the test. The notebooks must match what colab/make_notebooks.py writes.
"""

from __future__ import annotations

import importlib.util
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICK_STEPS = 32


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    first_markdown = nb.cells[0].source
    assert "colab.research.google.com/assets/colab-badge.svg" in first_markdown
    assert f"colab/{path.name}" in first_markdown
    assert "google.colab" in nb.cells[1].source and "ON_TPU" in nb.cells[1].source
    (at,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(f"STEPS = {QUICK_STEPS}"))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline (Agg) backend
    monkeypatch.setenv("XLA_FLAGS", "")  # the notebook's own first cell asks for 8 devices
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    printed = "".join(
        out.get("text", "") for c in nb.cells if c.cell_type == "code" for out in c.outputs
    )
    assert "8 CPU devices" in printed
    images = [
        out
        for c in nb.cells
        if c.cell_type == "code"
        for out in c.outputs
        if "image/png" in out.get("data", {})
    ]
    assert images, "the notebook shows no plot"
