"""The quickstart notebook runs headless from top to bottom (so it cannot rot) and shows its plot."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    # the plot cell shows its figure (a notebook user sees it; with the Agg backend nothing would come back)
    assert any("image/png" in out.get("data", {}) for out in outputs), [out.get("output_type") for out in outputs]
