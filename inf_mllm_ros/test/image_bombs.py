"""Small compressed images that declare huge ones: for the tests of bounded decoding."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from inf_mllm_ros.image_conversion import rgb_to_compressed_fields


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A real 1-bit grey PNG of width x height zeros: about 110 KB for 30000 x 30000 (2.7 GB as RGB)."""
    row = bytes(1 + (width + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def png_header_only(width: int, height: int, colour_type: int = 2) -> bytes:
    """A PNG signature and header declaring width x height, and no pixel data."""
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IEND", b"")


def jpeg_bomb(width: int, height: int) -> bytes:
    """A valid 8 x 8 JPEG whose frame header is rewritten to declare width x height (631 bytes).

    libjpeg decodes it as a huge image filled in after a 'premature end of data' warning."""
    data = bytearray(rgb_to_compressed_fields(np.zeros((8, 8, 3), np.uint8), "jpeg")["data"])
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    data[i + 5:i + 9] = struct.pack(">HH", height, width)
    return bytes(data)
