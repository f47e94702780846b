"""The one implementation of crop / resize, shared by prepare, evaluate and the server.

PIL + numpy only (no torch), so the inference image does not need the training stack. Normalisation
(mean/std) lives inside the model, so every consumer feeds the same uint8 pixels.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

Box = tuple[int, int, int, int]  # x1, y1, x2, y2 as in GTSRB's CSVs (inclusive corners)

# Big enough for any real photo of a sign, small enough that a hostile header cannot exhaust memory.
MAX_PIXELS = 4096 * 4096


class BadImage(ValueError):
    """The bytes or file are not a decodable image (or are too large to decode safely)."""


def box_with_margin(box: Box, margin: float, width: int, height: int) -> Box:
    """Grow an inclusive ROI box by `margin` x its size on each side, clipped to the image.

    GTSRB images keep about 10% of background around the sign, so margin 0.1 gives roughly the
    whole image: the model then learns what the server will be sent (whole sign images).
    """
    x1, y1, x2, y2 = box
    if not (0 <= x1 <= x2 and 0 <= y1 <= y2):
        raise BadImage(f"invalid ROI box {box}")
    dx = round((x2 - x1 + 1) * margin)
    dy = round((y2 - y1 + 1) * margin)
    return (max(0, x1 - dx), max(0, y1 - dy), min(width - 1, x2 + dx), min(height - 1, y2 + dy))


def to_array(image: Image.Image, size: int, box: Box | None = None, margin: float = 0.1) -> np.ndarray:
    """Crop (to `box` grown by `margin`, or the whole image) and resize to size x size RGB uint8 (HWC)."""
    image = image.convert("RGB")
    if box is not None:
        x1, y1, x2, y2 = box_with_margin(box, margin, image.width, image.height)
        image = image.crop((x1, y1, x2 + 1, y2 + 1))
    # PIL's bilinear filter antialiases when shrinking, so small and large sources look alike.
    image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8)


def peek_image(source: str | bytes | io.BytesIO, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Open an image file or bytes and read its header only (size checked against `max_pixels`);
    `load_image` decodes it. Any failure becomes BadImage."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        image = Image.open(source)
        if image.width * image.height > max_pixels:
            raise BadImage(f"image is {image.width}x{image.height}, larger than {max_pixels} pixels")
    except BadImage:
        raise
    except Image.DecompressionBombError:  # PIL's own guard, for headers far beyond max_pixels
        raise BadImage(f"image is larger than {max_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadImage(f"cannot decode image: {exc}") from None
    return image


def load_image(image: Image.Image) -> Image.Image:
    """Decode an image opened by `peek_image` now: truncated files fail here, not later."""
    try:
        image.load()
    except Image.DecompressionBombError:
        raise BadImage("image is too large to decode") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadImage(f"cannot decode image: {exc}") from None
    return image


def open_image(source: str | bytes | io.BytesIO, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Open and fully decode an image file or bytes; any failure becomes BadImage."""
    return load_image(peek_image(source, max_pixels))
