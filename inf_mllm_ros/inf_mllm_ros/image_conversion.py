"""Turn ROS image messages into RGB numpy arrays, without ROS.

The functions are duck-typed: they read only the message fields (``height``, ``width``,
``encoding``, ``is_bigendian``, ``step``, ``data`` for ``sensor_msgs/msg/Image``;
``format`` and ``data`` for ``sensor_msgs/msg/CompressedImage``), so rclpy messages and
messages deserialized by ``rosbags`` work alike. ``data`` may be ``bytes``, ``bytearray``,
``array.array('B')`` (rclpy) or a ``numpy.uint8`` array (rosbags).

Every result is a fresh, C-contiguous ``numpy.uint8`` array of shape (H, W, 3) in RGB order:
it never aliases the message buffer, so a caller may keep it after the message is reused.

Compressed frames are checked before they are decoded: the width and height a PNG (IHDR) or a
JPEG (frame header) declares are read from the bytes, and a frame above ``max_pixels`` is refused
without allocating its pixels, so a small file that declares a huge image cannot exhaust memory.
They are decoded by Pillow, which never writes libjpeg's or libpng's warnings about slightly
corrupt data to stderr.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_DECODED_PIXELS",
    "ImageConversionError",
    "SUPPORTED_ENCODINGS",
    "compressed_header",
    "compressed_msg_to_rgb",
    "image_msg_to_rgb",
    "msg_to_rgb",
    "rgb_to_compressed_fields",
    "rgb_to_image_fields",
]


class ImageConversionError(ValueError):
    """An image message could not be turned into an RGB array.

    ``kind`` is a short, stable category, so a caller can log once per kind:
    ``"empty"`` (no pixels or no data), ``"encoding"`` (encoding or format not supported),
    ``"size"`` (step or data length inconsistent with width and height),
    ``"decode"`` (compressed payload could not be decoded),
    ``"too_large"`` (a compressed frame declares more pixels than allowed; refused before decoding),
    ``"format_mismatch"`` (the compressed bytes are PNG but the message says JPEG, or the reverse).
    """

    KINDS = ("empty", "encoding", "size", "decode", "too_large", "format_mismatch")

    def __init__(self, kind: str, message: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown ImageConversionError kind {kind!r}")
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        # Keeps the kind when the error crosses a process boundary (pickle).
        return type(self), (self.kind, str(self))


@dataclass(frozen=True)
class _Layout:
    """How one raw encoding stores a pixel."""

    channels: int
    bytes_per_channel: int
    # Indices into the stored channels that give R, G, B (None: single channel, grey).
    rgb_order: tuple[int, int, int] | None

    @property
    def bytes_per_pixel(self) -> int:
        return self.channels * self.bytes_per_channel


# 8UC1/8UC3/8UC4 follow cv_bridge's reading of them (grey, BGR, BGRA).
_LAYOUTS: dict[str, _Layout] = {
    "rgb8": _Layout(3, 1, (0, 1, 2)),
    "bgr8": _Layout(3, 1, (2, 1, 0)),
    "rgba8": _Layout(4, 1, (0, 1, 2)),
    "bgra8": _Layout(4, 1, (2, 1, 0)),
    "mono8": _Layout(1, 1, None),
    "8uc1": _Layout(1, 1, None),
    "8uc3": _Layout(3, 1, (2, 1, 0)),
    "8uc4": _Layout(4, 1, (2, 1, 0)),
    "mono16": _Layout(1, 2, None),
    "16uc1": _Layout(1, 2, None),
}

SUPPORTED_ENCODINGS: tuple[str, ...] = (
    "rgb8", "bgr8", "rgba8", "bgra8", "mono8", "mono16", "16UC1", "8UC1", "8UC3", "8UC4",
)


def _as_bytes_view(data: Any) -> np.ndarray:
    """A read-only uint8 view of any buffer-like ``data`` (no copy where possible)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    except TypeError:
        # A plain list of ints, as a hand-built message may carry.
        return np.asarray(data, dtype=np.uint8).reshape(-1)


