"""Turn ROS image messages into RGB numpy arrays, without ROS.

The functions are duck-typed: they read only the message fields (``height``, ``width``,
``encoding``, ``is_bigendian``, ``step``, ``data`` for ``sensor_msgs/msg/Image``;
``format`` and ``data`` for ``sensor_msgs/msg/CompressedImage``), so rclpy messages and
messages deserialized by ``rosbags`` work alike. ``data`` may be ``bytes``, ``bytearray``,
``array.array('B')`` (rclpy) or a ``numpy.uint8`` array (rosbags).

Every result is a fresh, C-contiguous ``numpy.uint8`` array of shape (H, W, 3) in RGB order:
it never aliases the message buffer, so a caller may keep it after the message is reused.

Compressed frames are decoded in compressed_images.py, which checks the size a frame declares before
decoding it; the error and the reading of ``data`` are in image_data.py. Their names are importable
from here as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .compressed_images import DEFAULT_MAX_DECODED_PIXELS, compressed_header, compressed_kind, compressed_msg_to_rgb
from .image_data import ImageConversionError, as_bytes_view

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
    data = as_bytes_view(msg.data)
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
    codec = compressed_kind(fmt)
    if codec not in ("jpeg", "png"):
        raise ImageConversionError("encoding", f"cannot encode format {fmt!r}; use jpeg or png")
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)] if codec == "jpeg" else []
    ok, buf = cv2.imencode(".jpg" if codec == "jpeg" else ".png",
                           cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), params)
    if not ok:
        raise ImageConversionError(
            "decode", f"OpenCV could not encode a {rgb.shape} image as {codec}")
    return {"format": fmt, "data": buf.tobytes()}
