"""The one implementation of crop / resize, shared by prepare, evaluate and the server.

PIL + numpy only (no torch), so the inference image does not need the training stack. Normalisation
(mean/std) lives inside the model, so every consumer feeds the same uint8 pixels.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image, ImageFile

try:  # libspng: the server's PNG path 1.22-1.30x faster than with PIL (`python -m benchmarks decode`)
    import pyspng
except ImportError:  # pragma: no cover - PIL decodes every PNG as well
    pyspng = None

Box = tuple[int, int, int, int]  # x1, y1, x2, y2, inclusive corners (as annotation CSVs give them)
Crop = tuple[float, float, float, float]  # fractions of the width / height cut at the left, top, right, bottom
NO_CROP: Crop = (0.0, 0.0, 0.0, 0.0)

# Big enough for any real photo of a sign, small enough that a hostile header cannot exhaust memory.
MAX_PIXELS = 4096 * 4096
# The decoders PIL may use: the formats cameras, browsers and data sets (PPM) produce. The others (PSD, EPS,
# TGA, FITS, ...) are attack surface nobody needs here.
ACCEPTED_FORMATS = ("PNG", "JPEG", "PPM", "BMP", "WEBP", "GIF")


class BadImage(ValueError):
    """The bytes or file are not a decodable image (or are too large to decode safely)."""


class UnsupportedFormat(BadImage):
    """An image of a format the decoders do not take (HEIC, TIFF, ...): the server answers 415, naming them."""


def box_with_margin(box: Box, margin: float, width: int, height: int) -> Box:
    """Grow an inclusive ROI box by `margin` x its size on each side, clipped to the image."""
    x1, y1, x2, y2 = box
    if not (0 <= x1 <= x2 and 0 <= y1 <= y2):
        raise BadImage(f"invalid ROI box {box}")
    if x1 >= width or y1 >= height:
        raise BadImage(f"ROI box {box} starts outside the {width}x{height} image")
    x2, y2 = min(x2, width - 1), min(y2, height - 1)  # a box running past the edge: the part inside
    dx = round((x2 - x1 + 1) * margin)
    dy = round((y2 - y1 + 1) * margin)
    return (max(0, x1 - dx), max(0, y1 - dy), min(width - 1, x2 + dx), min(height - 1, y2 + dy))


RESIZE_MODES = ("stretch", "center_crop", "pad")
Resize = Literal["stretch", "center_crop", "pad"]
# The filters pretrained weights were made with (torchvision's weights.transforms(), timm's pretrained_cfg): PIL's,
# antialiased when shrinking, as both libraries' own PIL pipelines apply them.
INTERPOLATIONS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}
Interpolation = Literal["bilinear", "bicubic"]


def _fit_region(
    region: tuple[float, float, float, float], mode: Resize
) -> tuple[tuple[float, float, float, float], tuple[float, float]]:
    """The part of `region` (x1, y1, x2, y2 in source pixels) that a square output shows, and the fraction of the
    output's width / height it fills. stretch: all of it, squashed to a square; center_crop: the central square of
    the shorter side (nothing squashed, the edges of the longer side cut); pad: all of it, aspect kept, centred on
    black bands."""
    x1, y1, x2, y2 = region
    w, h = x2 - x1, y2 - y1
    if mode == "stretch" or w == h:
        return region, (1.0, 1.0)
    if mode == "center_crop":
        side = min(w, h)
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
        return (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2), (1.0, 1.0)
    return region, ((w / h, 1.0) if w < h else (1.0, h / w))


def to_array(
    image: Image.Image,
    size: int,
    box: Box | None = None,
    margin: float = 0.1,
    crop: Crop = NO_CROP,
    resize: Resize = "stretch",
    interpolation: Interpolation = "bilinear",
) -> np.ndarray:
    """Crop (to `box` grown by `margin`; without a box, the whole image less the `crop` fractions) and resize
    to size x size RGB uint8 (HWC), by `resize` (stretch | center_crop | pad: see _fit_region). Any mode becomes
    RGB; 16- and 32-bit grey levels are scaled to 8 bits (a plain convert would clip them to white). `interpolation`:
    the resize's filter (bilinear | bicubic), the one the model's pretrained weights expect."""
    resample = INTERPOLATIONS[interpolation]
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        pixels = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if image.mode.startswith("I;16") or pixels.max(initial=0) > 255 else 255.0
        image = Image.fromarray(np.clip(pixels * (255.0 / peak), 0, 255).round().astype(np.uint8), "L")
    if image.mode != "RGB":  # convert() of an RGB image would only copy it
        image = image.convert("RGB")
    region: tuple[float, float, float, float] | None = None
    if box is not None:
        x1, y1, x2, y2 = box_with_margin(box, margin, image.width, image.height)
        image = image.crop((x1, y1, x2 + 1, y2 + 1))
    elif crop != NO_CROP:
        left, top, right, bottom = crop
        w, h = image.width, image.height
        # Sub-pixel region of the source: resize samples it directly, so small images lose no precision.
        region = (left * w, top * h, w - right * w, h - bottom * h)
    if resize == "stretch":
        # PIL's filters antialias when shrinking, so small and large sources look alike.
        image = image.resize((size, size), resample, box=region)
        return np.asarray(image, dtype=np.uint8)
    shown, (fw, fh) = _fit_region(region or (0.0, 0.0, float(image.width), float(image.height)), resize)
    out_w, out_h = max(1, round(size * fw)), max(1, round(size * fh))
    image = image.resize((out_w, out_h), resample, box=shown)
    if (out_w, out_h) == (size, size):
        return np.asarray(image, dtype=np.uint8)
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    top, left = (size - out_h) // 2, (size - out_w) // 2
    canvas[top : top + out_h, left : left + out_w] = np.asarray(image, dtype=np.uint8)
    return canvas


@dataclass(frozen=True)
class Framing:
    """How an image file becomes the model's input: the served contract, recorded by prepare in the prepared
    manifest and by optimize in the variants' manifest, applied by evaluate, the server and `pipeline predict`.
    A request may name the sign's box (then: box + `roi_margin`); otherwise the whole image less `crop`."""

    size: int
    roi_margin: float = 0.1
    crop: Crop = NO_CROP
    resize: Resize = "stretch"
    """How the (cropped) image becomes a square: stretch | center_crop | pad (data.resize)."""
    interpolation: Interpolation = "bilinear"
    """The resize's filter: what the model's pretrained weights expect (data.interpolation)."""
    reduced_jpeg_decode: bool = False
    """Decode a JPEG at least twice the output's size at 1/2, 1/4 or 1/8 of it (data.reduced_jpeg_decode)."""

    def __post_init__(self) -> None:
        left, top, right, bottom = self.crop
        if min(self.crop) < 0 or left + right >= 0.9 or top + bottom >= 0.9:
            raise ValueError(f"crop {self.crop} must be fractions >= 0 that leave at least 10% of each side")
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"resize {self.resize!r} must be one of {', '.join(RESIZE_MODES)}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation {self.interpolation!r} must be one of {', '.join(INTERPOLATIONS)}")

    def array(self, image: Image.Image, box: Box | None = None) -> np.ndarray:
        """uint8 [S, S, 3] RGB of a decoded image."""
        return to_array(image, self.size, box, self.roi_margin, self.crop, self.resize, self.interpolation)

    def decode(self, image: Image.Image, box: Box | None = None) -> np.ndarray:
        """An image opened by `peek_image`, decoded, turned upright (EXIF orientation) and framed: uint8 [S, S, 3]
        RGB. prepare, evaluate, predict and the server all come here, so a photo gives the model the same pixels in
        each, however the camera stored it. A box is in the stored image's pixels (as annotation CSVs give them)."""
        if box is None and self.reduced_jpeg_decode:
            self._reduce_jpeg_decode(image)
        if box is not None:
            return self.array(load_image(image), box)
        orientation = exif_orientation(image)  # from the file as opened: libspng's decode carries no EXIF
        return self.array(upright(load_image(image), orientation), box)

    def _reduce_jpeg_decode(self, image: Image.Image) -> None:
        """A JPEG at least twice as large as what the framing keeps is decoded at 1/2, 1/4 or 1/8 of its size
        (libjpeg's DCT scaling, through PIL's draft), never below the output: a phone's 4000 x 3000 photo for a
        224 px model decodes at 500 x 375, many times faster, then the antialiased resize as before. Other pixels
        than a full decode's (close ones), hence opt-in and recorded in the framing. Not with a box (its corners
        are the full image's pixels)."""
        if image.format != "JPEG" or not isinstance(image, ImageFile.ImageFile):
            return
        left, top, right, bottom = self.crop
        kept_w, kept_h = image.width * (1 - left - right), image.height * (1 - top - bottom)
        # The smallest scale at which the resize still shrinks: pad fits the longer side, the others the shorter.
        scale = self.size / (max(kept_w, kept_h) if self.resize == "pad" else min(kept_w, kept_h))
        if scale <= 0.5:
            image.draft(None, (math.ceil(image.width * scale), math.ceil(image.height * scale)))


