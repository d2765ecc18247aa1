"""Blob keys: parsing (the only gate between a caller's key and a path), hashing, checking."""

from __future__ import annotations

import hashlib
import logging
import re

from nbos.core.errors import BlobCorruptError, InvalidBlobKeyError
from nbos.core.ids import BLOB_KEY_PREFIX, BlobKey

logger = logging.getLogger(__name__)

_KEY = re.compile(re.escape(BLOB_KEY_PREFIX) + r"([0-9a-f]{64})")


def digest_of(key: BlobKey) -> str:
    """The 64 hex digits of ``key``; raises :class:`InvalidBlobKeyError` for anything else.

    Stores build paths and backend keys from the returned digest only, never from
    the raw key, so a malformed key cannot reach outside the store.
    """
    match = _KEY.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        logger.warning("refused invalid blob key %r", key)
        raise InvalidBlobKeyError(key)
    return match.group(1)


def new_hasher(data: bytes = b"") -> hashlib._Hash:
    """A fresh hasher for the store's content addresses, fed ``data``."""
    return hashlib.sha256(data)


def key_of(hasher: hashlib._Hash) -> BlobKey:
    """The key of the content fed to ``hasher``."""
    return BlobKey(BLOB_KEY_PREFIX + hasher.hexdigest())


def verify(hasher: hashlib._Hash, key: BlobKey) -> None:
    """Raise :class:`BlobCorruptError` unless the content fed to ``hasher`` has ``key``."""
    if key_of(hasher) != key:
        logger.error("blob %s failed its integrity check", key)
        raise BlobCorruptError(key)
