"""nbclient runs notebooks through the ``nbos`` kernelspec, as papermill and JupyterLab would."""

from __future__ import annotations

import nbclient
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

# The first kernel of a session may start the per-user gateway, its agents cold.
pytestmark = pytest.mark.timeout(300)


def run(cells: list[str], **kw: object) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, kernel_name="nbos", timeout=120, **kw).execute()
    return nb


def test_notebook_state_flows_across_cells() -> None:
    nb = run(
        [
            "import math\nvalues = [1, 2, 3]",
            "def total(xs):\n    return sum(xs)\nvalues.append(4)",
            "print(total(values), math.pi > 3)",
            "values",
        ]
    )
    counts = [c.execution_count for c in nb.cells]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)
    assert nb.cells[2].outputs[0]["text"] == "10 True\n"
    assert nb.cells[3].outputs[0]["data"]["text/plain"] == "[1, 2, 3, 4]"


def test_a_failing_cell_stops_the_notebook_with_the_error() -> None:
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="ZeroDivisionError"):
        run(["x = 1", "x / 0", "print('never')"])