# Image formats people send that the decoders do not take, by their first bytes: 415 names them.
_OTHER_FORMATS = (
    (4, (b"ftypheic", b"ftypheix", b"ftyphevc", b"ftypmif1", b"ftypmsf1"), "HEIC/HEIF"),
    (4, (b"ftypavif",), "AVIF"),
    (0, (b"II*\x00", b"MM\x00*"), "TIFF"),
    (0, (b"8BPS",), "PSD"),
)


def _other_format(source: str | io.BytesIO) -> str:
    """The name of a known image format PIL may not open here, from the first bytes; empty when unknown."""
    try:
        if isinstance(source, io.BytesIO):
            head = source.getvalue()[:16]
        else:
            with open(source, "rb") as fh:
                head = fh.read(16)
    except OSError:
        return ""
    for offset, magics, name in _OTHER_FORMATS:
        if any(head[offset : offset + len(m)] == m for m in magics):
            return name
    return ""


# EXIF Orientation tag -> the transpose that shows the stored pixels upright (what ImageOps.exif_transpose applies).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def exif_orientation(image: Image.Image) -> int:
    """The EXIF Orientation tag of an opened image, from the EXIF block its header carried (JPEG's APP1, WEBP's and
    PNG's eXIf before the pixels): read without decoding (PIL's getexif() would decode a PNG to look further). 1,
    upright, when there is none or it cannot be read."""
    data = image.info.get("exif")
    if not isinstance(data, bytes | bytearray) or not data:
        return 1
    try:
        exif = Image.Exif()
        exif.load(bytes(data))
        return int(exif.get(0x0112, 1))
    except Exception:  # an unreadable EXIF block: the pixels are still the image
        return 1


