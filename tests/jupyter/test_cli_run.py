"""``nbos run``: the main job, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

KILL_AFTER_CELL_3 = ("--kill-executor-after", "3")


def test_nbos_run_executes_a_notebook_and_reports_each_cell(tmp_path: Path) -> None:
    source, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nb = new_notebook(
        cells=[
            new_markdown_cell("# title"),
            new_code_cell("data = {'a': 1}"),
            new_code_cell("data['b'] = 2\nprint(sorted(data))"),
            new_code_cell("print(len(data))"),
        ]
    )
    nbformat.write(nb, source)
    result = subprocess.run(
        [sys.executable, "-m", "nbos", "run", str(source), "-o", str(out), *KILL_AFTER_CELL_3],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [row[0] for row in rows] == ["2", "3", "4"]
    assert all(row[1] in {"1", "2", "3"} and row[-1] == "ok" for row in rows)
    assert rows[2][1] != rows[1][1], "the cell after the kill ran on another replica"
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[2].outputs[0]["text"] == "['a', 'b']\n"
    assert executed.cells[3].outputs[0]["text"] == "2\n"
    assert [c.execution_count for c in executed.cells[1:]] == [1, 2, 3]
    texts = [o.get("text", "") for c in executed.cells[1:] for o in c.outputs]
    assert not any("nbos." in t for t in texts), "nbos log records leaked into cell output"


def test_nbos_run_fails_cleanly_on_a_missing_notebook(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nbos", "run", str(tmp_path / "missing.ipynb")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "nbos: error" in result.stderr and "Traceback" not in result.stderr
