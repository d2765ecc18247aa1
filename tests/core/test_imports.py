"""The control plane imports without torch: only user notebooks and GPU residency need it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import nbos
for module in pkgutil.walk_packages(nbos.__path__, "nbos."):
    if module.name.endswith("__main__"):
        continue
    importlib.import_module(module.name)
print(len(sys.modules))
"""


def test_every_nbos_module_imports_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
