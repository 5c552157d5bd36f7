"""Execute the notebooks in notebooks/ (numerical checks of the paper's derivations) and fail on any error.

Each notebook asserts its own checks; a failing assert is a cell error, which nbclient raises as
CellExecutionError. The kernel is "python3" from this interpreter's environment (the venv's ipykernel).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_present():
    assert len(NOTEBOOKS) >= 3, f"expected the derivation notebooks in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    # Look for kernel specs in this environment first, so "python3" is the ipykernel installed next to this
    # interpreter even when a user-level spec of the same name points elsewhere; jupyter_client launches a spec
    # whose argv starts with "python" with sys.executable.
    env_data = str(Path(sys.prefix) / "share" / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(p for p in (env_data, os.environ.get("JUPYTER_PATH")) if p))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors
