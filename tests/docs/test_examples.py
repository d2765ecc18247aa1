"""Every example in docs/ fenced as ```python run``` runs, as a reader would paste it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```python run\n(.*?)^```", re.S | re.M)


def examples() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for n, match in enumerate(FENCE.finditer(page.read_text()), start=1):
            found.append((f"{page.name}#{n}", match.group(1)))
    return found


def test_the_docs_have_runnable_examples() -> None:
    pages = {name.split("#")[0] for name, _ in examples()}
    assert {"kernel.md", "placement.md", "chaos.md"} <= pages


@pytest.mark.parametrize(("name", "code"), examples(), ids=[n for n, _ in examples()])
def test_example_runs(name: str, code: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