def _encoding_name(msg: Any) -> str:
    encoding = getattr(msg, "encoding", "")
    return encoding if isinstance(encoding, str) else str(encoding)


def image_msg_to_rgb(msg: Any) -> np.ndarray:
    """Convert a raw ``sensor_msgs/msg/Image`` into an (H, W, 3) RGB uint8 array.

    Supported encodings: rgb8, bgr8, rgba8, bgra8 (alpha dropped), mono8, 8UC1/8UC3/8UC4,
    mono16 (top 8 bits kept) and 16UC1 (depth: the valid, non-zero range of the frame is
    stretched to 1..255, zeros stay black). Row padding (``step``) and ``is_bigendian`` are
    honoured.

    Raises:
        ImageConversionError: with ``kind`` "empty", "encoding" or "size".
    """
    height, width = int(msg.height), int(msg.width)
    encoding = _encoding_name(msg)
    # A default-constructed message is "empty" rather than of an unknown encoding.
    if height <= 0 or width <= 0:
        raise ImageConversionError(
            "empty", f"image has no pixels: width {width}, height {height} ({encoding!r})")
    layout = _LAYOUTS.get(encoding.lower())
    if layout is None:
        raise ImageConversionError(
            "encoding",
            f"unsupported encoding {encoding!r}; supported: {', '.join(SUPPORTED_ENCODINGS)}",
        )
    data = _as_bytes_view(msg.data)
    if data.size == 0:
        raise ImageConversionError("empty", f"image data is empty for {width}x{height} {encoding}")

    row_bytes = width * layout.bytes_per_pixel
    step = int(msg.step)
    if step < row_bytes:
        raise ImageConversionError(
            "size",
            f"step {step} is smaller than width {width} x {layout.bytes_per_pixel} bytes "
            f"for {encoding}",
        )
    if data.size < step * height:
        raise ImageConversionError(
            "size",
            f"data has {data.size} bytes, fewer than step {step} x height {height} = "
            f"{step * height} for {width}x{height} {encoding}",
        )

    # Cut the row padding off; extra bytes after the last row are ignored.
    rows = data[: step * height].reshape(height, step)[:, :row_bytes]
    if layout.bytes_per_channel == 1:
        pixels = rows.reshape(height, width, layout.channels)
    else:
        dtype = np.dtype(">u2" if int(msg.is_bigendian) else "<u2")
        wide = np.ascontiguousarray(rows).view(dtype).reshape(height, width)
        pixels = _sixteen_to_eight(wide, depth=encoding.lower() == "16uc1")[:, :, None]

    if layout.rgb_order is None:
        rgb = np.repeat(pixels[:, :, :1], 3, axis=2)
    else:
        rgb = pixels[:, :, list(layout.rgb_order)]
    # Fancy indexing and repeat already copy; this guarantees contiguity and ownership.
    return np.array(rgb, dtype=np.uint8, order="C", copy=True)


def _sixteen_to_eight(wide: np.ndarray, *, depth: bool) -> np.ndarray:
    """Scale 16-bit pixels to 8 bit: a fixed shift for mono16, a per-frame stretch for depth."""
    if not depth:
        return (wide >> 8).astype(np.uint8)
    valid = wide > 0
    if not valid.any():
        return np.zeros(wide.shape, dtype=np.uint8)
    low, high = int(wide[valid].min()), int(wide[valid].max())
    span = max(high - low, 1)
    # Valid depths map to 1..255 so that they stay distinguishable from missing (0) ones.
    scaled = 1.0 + (wide.astype(np.float32) - low) * (254.0 / span)
    return np.where(valid, np.clip(np.rint(scaled), 1, 255), 0).astype(np.uint8)


def _compressed_kind(fmt: str) -> str | None:
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
    buf = memoryview(_as_bytes_view(data))
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
    claimed = _compressed_kind(fmt)
    if claimed == "compressedDepth":
        raise ImageConversionError(
            "encoding", f"compressed format {fmt!r} (compressedDepth) is not supported; "
            "use jpeg or png",
        )
    if claimed is None and fmt.strip():
        raise ImageConversionError(
            "encoding", f"compressed format {fmt!r} names no supported codec (jpeg, png)",
        )
    data = _as_bytes_view(msg.data)
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


def msg_to_rgb(msg: Any, *, max_decoded_pixels: int | None = DEFAULT_MAX_DECODED_PIXELS) -> np.ndarray:
    """Convert either kind of image message: CompressedImage has ``format`` and no ``encoding``.

    ``max_decoded_pixels`` bounds a compressed frame (see :func:`compressed_msg_to_rgb`).
    """
    if hasattr(msg, "format") and not hasattr(msg, "encoding"):
        return compressed_msg_to_rgb(msg, max_pixels=max_decoded_pixels)
    return image_msg_to_rgb(msg)


def _check_rgb(rgb: np.ndarray) -> np.ndarray:
    rgb = np.asarray(rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected an (H, W, 3) uint8 array, got {rgb.shape} {rgb.dtype}")
    return rgb


def rgb_to_image_fields(
    rgb: np.ndarray,
    encoding: str = "rgb8",
    *,
    row_padding: int = 0,
    is_bigendian: bool = False,
) -> dict[str, Any]:
    """Fields of a ``sensor_msgs/msg/Image`` holding ``rgb`` in ``encoding``.

    Returns a dict with height, width, encoding, is_bigendian, step and data (bytes), ready for
    ``Image(**fields)`` after wrapping ``data`` as the message type needs. Mono encodings
    take the ITU-R 601 grey value; 16-bit ones scale it by 257 so that 255 maps to 65535.
    ``row_padding`` adds that many zero bytes to every row (a ``step`` larger than the pixels).
    """
    import cv2

    rgb = _check_rgb(rgb)
    layout = _LAYOUTS.get(encoding.lower())
    if layout is None:
        raise ImageConversionError("encoding", f"unsupported encoding {encoding!r}")
    height, width = rgb.shape[:2]
    if layout.rgb_order is None:
        grey = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
        if layout.bytes_per_channel == 2:
            wide = grey.astype(np.uint16) * 257
            pixels = wide.astype(">u2" if is_bigendian else "<u2").view(np.uint8)
        else:
            pixels = grey
        pixels = pixels.reshape(height, width * layout.bytes_per_pixel)
    else:
        stored = np.empty((height, width, layout.channels), dtype=np.uint8)
        stored[:, :, list(layout.rgb_order)] = rgb
        if layout.channels == 4:
            stored[:, :, 3] = 255
        pixels = stored.reshape(height, width * layout.channels)
    if row_padding:
        pixels = np.concatenate([pixels, np.zeros((height, row_padding), np.uint8)], axis=1)
    return {
        "height": height,
        "width": width,
        "encoding": encoding,
        "is_bigendian": int(bool(is_bigendian)),
        "step": int(pixels.shape[1]),
        "data": np.ascontiguousarray(pixels).tobytes(),
    }


def rgb_to_compressed_fields(rgb: np.ndarray, fmt: str = "jpeg", *, quality: int = 90) -> dict:
    """Fields of a ``sensor_msgs/msg/CompressedImage`` (``format``, ``data`` bytes) for ``rgb``."""
    import cv2

    rgb = _check_rgb(rgb)
    codec = _compressed_kind(fmt)
    if codec not in ("jpeg", "png"):
        raise ImageConversionError("encoding", f"cannot encode format {fmt!r}; use jpeg or png")
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)] if codec == "jpeg" else []
    ok, buf = cv2.imencode(".jpg" if codec == "jpeg" else ".png",
                           cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), params)
    if not ok:
        raise ImageConversionError(
            "decode", f"OpenCV could not encode a {rgb.shape} image as {codec}")
    return {"format": fmt, "data": buf.tobytes()}
