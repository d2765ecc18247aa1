"""The nbos kernelspec, installed into a throwaway prefix that Jupyter is pointed at, and a
throwaway Jupyter runtime directory, where the kernels' per-user gateway is announced."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nbos.jupyter import install
from tests.jupyter._gateway import stop_local_gateway


@contextmanager
def _set_env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    yield
    if before is None:
        del os.environ[name]
    else:
        os.environ[name] = before


@pytest.fixture(scope="session", autouse=True)
def nbos_kernelspec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    prefix = tmp_path_factory.mktemp("jupyter-prefix")
    path = Path(install(prefix=str(prefix)))
    install(prefix=str(prefix), gpus=1)
    with _set_env("JUPYTER_PATH", str(prefix / "share" / "jupyter")):
        yield path


@pytest.fixture(scope="session", autouse=True)
def jupyter_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's kernels share one per-user gateway, stopped at the end."""
    path = tmp_path_factory.mktemp("jupyter-runtime")
    with _set_env("JUPYTER_RUNTIME_DIR", str(path)):
        try:
            yield path
        finally:
            stop_local_gateway(path)
