"""Ways to damage real files on purpose, for the tests that check the damage is named."""

import struct
import zlib
from pathlib import Path


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut `path` to the first `keep` share of its bytes, as an interrupted copy leaves it."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep)])


def scramble_png_pixels(data: bytes) -> bytes:
    """A PNG whose chunks (CRCs included) are whole but whose pixel stream is not zlib: it
    passes every check short of decoding, and fails when decoded."""
    out, position = bytearray(data[:8]), 8
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        body = data[position + 8 : position + 8 + length]
        if kind == b"IDAT":
            body = bytes(b ^ 0x5A for b in body)
        out += struct.pack(">I4s", length, kind) + body + struct.pack(">I", zlib.crc32(kind + body))
        position += 12 + length
    return bytes(out)
