"""Image message conversion: every encoding, padding, 16-bit byte order, and each error kind."""

from __future__ import annotations

import array
import io
import resource
from types import SimpleNamespace

import numpy as np
import pytest

from inf_mllm_ros.image_conversion import (
    DEFAULT_MAX_DECODED_PIXELS,
    ImageConversionError,
    compressed_header,
    compressed_msg_to_rgb,
    image_msg_to_rgb,
    msg_to_rgb,
    rgb_to_compressed_fields,
    rgb_to_image_fields,
)
from image_bombs import jpeg_bomb, png_bomb, png_chunk, png_header_only

H, W = 6, 5


def _colour_image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(H, W, 3), dtype=np.uint8)


def _grey_image(seed: int = 0) -> np.ndarray:
    """R = G = B, so the grey encodings round-trip exactly."""
    grey = np.random.default_rng(seed).integers(0, 256, size=(H, W, 1), dtype=np.uint8)
    return np.repeat(grey, 3, axis=2)


def _plain_msg(**fields) -> SimpleNamespace:
    fields.setdefault("is_bigendian", 0)
    return SimpleNamespace(**fields)


COLOUR_ENCODINGS = ["rgb8", "bgr8", "rgba8", "bgra8", "8UC3", "8UC4"]
GREY_ENCODINGS = ["mono8", "8UC1", "mono16"]


@pytest.mark.parametrize("encoding", COLOUR_ENCODINGS + GREY_ENCODINGS)
@pytest.mark.parametrize("padding", [0, 3])
def test_round_trip(encoding: str, padding: int) -> None:
    rgb = _grey_image() if encoding in GREY_ENCODINGS else _colour_image()
    fields = rgb_to_image_fields(rgb, encoding, row_padding=padding)
    assert fields["step"] > W or padding == 0
    out = image_msg_to_rgb(_plain_msg(**fields))
    np.testing.assert_array_equal(out, rgb)
    assert out.flags.c_contiguous


def test_channel_order_is_rgb() -> None:
    red = np.zeros((1, 1, 3), np.uint8)
    red[..., 0] = 200
    bgr = _plain_msg(height=1, width=1, encoding="bgr8", step=3, data=bytes([0, 0, 200]))
    np.testing.assert_array_equal(image_msg_to_rgb(bgr), red)
    bgra = _plain_msg(height=1, width=1, encoding="bgra8", step=4, data=bytes([0, 0, 200, 7]))
    np.testing.assert_array_equal(image_msg_to_rgb(bgra), red)


@pytest.mark.parametrize("bigendian", [False, True])
def test_mono16_byte_order(bigendian: bool) -> None:
    values = np.array([[0, 255, 256, 65535]], dtype=np.uint16)
    data = values.astype(">u2" if bigendian else "<u2").tobytes()
    msg = _plain_msg(height=1, width=4, encoding="mono16", step=8, data=data,
                     is_bigendian=int(bigendian))
    np.testing.assert_array_equal(image_msg_to_rgb(msg)[0, :, 0], [0, 0, 1, 255])


def test_depth_16uc1_is_stretched_and_keeps_missing_black() -> None:
    depth = np.array([[0, 1000, 1500, 2000]], dtype="<u2")
    msg = _plain_msg(height=1, width=4, encoding="16UC1", step=8, data=depth.tobytes())
    out = image_msg_to_rgb(msg)[0, :, 0]
    assert out[0] == 0 and out[1] == 1 and out[3] == 255 and 1 < out[2] < 255


def test_result_never_aliases_the_message_buffer() -> None:
    rgb = _colour_image()
    buf = bytearray(rgb_to_image_fields(rgb)["data"])
    out = image_msg_to_rgb(_plain_msg(height=H, width=W, encoding="rgb8", step=W * 3, data=buf))
    buf[:] = bytes(len(buf))  # the publisher reuses its buffer
    np.testing.assert_array_equal(out, rgb)
    # Same for a numpy buffer as rosbags gives.
    arr = np.frombuffer(rgb_to_image_fields(rgb)["data"], np.uint8).copy()
    out = image_msg_to_rgb(_plain_msg(height=H, width=W, encoding="rgb8", step=W * 3, data=arr))
    assert not np.shares_memory(out, arr)
    assert out.flags.writeable


def test_extra_trailing_bytes_are_ignored() -> None:
    rgb = _colour_image()
    fields = rgb_to_image_fields(rgb)
    fields["data"] += b"\x00" * 7
    np.testing.assert_array_equal(image_msg_to_rgb(_plain_msg(**fields)), rgb)


