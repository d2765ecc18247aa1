"""The import-linter contracts of pyproject.toml hold, and each one fails on the import it forbids.

Each case copies the package, adds one forbidden import to one module and runs
``lint-imports`` on the copy: the contract named must be among those reported broken.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "nbos", tmp_path / "nbos", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_package_keeps_every_contract(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # core at the bottom imports nothing of nbos
        ("nbos/core/ids.py", "import nbos.gateway", "Layers"),
        # the Raft does not know the kernel that runs on it
        ("nbos/raft/kv.py", "import nbos.kernel.front", "Layers"),
        # independent siblings of one layer: policies know nothing of where processes run
        ("nbos/scaling/model.py", "import nbos.backends", "Layers"),
        # two modules of one package importing each other
        ("nbos/gpu/_devices.py", "import nbos.gpu.inventory", "No import cycles"),
        # a layer above may use the gateway, not its private modules
        ("nbos/cluster/_local.py", "import nbos.gateway._scheduler", "private module"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tree: Path, module: str, line: str, contract: str
) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # added by the test\n")
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    broken = [row for row in result.stdout.splitlines() if row.endswith(" BROKEN")]
    # an upward import is often a cycle too; the contract named must be among the broken
    assert any(contract in row for row in broken), result.stdout


def test_the_architecture_table_and_the_contract_name_the_same_layers() -> None:
    """docs/architecture.md's layer table, top to bottom, is the contract's layer list."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    in_contract = [sorted(p.strip() for p in row.split("|")) for row in contract["layers"]]
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n\n", 3)[2]
    in_docs = [
        sorted(name.replace("/", ".") for name in re.findall(r"`(nbos/\w+)`", row.split("|")[2]))
        for row in table.splitlines()[2:]
    ]
    assert in_docs == in_contract
    packages = {p.name for p in (ROOT / "nbos").iterdir() if (p / "__init__.py").exists()}
    assert {name.split(".")[1] for row in in_docs for name in row} == packages
