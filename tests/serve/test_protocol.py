"""The fast multipart splitter agrees with the general parser (python-multipart through Starlette) on
every body it accepts, and hands everything else to that parser."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from starlette.datastructures import UploadFile
from starlette.requests import Request

from pipeline.preprocess import Framing
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
    with pytest.raises(BadRequest, match="image 1: cannot decode"):
        peek_images([(tiny_png, None), (b"not an image", None)], max_pixels=10_000)
    with pytest.raises(BadRequest, match="image 0: cannot decode"):
        decode_images([(tiny_png[:-40], None)], Framing(8), 10_000)  # truncated: fails when decoded
    assert decode_images([(tiny_png, None)], Framing(8), 10_000).shape == (1, 3, 8, 8)


@pytest.fixture
def tiny_png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
