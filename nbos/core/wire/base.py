"""The base class of every wire message and log entry."""

from __future__ import annotations

import msgspec

#: Bumped whenever a message changes incompatibly; a peer on another version is refused.
PROTOCOL_VERSION = 1


class Message(msgspec.Struct, forbid_unknown_fields=True, tag=True, tag_field="t"):
    """Base of every message: tagged by class name, strict about unknown fields.

    Subclasses must have names unique across the whole wire format, since the
    class name is the tag.
    """
