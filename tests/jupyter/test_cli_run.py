"""``nbos run``: the main job, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def test_nbos_run_executes_a_notebook_and_reports_each_cell(tmp_path: Path) -> None:
    source, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nb = new_notebook(
        cells=[
            new_markdown_cell("# title"),
            new_code_cell("data = {'a': 1}"),
            new_code_cell("data['b'] = 2\nprint(sorted(data))"),
        ]
    )
    nbformat.write(nb, source)
    result = subprocess.run(
        [sys.executable, "-m", "nbos", "run", str(source), "-o", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [row[0] for row in rows] == ["2", "3"]
    assert all(row[1] in {"1", "2", "3"} and row[-1] == "ok" for row in rows)
    executed = nbformat.read(out, as_version=4)
    assert executed.cells[2].outputs[0]["text"] == "['a', 'b']\n"
    assert [c.execution_count for c in executed.cells[1:]] == [1, 2]


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
