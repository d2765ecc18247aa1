"""The replica template imports what a replica's start imports, so its forks import nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("_forked_imports_child.py")
ROOT = Path(__file__).resolve().parents[2]


def test_an_assigned_replica_imports_nothing_its_template_did_not(tmp_path: Path) -> None:
    # Each module imported after the fork costs every replica of a burst its import
    # (and the pages it writes), where the template's imports are shared.
    out = tmp_path / "imported.txt"
    subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.read_text().split() == []
