import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from pipeline.preprocess import BadImage, box_with_margin, open_image, to_array


def test_margin_grows_box_and_clips_to_image() -> None:
    assert box_with_margin((10, 10, 29, 29), 0.1, 100, 100) == (8, 8, 31, 31)
    assert box_with_margin((1, 2, 38, 37), 0.5, 40, 40) == (0, 0, 39, 39)
    assert box_with_margin((5, 5, 14, 14), 0.0, 20, 20) == (5, 5, 14, 14)


def test_invalid_box_is_rejected() -> None:
    with pytest.raises(BadImage):
        box_with_margin((10, 10, 5, 20), 0.1, 30, 30)


def test_to_array_crops_the_box_then_resizes() -> None:
    pixels = np.zeros((40, 40, 3), dtype=np.uint8)
    pixels[10:30, 10:30] = (255, 0, 0)  # a red sign in a black frame
    out = to_array(Image.fromarray(pixels), 16, box=(10, 10, 29, 29), margin=0.0)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8
    assert (out[..., 0] == 255).all() and (out[..., 1:] == 0).all()
    whole = to_array(Image.fromarray(pixels), 16)
    assert whole[0, 0, 0] == 0  # without a box the frame stays


def test_to_array_converts_grey_and_alpha_to_rgb() -> None:
    assert to_array(Image.new("L", (30, 20), 128), 8).shape == (8, 8, 3)
    assert to_array(Image.new("RGBA", (30, 20)), 8).shape == (8, 8, 3)


def _png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_open_image_rejects_garbage_and_truncation() -> None:
    with pytest.raises(BadImage):
        open_image(b"not an image at all")
    data = _png_bytes(64, 64)
    with pytest.raises(BadImage):
        open_image(data[: len(data) // 2])
    assert open_image(data).size == (64, 64)


def _png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return head + struct.pack(">I", 0) + b"IDAT" + struct.pack(">I", zlib.crc32(b"IDAT"))  # empty data


def test_open_image_refuses_huge_dimensions_before_decoding() -> None:
    # Headers claiming 5000^2 and 100000^2 pixels: refused from the header, nothing is allocated.
    with pytest.raises(BadImage, match="5000x5000, larger than"):
        open_image(_png_header(5000, 5000))
    with pytest.raises(BadImage):
        open_image(_png_header(100_000, 100_000))


def test_16_bit_grey_is_scaled_to_8_bits_not_clipped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    from PIL import Image

    from pipeline.preprocess import open_image, to_array

    grey = np.full((8, 8), 128 * 257, dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "grey16.png")
    image = open_image(str(tmp_path / "grey16.png"))
    assert image.mode.startswith("I")
    assert np.abs(to_array(image, 8).astype(int) - 128).max() <= 1
