"""The fast multipart splitter agrees with the general parser (python-multipart through Starlette) on
every body it accepts, and hands everything else to that parser."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from starlette.datastructures import UploadFile
from starlette.requests import Request

from pipeline.images.preprocess import Framing
from pipeline.serve.protocol import BadRequest, decode_images, multipart_files, peek_images, pixel_count


def _encoded(files: list[tuple[str, tuple[str, bytes, str]]], data: dict[str, str] | None = None) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://test/v1/predict", files=files, data=data)
    return request.read(), request.headers["content-type"]


def _starlette_files(body: bytes, content_type: str) -> list[bytes]:
    async def parse() -> list[bytes]:
        sent = False

        async def receive() -> dict[str, object]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
                 "headers": [(b"content-type", content_type.encode())]}  # fmt: skip
        form = await Request(scope, receive).form()
        return [await v.read() for _, v in form.multi_items() if isinstance(v, UploadFile)]

    return asyncio.run(parse())


@pytest.mark.parametrize("count", [1, 2, 5])
def test_plain_uploads_split_like_the_general_parser(count: int) -> None:
    rng = np.random.default_rng(count)
    payloads = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in (0, 1, 700, 5000, 13)[:count]]
    payloads[-1] += b"\r\n--not-the-boundary\r\n"  # boundary-like bytes inside a file stay data
    body, content_type = _encoded([("files", (f"{i}.png", p, "image/png")) for i, p in enumerate(payloads)])
    fast = multipart_files(body, content_type, max_files=8)
    assert fast == payloads == _starlette_files(body, content_type)


def test_anything_unusual_goes_to_the_general_parser() -> None:
    png = b"\x89PNG fake"
    body, content_type = _encoded([("files", ("a.png", png, "image/png"))])
    boundary = content_type.split("boundary=")[1].encode()
    assert multipart_files(body, content_type, max_files=1) == [png]
    with_field, field_type = _encoded([("files", ("a.png", png, "image/png"))], data={"note": "hi"})
    unusual = {
        "a text field": (with_field, field_type),
        "too many files": (body, content_type),  # with max_files 0 below
        "a preamble": (b"hello\r\n" + body, content_type),
        "an epilogue": (body + b"trailing", content_type),
        "no closing delimiter": (body[: body.rindex(b"--" + boundary)], content_type),
        "an extra part header": (body.replace(b"Content-Type: image/png", b"Content-Transfer-Encoding: base64"), content_type),
        "no filename": (body.replace(b'; filename="a.png"', b""), content_type),
        "no boundary": (body, "multipart/form-data"),
        "another boundary": (body, "multipart/form-data; boundary=other"),
        "a boundary over 70 bytes": (body.replace(boundary, b"b" * 71), "multipart/form-data; boundary=" + "b" * 71),
    }  # fmt: skip
    for name, (case_body, case_type) in unusual.items():
        limit = 0 if name == "too many files" else 8
        assert multipart_files(case_body, case_type, max_files=limit) is None, name


def test_decoding_checks_headers_first_and_counts_pixels(tiny_png: bytes) -> None:
    opened = peek_images([(tiny_png, None), (tiny_png, None)], max_pixels=10_000)
    assert pixel_count(opened) == 2 * 40 * 30
    with pytest.raises(BadRequest, match="image 0: image is 40x30, larger than 100 pixels"):
        peek_images([(tiny_png, None)], max_pixels=100)  # from the header, before any decoding
    with pytest.raises(BadRequest, match="image 1: not an image in an accepted format"):
        peek_images([(tiny_png, None), (b"not an image", None)], max_pixels=10_000)
    with pytest.raises(BadRequest, match="image 0: cannot decode"):
        decode_images([(tiny_png[:-40], None)], Framing(8), 10_000)  # truncated: fails when decoded
    assert decode_images([(tiny_png, None)], Framing(8), 10_000).shape == (1, 3, 8, 8)


def test_only_the_accepted_decoders_run(tiny_png: bytes) -> None:
    """A format PIL can read but the server does not accept (TGA here) is refused from its header."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.open(io.BytesIO(tiny_png)).save(buffer, format="TGA")
    with pytest.raises(BadRequest, match="image 0: not an image in an accepted format"):
        peek_images([(buffer.getvalue(), None)], max_pixels=10_000)
    for kind in ("JPEG", "PPM", "BMP", "WEBP", "GIF"):
        buffer = io.BytesIO()
        Image.open(io.BytesIO(tiny_png)).save(buffer, format=kind)
        assert decode_images([(buffer.getvalue(), None)], Framing(8), 10_000).shape == (1, 3, 8, 8), kind


def test_a_box_partly_outside_the_image_uses_the_part_inside_and_one_outside_is_refused(tiny_png: bytes) -> None:
    inside = decode_images([(tiny_png, (10, 5, 39, 29))], Framing(8, roi_margin=0.0), 10_000)
    running_past = decode_images([(tiny_png, (10, 5, 500, 10**400))], Framing(8, roi_margin=0.0), 10_000)
    np.testing.assert_array_equal(inside, running_past)
    with pytest.raises(BadRequest, match="starts outside"):
        decode_images([(tiny_png, (40, 0, 45, 5))], Framing(8), 10_000)


def test_the_served_crop_cuts_the_given_fractions_before_resizing() -> None:
    from PIL import Image

    pixels = np.zeros((100, 100, 3), dtype=np.uint8)
    pixels[10:95, 20:98] = 255  # the region a crop of (0.2, 0.1, 0.02, 0.05) keeps
    cropped = Framing(8, crop=(0.2, 0.1, 0.02, 0.05)).array(Image.fromarray(pixels))
    assert cropped[1:-1, 1:-1].min() == 255 and cropped.min() > 190  # edges: the filter's support reaches past
    assert Framing(8).array(Image.fromarray(pixels)).min() == 0  # uncropped: the black border shows
    with pytest.raises(ValueError, match="leave at least"):
        Framing(8, crop=(0.5, 0.0, 0.45, 0.0))


@pytest.fixture
def tiny_png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
