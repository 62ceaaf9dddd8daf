"""Compressed image messages (``sensor_msgs/msg/CompressedImage``, PNG or JPEG) into RGB numpy arrays.

Compressed frames are checked before they are decoded: the width and height a PNG (IHDR) or a
JPEG (frame header) declares are read from the bytes, and a frame above ``max_pixels`` is refused
without allocating its pixels, so a small file that declares a huge image cannot exhaust memory.
They are decoded by Pillow, which never writes libjpeg's or libpng's warnings about slightly
corrupt data to stderr.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .image_data import ImageConversionError, as_bytes_view


def compressed_kind(fmt: str) -> str | None:
    """The codec a CompressedImage ``format`` names ("jpeg", "png"), or None when it names none."""
    lowered = fmt.lower()
    if "compresseddepth" in lowered:
        return "compressedDepth"
    if "jpeg" in lowered or "jpg" in lowered:
        return "jpeg"
    if "png" in lowered:
        return "png"
    return None


# A 4K camera frame (3840 x 2160): the node's default bound on a compressed frame's decoded size.
DEFAULT_MAX_DECODED_PIXELS = 3840 * 2160

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8\xff"
# JPEG start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic).
# 0xC4 (DHT), 0xC8 (JPG) and 0xCC (DAC) share the range but are not frame headers.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# PNG colour type -> channels stored per pixel (a palette index expands to RGB when decoded).
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _sniff(buf: memoryview) -> str | None:
    """The codec the bytes are in, from their magic number: "png", "jpeg" or None."""
    if bytes(buf[:8]) == _PNG_SIGNATURE:
        return "png"
    if bytes(buf[:3]) == _JPEG_SOI:
        return "jpeg"
    return None


def _png_header(buf: memoryview) -> tuple[int, int, int]:
    # Signature, then the IHDR chunk: length 13, "IHDR", width, height, bit depth, colour type...
    if len(buf) < 8 + 8 + 13:
        raise ImageConversionError("decode", f"PNG of {len(buf)} bytes is too short to hold its header (IHDR)")
    length = int.from_bytes(buf[8:12], "big")
    if bytes(buf[12:16]) != b"IHDR" or length != 13:
        raise ImageConversionError("decode", "PNG does not start with its header chunk (IHDR)")
    width, height = int.from_bytes(buf[16:20], "big"), int.from_bytes(buf[20:24], "big")
    channels = _PNG_CHANNELS.get(buf[25])
    if channels is None:
        raise ImageConversionError("decode", f"PNG header has an invalid colour type {buf[25]}")
    return width, height, channels


def _jpeg_header(buf: memoryview) -> tuple[int, int, int]:
    # Walk the marker segments from SOI to the first frame header (SOFn): FF xx, then a 2-byte length
    # that counts itself, except for the markers that stand alone (TEM, RSTn). Fill bytes (FF) may
    # precede a marker. Each step moves forward, so this reads each byte at most once.
    n, i = len(buf), 2
    while True:
        if i >= n:
            raise ImageConversionError("decode", f"JPEG of {n} bytes ends before its frame header (SOF)")
        if buf[i] != 0xFF:
            raise ImageConversionError("decode", f"JPEG has no marker at byte {i} (found 0x{buf[i]:02x})")
        while i < n and buf[i] == 0xFF:
            i += 1
        if i >= n:
            raise ImageConversionError("decode", f"JPEG of {n} bytes ends before its frame header (SOF)")
        marker = buf[i]
        i += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue
        if marker in (0xD8, 0xD9, 0xDA) or marker == 0x00:
            raise ImageConversionError("decode", f"JPEG reaches marker 0x{marker:02x} before its frame header (SOF)")
        if i + 2 > n:
            raise ImageConversionError("decode", f"JPEG of {n} bytes ends inside a segment header")
        length = (buf[i] << 8) | buf[i + 1]
        if length < 2:
            raise ImageConversionError("decode", f"JPEG segment 0x{marker:02x} has an invalid length {length}")
        if marker in _JPEG_SOF:
            if length < 8 or i + 8 > n:
                raise ImageConversionError("decode", "JPEG frame header (SOF) is truncated")
            height = (buf[i + 3] << 8) | buf[i + 4]
            width = (buf[i + 5] << 8) | buf[i + 6]
            return width, height, buf[i + 7]
        i += length


def compressed_header(data: Any) -> tuple[str, int, int, int]:
    """(codec, width, height, channels) of a PNG or JPEG, read from its header bytes without decoding.

    ``codec`` is "png" or "jpeg", from the magic number (not from a format string); ``channels`` is
    what the file stores per pixel (1 grey, 3 colour, 4 CMYK or RGBA...).

    Raises:
        ImageConversionError: "empty" for no data; "decode" for bytes that are neither PNG nor
        JPEG, a header that is cut short or malformed, or a zero width or height.
    """
    buf = memoryview(as_bytes_view(data))
    if len(buf) == 0:
        raise ImageConversionError("empty", "compressed image data is empty")
    codec = _sniff(buf)
    if codec is None:
        raise ImageConversionError(
            "decode", f"{len(buf)} bytes are neither PNG nor JPEG (they start with {bytes(buf[:8])!r})")
    width, height, channels = (_png_header if codec == "png" else _jpeg_header)(buf)
    if width <= 0 or height <= 0:
        raise ImageConversionError("decode", f"{codec.upper()} header declares an empty image ({width}x{height})")
    return codec, width, height, channels


def compressed_msg_to_rgb(msg: Any, *, max_pixels: int | None = DEFAULT_MAX_DECODED_PIXELS) -> np.ndarray:
    """Decode a ``sensor_msgs/msg/CompressedImage`` (JPEG or PNG) into an (H, W, 3) RGB array.

    ``format`` may be a bare codec ("jpeg", "png") or image_transport's long form
    ("rgb8; jpeg compressed bgr8"). An empty format is accepted: the payload is sniffed. A format
    that names one codec while the bytes are the other is refused.

    The width and height the header declares are checked against ``max_pixels`` (None: no bound)
    before anything is decoded. Grey, palette, alpha and CMYK images become RGB (alpha dropped);
    16-bit samples keep their top 8 bits; an EXIF orientation is applied.

    Raises:
        ImageConversionError: with ``kind`` "empty", "encoding", "decode", "too_large" or
        "format_mismatch".
    """
    fmt = str(getattr(msg, "format", "") or "")
    claimed = compressed_kind(fmt)
    if claimed == "compressedDepth":
        raise ImageConversionError(
            "encoding", f"compressed format {fmt!r} (compressedDepth) is not supported; "
            "use jpeg or png",
        )
    if claimed is None and fmt.strip():
        raise ImageConversionError(
            "encoding", f"compressed format {fmt!r} names no supported codec (jpeg, png)",
        )
    data = as_bytes_view(msg.data)
    if data.size == 0:
        raise ImageConversionError("empty", f"compressed image data is empty (format {fmt!r})")
    buf = memoryview(data)
    actual = _sniff(buf)
    if actual is None:
        raise ImageConversionError(
            "decode", f"could not decode {data.size} bytes as {claimed or 'an image'} (format {fmt!r}): "
            f"they are neither PNG nor JPEG (they start with {bytes(buf[:8])!r})",
        )
    if claimed is not None and actual != claimed:
        raise ImageConversionError(
            "format_mismatch", f"format {fmt!r} says {claimed} but the {data.size} bytes are {actual}; "
            "refused rather than decoded as something the sender did not say",
        )
    codec, width, height, _channels = compressed_header(data)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageConversionError(
            "too_large", f"{codec} of {data.size} bytes declares {width}x{height} = {width * height} pixels, "
            f"above the bound of {max_pixels} (max_decoded_pixels); refused without decoding",
        )
    try:
        rgb = _decode(bytes(buf), codec, (width, height))
    except ImageConversionError:
        raise
    except Exception as exc:  # Pillow reports corrupt data as OSError, SyntaxError, ValueError...
        raise ImageConversionError(
            "decode", f"could not decode {data.size} bytes as {codec} (format {fmt!r}): {exc}",
        ) from None
    return rgb


def _decode(payload: bytes, codec: str, size: tuple[int, int]) -> np.ndarray:
    """Pillow's decode of a PNG or JPEG whose header was read already, as an (H, W, 3) RGB array."""
    from PIL import Image, ImageOps  # Imported here so raw-image users do not pay for it.

    with Image.open(io.BytesIO(payload), formats=["PNG" if codec == "png" else "JPEG"]) as image:
        if image.size != size:
            raise ImageConversionError(
                "decode", f"{codec} header says {size[0]}x{size[1]} but the decoder reads {image.size[0]}x"
                f"{image.size[1]}")
        image.load()
        image = ImageOps.exif_transpose(image)  # (in_place needs Pillow 10; Ubuntu 22.04, for Humble, has 9.0)
        if image.mode.startswith("I"):  # 16-bit grey (PNG): the top 8 bits, as mono16
            wide = np.clip(np.asarray(image), 0, 65535).astype(np.uint16)
            grey = (wide >> 8).astype(np.uint8)
            return np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2))
        if image.mode != "RGB":
            image = image.convert("RGB")
        # np.array copies out of Pillow's buffer: the result is writable and owns its memory.
        return np.array(image, dtype=np.uint8, order="C", copy=True)