def _error(msg, fn=image_msg_to_rgb) -> ImageConversionError:
    with pytest.raises(ImageConversionError) as info:
        fn(msg)
    assert isinstance(info.value, ValueError)
    return info.value


def test_error_empty() -> None:
    err = _error(_plain_msg(height=0, width=4, encoding="rgb8", step=12, data=b""))
    assert err.kind == "empty" and "height 0" in str(err)
    err = _error(_plain_msg(height=2, width=4, encoding="rgb8", step=12, data=b""))
    assert err.kind == "empty" and "data is empty" in str(err)


def test_error_encoding() -> None:
    err = _error(_plain_msg(height=2, width=2, encoding="yuv422", step=4, data=b"\0" * 8))
    assert err.kind == "encoding" and "'yuv422'" in str(err) and "rgb8" in str(err)


def test_error_step_too_small() -> None:
    err = _error(_plain_msg(height=2, width=64, encoding="rgb8", step=100, data=b"\0" * 400))
    assert err.kind == "size"
    assert str(err) == "step 100 is smaller than width 64 x 3 bytes for rgb8"


def test_error_data_too_short() -> None:
    err = _error(_plain_msg(height=4, width=4, encoding="mono16", step=8, data=b"\0" * 31))
    assert err.kind == "size" and "31 bytes" in str(err) and "32" in str(err)


def test_error_kind_is_validated_and_survives_pickle() -> None:
    import pickle

    with pytest.raises(ValueError):
        ImageConversionError("other", "x")
    again = pickle.loads(pickle.dumps(ImageConversionError("size", "too small")))
    assert again.kind == "size" and str(again) == "too small"


# --- compressed ---------------------------------------------------------------------------

def _smooth_image(h: int = 32, w: int = 48) -> np.ndarray:
    """A smooth gradient: JPEG keeps it close, so colours can be checked."""
    ys, xs = np.mgrid[0:h, 0:w]
    return np.stack([xs * 5, ys * 7, np.full_like(xs, 128)], axis=2).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["jpeg", "rgb8; jpeg compressed bgr8", "png",
                                 "bgr8; png compressed bgr8", ""])
def test_compressed_round_trip(fmt: str) -> None:
    rgb = _smooth_image()
    fields = rgb_to_compressed_fields(rgb, fmt or "png", quality=95)
    fields["format"] = fmt
    out = compressed_msg_to_rgb(SimpleNamespace(**fields))
    assert out.shape == rgb.shape and out.dtype == np.uint8 and out.flags.c_contiguous
    tolerance = 0 if "png" in fmt or not fmt else 6
    assert np.abs(out.astype(int) - rgb.astype(int)).mean() <= tolerance


def test_compressed_keeps_colour_order() -> None:
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 0] = 220
    out = compressed_msg_to_rgb(SimpleNamespace(**rgb_to_compressed_fields(red, "jpeg")))
    assert out[8, 8, 0] > 200 and out[8, 8, 2] < 30


def test_compressed_errors() -> None:
    err = _error(SimpleNamespace(format="jpeg", data=b""), compressed_msg_to_rgb)
    assert err.kind == "empty"
    err = _error(SimpleNamespace(format="jpeg", data=b"not a jpeg at all"), compressed_msg_to_rgb)
    assert err.kind == "decode" and "17 bytes" in str(err)
    jpeg = rgb_to_compressed_fields(_smooth_image(), "jpeg")["data"]
    err = _error(SimpleNamespace(format="jpeg", data=jpeg[:20]), compressed_msg_to_rgb)
    assert err.kind == "decode"
    err = _error(SimpleNamespace(format="16UC1; compressedDepth", data=jpeg),
                 compressed_msg_to_rgb)
    assert err.kind == "encoding" and "compressedDepth" in str(err)
    err = _error(SimpleNamespace(format="tiff", data=jpeg), compressed_msg_to_rgb)
    assert err.kind == "encoding"


def test_msg_to_rgb_dispatches() -> None:
    rgb = _smooth_image()
    raw = _plain_msg(**rgb_to_image_fields(rgb))
    comp = SimpleNamespace(**rgb_to_compressed_fields(rgb, "png"))
    np.testing.assert_array_equal(msg_to_rgb(raw), rgb)
    np.testing.assert_array_equal(msg_to_rgb(comp), rgb)


# --- compressed frames that must not be decoded ------------------------------------------

def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


