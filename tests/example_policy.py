"""The example user policy package (examples/placement_policy), installed for a test session.

It is pip-installed into a directory of its own, not into the shared environment, and
tests put that directory on ``sys.path``: the policy is then found by its entry point,
as a user's package would be.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "placement_policy"


def install_example_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install the example package offline into a fresh directory; returns that directory."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
            "--no-build-isolation", "--disable-pip-version-check", "--target", str(target),
            str(EXAMPLE),
        ],
        check=True,
        timeout=120,
    )  # fmt: skip
    return target
