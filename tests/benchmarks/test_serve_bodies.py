"""The load test's request bodies (benchmarks/serve.py) are what the servers' own parsers accept: a multipart
upload in the setup's field, and an OIP v2 JSON BYTES tensor whose element is the file, byte for byte."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serve import Setup, request_body, wrk_script
from pipeline.serve.protocol import multipart_files, parse_infer_body, tensor_images

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # any bytes: the bodies carry them unchanged


def _setup(body: str, field: str = "files") -> Setup:
    return Setup("x", "x", "x", "/p", field, "/ready", lambda port, work: [], lambda answer: 0, body=body)


def test_multipart_body_carries_the_file_in_its_field() -> None:
    body, content_type = request_body(_setup("multipart"), PNG)
    assert multipart_files(body, content_type, 4) == [PNG]
    assert b'name="files"' in body


def test_oip_json_body_is_one_bytes_tensor_of_the_file() -> None:
    body, content_type = request_body(_setup("oip-json"), PNG)
    parsed, binary = parse_infer_body(body, None)
    assert content_type == "application/json" and tensor_images(parsed, binary, 32, 4) == [PNG]


def test_wrk_script_names_one_body_file_per_image(tmp_path: Path) -> None:
    images = []
    for i in range(3):
        images.append(tmp_path / f"{i}.png")
        images[-1].write_bytes(PNG + bytes([i]))
    script = wrk_script(_setup("oip-json"), images, tmp_path).read_text()
    bodies = sorted(tmp_path.glob("x-body-*.bin"))
    assert len(bodies) == 3 and all(str(b) in script for b in bodies)
    assert '["Content-Type"] = "application/json"' in script


def test_the_load_is_the_original_test_files_whole_as_png(tiny_project: Path) -> None:
    """The load test sends what users send: each original test file, whole (its own size, not the prepared
    crop's), losslessly as PNG, with its label."""
    import io

    import numpy as np
    from PIL import Image

    from benchmarks.serve import files_as_sent
    from pipeline.artifacts.prepared import read_test_files

    prepared = tiny_project / "data" / "prepared"
    originals = read_test_files(prepared)
    sent = files_as_sent(prepared, 5, "png")
    assert len(sent) == 5
    for (data, label), original in zip(sent, originals, strict=False):
        assert data.startswith(b"\x89PNG") and label == original.label
        decoded = np.asarray(Image.open(io.BytesIO(data)))
        assert np.array_equal(decoded, np.asarray(Image.open(original.path).convert("RGB")))


def test_the_load_sends_the_test_files_as_png_or_as_they_are(tiny_project: Path) -> None:
    from benchmarks.serve import files_as_sent
    from pipeline.artifacts.prepared import read_test_files

    prepared = tiny_project / "data" / "prepared"
    originals = read_test_files(prepared)[:5]
    as_sent = files_as_sent(prepared, 5)
    assert [data for data, _ in as_sent] == [f.path.read_bytes() for f in originals]
    assert [label for _, label in as_sent] == [f.label for f in originals]
    assert all(data.startswith(b"\x89PNG") for data, _ in files_as_sent(prepared, 5, "png"))


def test_an_upload_is_named_and_typed_by_its_real_format() -> None:
    """Original files go out as users' clients label them: the demo's PPMs as image/x-portable-anymap, a JPEG as
    image/jpeg, never a PPM called sign.png."""
    import io

    from PIL import Image

    from benchmarks.serve import file_type

    def encoded(kind: str) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (8, 6), (200, 30, 30)).save(out, kind)
        return out.getvalue()

    ppm, jpeg = encoded("PPM"), encoded("JPEG")
    assert file_type(ppm) == (".ppm", "image/x-portable-anymap")
    assert file_type(jpeg) == (".jpeg", "image/jpeg")
    assert file_type(b"not an image") == (".bin", "application/octet-stream")
    body, content_type = request_body(_setup("multipart"), ppm)
    assert b'filename="sign.ppm"\r\nContent-Type: image/x-portable-anymap\r\n' in body
    assert multipart_files(body, content_type, 4) == [ppm]