@pytest.mark.parametrize("fmt,make", [("png", png_bomb), ("jpeg", jpeg_bomb)])
def test_a_decompression_bomb_is_refused_before_it_is_decoded(fmt, make) -> None:
    bomb = make(30000, 30000)
    assert len(bomb) < 200_000
    assert compressed_header(bomb)[1:3] == (30000, 30000)
    before = _peak_rss_mb()
    err = _error(SimpleNamespace(format=fmt, data=bomb), compressed_msg_to_rgb)
    grew = _peak_rss_mb() - before
    assert err.kind == "too_large"
    assert "30000x30000" in str(err) and str(DEFAULT_MAX_DECODED_PIXELS) in str(err)
    # Decoding it would take 2.7 GB for the RGB pixels alone.
    assert grew < 200, f"peak memory grew by {grew:.0f} MB"


def test_the_largest_jpeg_is_refused_too() -> None:
    bomb = jpeg_bomb(65535, 65535)
    assert _error(SimpleNamespace(format="jpeg", data=bomb), compressed_msg_to_rgb).kind == "too_large"


def test_the_bound_is_on_decoded_pixels_and_a_4k_frame_passes_it() -> None:
    # A header-only PNG: within the bound it gets as far as decoding (and fails there, having no pixels).
    assert _error(SimpleNamespace(format="png", data=png_header_only(3840, 2160)),
                  compressed_msg_to_rgb).kind == "decode"
    assert _error(SimpleNamespace(format="png", data=png_header_only(3841, 2160)),
                  compressed_msg_to_rgb).kind == "too_large"
    small = SimpleNamespace(**rgb_to_compressed_fields(_smooth_image(32, 48), "png"))
    assert compressed_msg_to_rgb(small, max_pixels=32 * 48).shape == (32, 48, 3)
    err = _error(small, lambda m: compressed_msg_to_rgb(m, max_pixels=32 * 48 - 1))
    assert err.kind == "too_large" and "48x32" in str(err)
    assert msg_to_rgb(small, max_decoded_pixels=None).shape == (32, 48, 3)
    assert _error(small, lambda m: msg_to_rgb(m, max_decoded_pixels=100)).kind == "too_large"


@pytest.mark.parametrize("claimed,actual", [("jpeg", "png"), ("png", "jpeg"), ("bgr8; jpeg compressed bgr8", "png"),
                                            ("rgb8; png compressed rgb8", "jpeg")])
def test_bytes_that_are_not_what_the_format_says_are_refused(claimed, actual) -> None:
    data = rgb_to_compressed_fields(_smooth_image(), actual)["data"]
    err = _error(SimpleNamespace(format=claimed, data=data), compressed_msg_to_rgb)
    assert err.kind == "format_mismatch"
    assert repr(claimed) in str(err) and f"are {actual}" in str(err)
    # Without a claim the bytes say what they are.
    assert compressed_msg_to_rgb(SimpleNamespace(format="", data=data)).shape == (32, 48, 3)


def test_headers_are_read_without_decoding() -> None:
    from PIL import Image

    rgb = _smooth_image(30, 50)
    assert compressed_header(rgb_to_compressed_fields(rgb, "png")["data"]) == ("png", 50, 30, 3)
    assert compressed_header(rgb_to_compressed_fields(rgb, "jpeg")["data"]) == ("jpeg", 50, 30, 3)
    import cv2

    ok, progressive = cv2.imencode(".jpg", rgb, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    assert ok and compressed_header(progressive.tobytes()) == ("jpeg", 50, 30, 3)
    # EXIF and comment segments before the frame header; a grey JPEG; RGBA and 16-bit PNGs.
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x010F] = "camera maker " * 200
    Image.fromarray(rgb[:, :, 0]).save(out, "JPEG", exif=exif, comment=b"x" * 5000)
    assert compressed_header(out.getvalue()) == ("jpeg", 50, 30, 1)
    out = io.BytesIO()
    Image.fromarray(np.dstack([rgb, rgb[:, :, :1]]), "RGBA").save(out, "PNG")
    assert compressed_header(out.getvalue()) == ("png", 50, 30, 4)


@pytest.mark.parametrize("data,words", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "too short"),
    (png_header_only(0, 10), "empty image"),
    (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IDAT", bytes(13)), "IHDR"),
    (b"\xff\xd8\xff\xd9", "before its frame header"),
    (b"\xff\xd8\xff\xe0\x00", "segment header"),
    (b"\xff\xd8\xff\xe0\x00\x01", "invalid length"),
    (b"\xff\xd8\xff\xc0\x00\x11\x08\x00", "truncated"),
    (b"\xff\xd8\xff\xe0\x00\x04ab\x12", "no marker"),
    (b"GIF89a", "neither PNG nor JPEG"),
])
def test_malformed_headers_are_decode_errors(data, words) -> None:
    with pytest.raises(ImageConversionError) as info:
        compressed_header(data)
    assert info.value.kind == "decode" and words in str(info.value), str(info.value)
    err = _error(SimpleNamespace(format="", data=data), compressed_msg_to_rgb)
    assert err.kind == "decode"


