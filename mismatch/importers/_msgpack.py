"""A small MessagePack decoder (no dependency): enough for prime-rl's msgspec-encoded batches.

Importers read `rollouts.bin` through it; it never executes anything and rejects extension types.
"""

from __future__ import annotations

import struct
from typing import Any

MAX_DEPTH = 64  # nesting levels: a hostile file gets an error, not a RecursionError


class MsgpackError(ValueError):
    """Bytes that are not (supported) MessagePack; the message says the offset."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise MsgpackError(f"truncated at byte {self.pos} (wanted {n} more bytes)")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]


# Fixed-width headers: byte -> (struct format of the payload or length, kind)
_SIZED = {0xcc: (">B", "scalar"), 0xcd: (">H", "scalar"), 0xce: (">I", "scalar"), 0xcf: (">Q", "scalar"),
          0xd0: (">b", "scalar"), 0xd1: (">h", "scalar"), 0xd2: (">i", "scalar"), 0xd3: (">q", "scalar"),
          0xca: (">f", "scalar"), 0xcb: (">d", "scalar"),
          0xd9: (">B", "str"), 0xda: (">H", "str"), 0xdb: (">I", "str"),
          0xc4: (">B", "bin"), 0xc5: (">H", "bin"), 0xc6: (">I", "bin"),
          0xdc: (">H", "array"), 0xdd: (">I", "array"), 0xde: (">H", "map"), 0xdf: (">I", "map")}


def _value(reader: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise MsgpackError(f"nested deeper than {MAX_DEPTH} levels at byte {reader.pos}")
    at = reader.pos
    byte = reader.take(1)[0]
    if byte <= 0x7f:
        return byte
    if byte >= 0xe0:
        return byte - 0x100
    if 0xa0 <= byte <= 0xbf:
        return _text(reader, byte & 0x1f, at)
    if 0x90 <= byte <= 0x9f:
        return [_value(reader, depth + 1) for _ in range(byte & 0x0f)]
    if 0x80 <= byte <= 0x8f:
        return _map(reader, byte & 0x0f, depth)
    if byte in (0xc0, 0xc2, 0xc3):
        return {0xc0: None, 0xc2: False, 0xc3: True}[byte]
    if byte not in _SIZED:
        raise MsgpackError(f"unsupported type byte 0x{byte:02x} at byte {at}")
    fmt, kind = _SIZED[byte]
    head = reader.unpack(fmt)
    if kind == "scalar":
        return head
    if kind == "str":
        return _text(reader, head, at)
    if kind == "bin":
        return reader.take(head)
    if kind == "array":
        return [_value(reader, depth + 1) for _ in range(head)]
    return _map(reader, head, depth)


def _text(reader: _Reader, length: int, at: int) -> str:
    try:
        return reader.take(length).decode("utf-8")
    except UnicodeDecodeError:
        raise MsgpackError(f"string at byte {at} is not UTF-8") from None


def _map(reader: _Reader, length: int, depth: int) -> dict:
    out = {}
    for _ in range(length):
        key = _value(reader, depth + 1)
        if isinstance(key, (list, dict)):
            raise MsgpackError(f"map key at byte {reader.pos} is not a scalar")
        out[key] = _value(reader, depth + 1)
    return out


def unpack_all(data: bytes) -> list[Any]:
    """Every top-level object in `data`, in order (a file may hold one or several)."""
    reader = _Reader(data)
    objects = []
    while reader.pos < len(data):
        objects.append(_value(reader, 0))
    return objects
