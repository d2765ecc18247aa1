"""Files only their owner reads: what nbos writes holds cell source (Raft logs, snapshots,
namespace images), kernel keys (connection files) and tokens (logs).

Daemons (gateway, agent, replica) run with :data:`PRIVATE_UMASK`, so whatever they and
their children create is ``0600`` in ``0700`` directories. Code that runs inside a user's
own process (an embedded cluster) must not change that process's umask: it creates its
files with :func:`private_dir` and :func:`open_private` instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO

#: The umask of nbos's daemons: no access for group or others.
PRIVATE_UMASK = 0o077
_DIR_MODE = 0o700
_FILE_MODE = 0o600

# A token in a query string (``?token=...``) or an Authorization header value.
_TOKEN = re.compile(r"(?i)((?:[?&]token=)|(?:authorization:\s*(?:token|bearer)\s+))[^&\s\"']+")


def keep_private() -> None:
    """Make this process create its files private: for a daemon's ``main``, not a library."""
    os.umask(PRIVATE_UMASK)


def private_dir(path: Path) -> Path:
    """``path`` and its missing parents as directories; ``path`` itself ``0700``."""
    path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, _DIR_MODE)
    return path


def open_private(path: Path, *, append: bool = True) -> BinaryIO:
    """``path`` opened for binary writing (appending, or truncated), ``0600`` even if it
    existed with another mode."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab" if append else "wb")


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, the new file ``0600``."""
    scratch = path.with_name(path.name + ".tmp")
    with open_private(scratch, append=False) as f:
        f.write(data)
    scratch.replace(path)


def redact_tokens(text: str) -> str:
    """``text`` with every token in a query string or Authorization header replaced by
    ``[redacted]``: for log lines that quote a request."""
    return _TOKEN.sub(r"\1[redacted]", text)
