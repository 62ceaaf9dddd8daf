"""What every image conversion shares: the error it raises and a message's ``data`` read as bytes.

``data`` may be ``bytes``, ``bytearray``, ``array.array('B')`` (rclpy), a ``numpy.uint8`` array (rosbags)
or a plain list of ints.
"""

from __future__ import annotations

from typing import Any

import numpy as np


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


def as_bytes_view(data: Any) -> np.ndarray:
    """A read-only uint8 view of any buffer-like ``data`` (no copy where possible)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    except TypeError:
        # A plain list of ints, as a hand-built message may carry.
        return np.asarray(data, dtype=np.uint8).reshape(-1)
