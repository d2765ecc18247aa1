"""The example user packages (examples/placement_policy, examples/host_provider), installed
for a test session.

Each is pip-installed into a directory of its own, not into the shared environment, and
tests put that directory on ``sys.path``: the policy is then found by its entry point,
as a user's package would be.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def install_example_policy(
    tmp_path_factory: pytest.TempPathFactory, example: str = "placement_policy"
) -> Path:
    """Install the example package offline into a fresh directory; returns that directory."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
            "--no-build-isolation", "--disable-pip-version-check", "--target", str(target),
            str(EXAMPLES / example),
        ],
        check=True,
        timeout=120,
    )  # fmt: skip
    return target
