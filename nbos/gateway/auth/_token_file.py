"""The operator token's file: how a client on the gateway's machine, run by the same user,
finds the token without being told it.

The gateway writes its operator token to ``nbos-gateway-PORT.token`` (``PORT``: its control
port) in Jupyter's runtime directory (``$JUPYTER_RUNTIME_DIR`` honoured), ``0600`` in a
``0700`` directory, and removes it when it exits. A client looks for its token in turn in
what it was given (``--token``), ``$NBOS_TOKEN``, and that file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from jupyter_core.paths import jupyter_runtime_dir

from nbos.core.private_files import private_dir, write_private

log = logging.getLogger(__name__)

#: The environment variable a client's token may come from.
TOKEN_ENV = "NBOS_TOKEN"


def token_path(address: str) -> Path:
    """The operator token file of the gateway whose control endpoint is ``address``."""
    port = address.rsplit(":", 1)[-1]
    return Path(jupyter_runtime_dir()) / f"nbos-gateway-{port}.token"


def client_token(address: str, given: str | None = None) -> str:
    """The token a client of the gateway at ``address`` sends: ``given``, else
    ``$NBOS_TOKEN``, else that of the gateway's token file if this user may read it, else
    ``""`` (which the gateway refuses)."""
    if given:
        return given
    if env := os.environ.get(TOKEN_ENV, ""):
        return env
    try:
        return token_path(address).read_text().strip()
    except OSError:
        return ""


def write_token_file(address: str, token: str) -> Path:
    """Write ``token`` to the token file of ``address``; its path."""
    path = token_path(address)
    private_dir(path.parent)
    write_private(path, token.encode() + b"\n")
    return path


def remove_token_file(path: Path, token: str) -> None:
    """Remove ``path`` if it still holds ``token`` (a later gateway on the port wrote its own)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == token:
            path.unlink()
