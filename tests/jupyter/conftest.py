"""The nbos kernelspec, installed into a throwaway prefix that Jupyter is pointed at."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from nbos.jupyter import install


@pytest.fixture(scope="session", autouse=True)
def nbos_kernelspec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    path = Path(install(prefix=str(prefix)))
    before = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    yield path
    if before is None:
        del os.environ["JUPYTER_PATH"]
    else:
        os.environ["JUPYTER_PATH"] = before