def test_slightly_corrupt_jpeg_decodes_without_writing_to_stderr(capfd) -> None:
    jpeg = rgb_to_compressed_fields(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8),
                                    "jpeg")["data"]
    cut = jpeg[: len(jpeg) // 2] + b"\xff\xd9"  # half the scan lost: libjpeg warns "Corrupt JPEG data"
    capfd.readouterr()
    for _ in range(3):
        assert compressed_msg_to_rgb(SimpleNamespace(format="jpeg", data=cut)).shape == (64, 64, 3)
    # A PNG whose text chunk is damaged is refused, also without a word on stderr.
    png = rgb_to_compressed_fields(_smooth_image(), "png")["data"]
    bad_text = png[:33] + png_chunk(b"tEXt", b"Comment\x00hi")[:-4] + b"\x00\x00\x00\x01" + png[33:]
    _error(SimpleNamespace(format="png", data=bad_text), compressed_msg_to_rgb)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_compressed_modes_become_rgb() -> None:
    from PIL import Image

    def png(image: Image.Image) -> SimpleNamespace:
        out = io.BytesIO()
        image.save(out, "PNG")
        return SimpleNamespace(format="png", data=out.getvalue())

    wide = np.array([[0, 255, 256, 65535]], dtype=np.uint16)
    out = compressed_msg_to_rgb(png(Image.fromarray(wide)))  # 16-bit grey: top 8 bits, as mono16
    np.testing.assert_array_equal(out[0, :, 0], [0, 0, 1, 255])
    np.testing.assert_array_equal(out[..., 0], out[..., 2])
    rgb = _smooth_image()
    rgba = Image.fromarray(np.dstack([rgb, np.full(rgb.shape[:2], 7, np.uint8)]), "RGBA")
    np.testing.assert_array_equal(compressed_msg_to_rgb(png(rgba)), rgb)
    palette = Image.fromarray(rgb).quantize(16)
    np.testing.assert_array_equal(compressed_msg_to_rgb(png(palette)), np.asarray(palette.convert("RGB")))
    grey = compressed_msg_to_rgb(SimpleNamespace(**rgb_to_compressed_fields(_grey_image(), "png")))
    np.testing.assert_array_equal(grey, _grey_image())
    decoded = compressed_msg_to_rgb(SimpleNamespace(**rgb_to_compressed_fields(_smooth_image(), "png")))
    assert decoded.flags.writeable and decoded.flags.c_contiguous and decoded.flags.owndata


# --- real message classes ------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["rgb8", "bgra8", "mono8", "mono16"])
def test_rclpy_image_messages(encoding: str) -> None:
    sensor_msgs = pytest.importorskip("sensor_msgs.msg")
    rgb = _grey_image(3) if encoding.startswith("mono") else _colour_image(3)
    fields = rgb_to_image_fields(rgb, encoding, row_padding=2)
    msg = sensor_msgs.Image()
    msg.height, msg.width, msg.encoding = fields["height"], fields["width"], encoding
    msg.is_bigendian, msg.step = fields["is_bigendian"], fields["step"]
    msg.data = fields["data"]
    assert isinstance(msg.data, array.array)
    out = image_msg_to_rgb(msg)
    np.testing.assert_array_equal(out, rgb)
    msg.data[0] ^= 0xFF  # mutating the message must not change the result
    np.testing.assert_array_equal(out, rgb)


def test_rclpy_compressed_message() -> None:
    sensor_msgs = pytest.importorskip("sensor_msgs.msg")
    rgb = _smooth_image()
    msg = sensor_msgs.CompressedImage()
    msg.format = "png"
    msg.data = rgb_to_compressed_fields(rgb, "png")["data"]
    np.testing.assert_array_equal(compressed_msg_to_rgb(msg), rgb)
    np.testing.assert_array_equal(msg_to_rgb(msg), rgb)


def test_rosbags_deserialized_messages() -> None:
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    Image = store.types["sensor_msgs/msg/Image"]
    Header = store.types["std_msgs/msg/Header"]
    Time = store.types["builtin_interfaces/msg/Time"]
    rgb = _colour_image(5)
    fields = rgb_to_image_fields(rgb, "bgr8", row_padding=4)
    fields["data"] = np.frombuffer(fields["data"], np.uint8)
    msg = Image(header=Header(stamp=Time(sec=1, nanosec=2), frame_id="cam"), **fields)
    again = store.deserialize_cdr(store.serialize_cdr(msg, Image.__msgtype__), Image.__msgtype__)
    np.testing.assert_array_equal(image_msg_to_rgb(again), rgb)
