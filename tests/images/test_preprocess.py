import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.images.preprocess import BadImage, box_with_margin, open_image, to_array


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

    from pipeline.images.preprocess import open_image, to_array

    grey = np.full((8, 8), 128 * 257, dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "grey16.png")
    image = open_image(str(tmp_path / "grey16.png"))
    assert image.mode.startswith("I")
    assert np.abs(to_array(image, 8).astype(int) - 128).max() <= 1


def _photo_files(folder, real_files=()):  # type: ignore[no-untyped-def]
    """Files of several sizes, formats and modes: the real sample's test files when it is configured (as PNG, JPEG,
    grey, RGBA, a wide and a tall crop), else drawn ones of the same kinds."""
    if real_files:
        images = [Image.open(p).convert("RGB") for p in real_files[:3]]
    else:
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((41, 37), (80, 64))]
    base = images[0].resize((images[0].width * 3, images[0].height * 3))
    variants = {
        "rgb.png": images[0],
        "photo.jpg": images[-1],
        "grey.png": images[0].convert("L"),
        "alpha.png": images[0].convert("RGBA"),
        "wide.jpg": base.crop((0, 0, base.width, base.height // 2)),
        "tall.png": base.crop((0, 0, base.width // 3, base.height)),
    }
    paths = []
    for name, image in variants.items():
        path = folder / name
        image.save(path)
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    ("resize", "interpolation"),
    [("stretch", "bilinear"), ("center_crop", "bilinear"), ("pad", "bilinear"), ("center_crop", "bicubic")],
)
def test_every_resize_mode_gives_the_server_the_tensor_prepare_made(tmp_path, resize, interpolation, request) -> None:  # type: ignore[no-untyped-def]
    """The one framing, three ways to make a square and two filters: prepare's array and the server's input tensor
    are equal, byte for byte (x 255), on files of several sizes, formats and modes."""
    from pipeline.data.decode import decoded
    from pipeline.data.listing import SignFile
    from pipeline.images.preprocess import Framing
    from pipeline.serve.protocol import decode_images

    framing = Framing(48, 0.1, (0.05, 0.0, 0.05, 0.1), resize, interpolation)
    try:  # the real sample's files where the project has one, else drawn ones
        real_files = request.getfixturevalue("real_sample_test_files")
    except pytest.skip.Exception:
        real_files = []
    for path in _photo_files(tmp_path, real_files):
        (prepared,) = decoded([SignFile(path, 0, None, -1)], framing, use_box=False, workers=1)  # prepare's reader
        assert isinstance(prepared, np.ndarray) and prepared.shape == (48, 48, 3), path
        served = decode_images([(path.read_bytes(), None)], framing, 4096 * 4096)[0]
        assert np.array_equal(np.round(served * 255).astype(np.uint8).transpose(1, 2, 0), prepared), (path, resize)


def test_pad_keeps_the_aspect_on_black_bands_and_center_crop_cuts_the_long_side() -> None:
    wide = Image.new("RGB", (200, 100), (255, 255, 255))
    padded = to_array(wide, 40, resize="pad")
    assert (padded[:10] == 0).all() and (padded[30:] == 0).all() and (padded[10:30] == 255).all()
    tall = Image.new("RGB", (50, 100), (255, 255, 255))
    padded = to_array(tall, 40, resize="pad")
    assert (padded[:, :10] == 0).all() and (padded[:, 10:30] == 255).all()
    halves = Image.new("RGB", (300, 100), (0, 0, 0))
    halves.paste((255, 0, 0), (0, 0, 100, 100))  # left third red, middle black, right third green
    halves.paste((0, 255, 0), (200, 0, 300, 100))
    centre = to_array(halves, 20, resize="center_crop")
    assert centre[:, 2:18].max() == 0  # only the middle square: neither colour
    stretched = to_array(halves, 30, resize="stretch")
    assert stretched[:, 2, 0].min() > 200 and stretched[:, -3, 1].min() > 200


def test_pngs_decoded_by_libspng_give_the_model_pil_s_input_byte_for_byte(
    real_sample_test_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real sample's test files as PNGs of every mode users send: the server's input tensor with libspng (8-bit grey,
    RGB, RGBA) equals PIL's for every file; palette, 1-bit, grey + alpha and 16-bit stay with PIL; a truncated PNG
    gets PIL's error, word for word."""
    from pipeline.images import preprocess
    from pipeline.images.preprocess import Framing
    from pipeline.serve.protocol import BadRequest, decode_images

    if preprocess.pyspng is None:
        pytest.skip("pyspng is not installed")
    files = real_sample_test_files[:40]
    assert files
    bodies: dict[str, list[bytes]] = {}
    for path in files:
        base = Image.open(path).convert("RGB")
        rgba = base.copy()
        rgba.putalpha(Image.linear_gradient("L").resize(base.size))
        grey16 = Image.fromarray((np.asarray(base.convert("L"), dtype=np.uint16) * 257).astype(np.uint16))
        for mode, image in {"RGB": base, "L": base.convert("L"), "RGBA": rgba, "LA": rgba.convert("LA"),
                            "P": base.convert("P"), "1": base.convert("1"), "I;16": grey16}.items():  # fmt: skip
            out = io.BytesIO()
            image.save(out, "PNG", compress_level=len(bodies.get(mode, [])) % 10)
            bodies.setdefault(mode, []).append(out.getvalue())
    calls: list[str] = []
    load = preprocess.pyspng.load
    monkeypatch.setattr(
        preprocess.pyspng, "load", lambda data, format: calls.append(format) or load(data, format=format)
    )
    framing = Framing(48, 0.1, (0.05, 0.0, 0.05, 0.1), "pad")
    for mode, images in bodies.items():
        calls.clear()
        fast = decode_images([(body, None) for body in images], framing, 4096 * 4096)
        assert calls == ([mode] * len(images) if mode in ("L", "RGB", "RGBA") else []), mode
        with monkeypatch.context() as m:
            m.setattr(preprocess, "pyspng", None)
            assert np.array_equal(fast, decode_images([(body, None) for body in images], framing, 4096 * 4096)), mode

    truncated = bodies["RGB"][0][: len(bodies["RGB"][0]) // 2]
    with pytest.raises(BadRequest) as fast_error:
        decode_images([(truncated, None)], framing, 4096 * 4096)
    monkeypatch.setattr(preprocess, "pyspng", None)
    with pytest.raises(BadRequest) as pil_error:
        decode_images([(truncated, None)], framing, 4096 * 4096)
    assert str(fast_error.value) == str(pil_error.value)


def test_a_large_jpeg_is_decoded_at_a_fraction_of_its_size_the_same_in_prepare_and_the_server(
    tmp_path: Path,
) -> None:
    """A 1000 x 750 photo for a 64 px model: decoded at 1/8 (125 x 94, still larger than what the framing keeps),
    at 1/4 for a 100 px centre crop,
    the same pixels from prepare's reader and the server's decoder, close to a full decode's; with a box, or when
    the photo is not twice the output, the full decode as before."""
    from pipeline.data.decode import decoded
    from pipeline.data.listing import SignFile
    from pipeline.images.preprocess import Framing, peek_image
    from pipeline.serve.protocol import decode_images

    y, x = np.mgrid[0:750, 0:1000]
    pixels = np.stack([x * 255 // 999, y * 255 // 749, (x + y) * 255 // 1748], axis=-1).astype(np.uint8)
    path = tmp_path / "photo.jpg"
    Image.fromarray(pixels).save(path, quality=95)
    # pad fits the longer side (1000 -> 125 >= 64), center_crop the shorter (750 -> 94 < 100: 1/4, 188)
    for size, resize, expected in ((64, "pad", (125, 94)), (100, "center_crop", (250, 188))):
        framing = Framing(size, resize=resize, reduced_jpeg_decode=True)
        with peek_image(path.read_bytes()) as image:
            reduced = framing.decode(image)
            assert image.size == expected, (resize, image.size)
        full = framing.array(open_image(str(path)))
        assert np.abs(reduced.astype(int) - full.astype(int)).mean() < 2.0, resize  # a close picture of the same
        (prepared,) = decoded([SignFile(path, 0, None, -1)], framing, use_box=False, workers=1)
        served = decode_images([(path.read_bytes(), None)], framing, 4096 * 4096)[0]
        assert np.array_equal(prepared, reduced)
        assert np.array_equal(np.round(served * 255).astype(np.uint8).transpose(1, 2, 0), reduced)
    cases = {"a box (its corners are full-size pixels)": (Framing(64, reduced_jpeg_decode=True), (100, 100, 899, 649)),
             "1000 px for a 512 px output": (Framing(512, resize="pad", reduced_jpeg_decode=True), None),
             "off (the default)": (Framing(64), None)}  # fmt: skip
    for why, (framing, box) in cases.items():
        with peek_image(path.read_bytes()) as image:
            framing.decode(image, box)
            assert image.size == (1000, 750), why


@pytest.mark.parametrize("kind", ["JPEG", "PNG", "WEBP"])
def test_a_photo_stored_turned_with_its_exif_orientation_gives_the_upright_pixels(kind: str) -> None:
    """Phones store a photo's pixels as the sensor read them and say how to turn them (EXIF Orientation 2-8): the one
    decode turns them upright, from bytes (the server, libspng for PNG) and from a file (prepare) alike."""
    import io

    from PIL import Image

    from pipeline.images.preprocess import Framing, peek_image

    rng = np.random.default_rng(0)
    upright = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)).resize((100, 60))
    stored_as = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90",
                 7: "TRANSVERSE", 8: "ROTATE_270"}  # fmt: skip
    framing = Framing(size=24, resize="pad")
    options = {"quality": 100, "subsampling": 0} if kind == "JPEG" else {"lossless": True} if kind == "WEBP" else {}

    def encoded(image: Image.Image, tag: int = 1) -> bytes:
        exif = Image.Exif()
        if tag != 1:
            exif[0x0112] = tag
        out = io.BytesIO()
        image.save(out, kind, exif=exif, **options)
        return out.getvalue()

    expected = framing.decode(peek_image(encoded(upright)))
    for tag, method in stored_as.items():
        data = encoded(upright.transpose(getattr(Image.Transpose, method)), tag)
        got = framing.decode(peek_image(data))
        tolerance = 3 if kind == "JPEG" else 0  # JPEG's blocks fall elsewhere on turned pixels
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= tolerance, (kind, tag)