def upright(image: Image.Image, orientation: int) -> Image.Image:
    """The image as it is meant to be seen: a phone's photo stored turned, with an EXIF Orientation tag, is turned
    back; an upright one is returned as it is, uncopied."""
    method = _UPRIGHT.get(orientation)
    return image if method is None else image.transpose(method)


def peek_image(source: str | bytes | io.BytesIO, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """Open an image file or bytes and read its header only (size checked against `max_pixels`);
    `load_image` decodes it. Any failure becomes BadImage."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        image = Image.open(source, formats=ACCEPTED_FORMATS)
        if image.width * image.height > max_pixels:
            raise BadImage(f"image is {image.width}x{image.height}, larger than {max_pixels} pixels")
    except BadImage:
        raise
    except Image.DecompressionBombError:  # PIL's own guard, for headers far beyond max_pixels
        raise BadImage(f"image is larger than {max_pixels} pixels") from None
    except Image.UnidentifiedImageError:
        known = _other_format(source)
        if known:
            raise UnsupportedFormat(
                f"{known} is not a supported image format (supported: {', '.join(ACCEPTED_FORMATS)}); convert it "
                "to JPEG or PNG"
            ) from None
        raise BadImage(f"not an image in an accepted format ({', '.join(ACCEPTED_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadImage(f"cannot decode image: {exc}") from None
    return image


# The PNG layouts libspng decodes to exactly PIL's pixels (tests/images/test_preprocess.py); the others (palette, 16-bit,
# grey + alpha, interlaced), files opened from a path, and any file libspng refuses stay with PIL, which words the error.
_SPNG_MODES = ("L", "RGB", "RGBA")


def _load_png_with_spng(image: Image.Image) -> Image.Image | None:
    """An 8-bit PNG opened from bytes, decoded by libspng (its header, and so its size, was checked by PIL); None
    when it is not one, or when libspng refuses it (then PIL decodes it or words the error)."""
    if pyspng is None or not isinstance(image, ImageFile.ImageFile) or image.format != "PNG":
        return None
    if image.info.get("interlace") or len(image.tile) != 1:
        return None
    rawmode = image.tile[0].args
    fp = getattr(image, "fp", None)
    if rawmode not in _SPNG_MODES or rawmode != image.mode or not isinstance(fp, io.BytesIO):
        return None
    try:
        pixels = pyspng.load(fp.getvalue(), format=rawmode)
    except Exception:  # any refusal: PIL decides
        return None
    if pixels.dtype != np.uint8 or pixels.shape[:2] != (image.height, image.width):
        return None
    return Image.fromarray(pixels, rawmode)


def load_image(image: Image.Image) -> Image.Image:
    """Decode an image opened by `peek_image` now: truncated files fail here, not later. Returns the decoded image
    (for 8-bit PNGs from bytes, a new one decoded by libspng; the caller still closes the one it opened)."""
    decoded = _load_png_with_spng(image)
    if decoded is not None:
        return decoded
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
