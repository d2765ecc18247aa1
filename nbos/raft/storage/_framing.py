"""Record framing of WAL segments, and the scan that tells a torn tail from corruption.

A frame is ``MAGIC (4) | length (u32 LE) | crc (u32 LE) | payload``. ``crc`` is
CRC-32 (zlib's, the IEEE polynomial; CRC-32C would need a dependency and buys
speed, not detection power here) over the length bytes and the payload, so a
flipped length is caught too. The payload is one msgpack-encoded record.

The magic makes re-synchronisation after a bad frame cheap (``bytes.find``): a
bad frame followed by any valid frame is corruption, while a bad frame with
nothing valid after it is a torn tail (a write cut short by a crash).
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
_HEADER = struct.Struct("<4sII")
HEADER_SIZE = _HEADER.size
MAX_PAYLOAD = (1 << 32) - 1
_UNDECODABLE = "undecodable record with a valid checksum"

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WalRecord)


def encode_frame(record: WalRecord) -> bytes:
    """One framed record. Raises ``ValueError`` for a record too large for a frame."""
    payload = _encoder.encode(record)
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record of {len(payload)} bytes exceeds the frame limit")
    length = struct.pack("<I", len(payload))
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload, zlib.crc32(length))) + payload


@dataclass(frozen=True, slots=True)
class ScanResult:
    """The records of a segment up to ``valid_end``; ``bad_offset`` is where a bad frame starts."""

    records: list[WalRecord]
    valid_end: int
    bad_offset: int | None
    bad_reason: str = ""
    torn: bool = False
    """A bad frame that can only be a write cut short: nothing valid follows it."""


def scan(buf: bytes) -> ScanResult:
    """Decode frames from the start of ``buf`` until the end or the first bad frame."""
    records: list[WalRecord] = []
    offset = 0
    while offset < len(buf):
        record, reason = _read_frame(buf, offset)
        if record is None:
            torn = reason != _UNDECODABLE and not _valid_frame_after(buf, offset)
            return ScanResult(records, offset, offset, reason, torn)
        records.append(record)
        offset += HEADER_SIZE + _length_at(buf, offset)
    return ScanResult(records, offset, None)


def _length_at(buf: bytes, offset: int) -> int:
    return int(_HEADER.unpack_from(buf, offset)[1])


def _read_frame(buf: bytes, offset: int) -> tuple[WalRecord | None, str]:
    if len(buf) - offset < HEADER_SIZE:
        return None, "partial frame header"
    magic, length, crc = _HEADER.unpack_from(buf, offset)
    if magic != MAGIC:
        return None, "no frame marker"
    start = offset + HEADER_SIZE
    if start + length > len(buf):
        return None, f"frame of {length} bytes runs past the end of the file"
    payload = buf[start : start + length]
    if zlib.crc32(payload, zlib.crc32(buf[offset + 4 : offset + 8])) != crc:
        return None, "checksum mismatch"
    try:
        return _decoder.decode(payload), ""
    except (msgspec.MsgspecError, ValueError) as exc:
        # A frame whose checksum holds was written like this: not a torn write.
        log.warning("undecodable WAL record at offset %d: %s", offset, exc)
        return None, _UNDECODABLE


def _valid_frame_after(buf: bytes, bad_offset: int) -> bool:
    pos = buf.find(MAGIC, bad_offset + 1)
    while pos != -1:
        if _read_frame(buf, pos)[0] is not None:
            return True
        pos = buf.find(MAGIC, pos + 1)
    return False
