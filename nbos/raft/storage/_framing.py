"""Record framing of WAL segments, and the scan that tells a torn tail from corruption.

A frame is ``MAGIC (4) | length (u32) | payload crc (u32) | header crc (u32) |
payload``, little-endian. Both checksums are CRC-32 (zlib's, the IEEE
polynomial; CRC-32C would need a dependency and buys speed, not detection power
here): the header crc covers the 12 bytes before it, the payload crc the
payload. The payload is one msgpack-encoded record.

Telling a torn tail from corruption: a bad frame followed by any valid frame is
corruption, while a bad frame with nothing valid after it is a torn tail (a
write cut short by a crash). The magic makes the search for a later valid frame
cheap (``bytes.find``). When the bad frame's header is sound its length is
trusted and the search starts after its payload, so a torn record whose payload
happens to contain bytes of a frame (user data can hold anything) is still seen
as torn.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass

import msgspec

from nbos.core.wire.raft import Entry, HardState, SnapshotMeta

WalRecord = Entry | HardState | SnapshotMeta

MAGIC = b"\xd5NbW"
_PREFIX = struct.Struct("<4sII")
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _PREFIX.size + _HEADER_CRC.size
MAX_PAYLOAD = (1 << 32) - 1
_UNDECODABLE = "undecodable record with valid checksums"

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WalRecord)


def encode_frame(record: WalRecord) -> bytes:
    """One framed record. Raises ``ValueError`` for a record too large for a frame."""
    payload = _encoder.encode(record)
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record of {len(payload)} bytes exceeds the frame limit")
    prefix = _PREFIX.pack(MAGIC, len(payload), zlib.crc32(payload))
    return prefix + _HEADER_CRC.pack(zlib.crc32(prefix)) + payload


@dataclass(frozen=True, slots=True)
class ScanResult:
    """The records of a segment up to ``valid_end``; ``bad_offset`` is where a bad frame starts."""

    records: list[WalRecord]
    valid_end: int
    bad_offset: int | None
    bad_reason: str = ""
    torn: bool = False
    """A bad frame that can only be a write cut short: nothing valid follows it."""


@dataclass(frozen=True, slots=True)
class _Frame:
    record: WalRecord | None
    end: int
    """Where the next frame starts, when the header is sound (else just past ``offset``)."""
    reason: str = ""


def scan(buf: bytes) -> ScanResult:
    """Decode frames from the start of ``buf`` until the end or the first bad frame."""
    records: list[WalRecord] = []
    offset = 0
    while offset < len(buf):
        frame = _read_frame(buf, offset)
        if frame.record is None:
            torn = frame.reason != _UNDECODABLE and not _valid_frame_from(buf, frame.end)
            return ScanResult(records, offset, offset, frame.reason, torn)
        records.append(frame.record)
        offset = frame.end
    return ScanResult(records, offset, None)


def _read_frame(buf: bytes, offset: int) -> _Frame:
    if len(buf) - offset < HEADER_SIZE:
        return _Frame(None, offset + 1, "partial frame header")
    magic, length, payload_crc = _PREFIX.unpack_from(buf, offset)
    (header_crc,) = _HEADER_CRC.unpack_from(buf, offset + _PREFIX.size)
    if magic != MAGIC:
        return _Frame(None, offset + 1, "no frame marker")
    if zlib.crc32(buf[offset : offset + _PREFIX.size]) != header_crc:
        return _Frame(None, offset + 1, "header checksum mismatch")
    start = offset + HEADER_SIZE
    end = start + length
    if end > len(buf):
        return _Frame(None, end, f"frame of {length} bytes runs past the end of the file")
    payload = buf[start:end]
    if zlib.crc32(payload) != payload_crc:
        return _Frame(None, end, "payload checksum mismatch")
    try:
        return _Frame(_decoder.decode(payload), end)
    except (msgspec.MsgspecError, ValueError) as exc:
        # A frame whose checksums hold was written like this: not a torn write.
        log.warning("undecodable WAL record at offset %d: %s", offset, exc)
        return _Frame(None, end, _UNDECODABLE)


def _valid_frame_from(buf: bytes, start: int) -> bool:
    pos = buf.find(MAGIC, start)
    while pos != -1:
        if _read_frame(buf, pos).record is not None:
            return True
        pos = buf.find(MAGIC, pos + 1)
    return False
