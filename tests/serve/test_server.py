"""The server over HTTP: both APIs, tritonclient, bad input, batching, drain. What only a real process shows (real
clients on a socket, keep-alive connections, memory, signals) runs against `pipeline serve` on loopback; the rest runs
the app in this process (tests/serve/inprocess.py), on the fake model where the answers' numbers do not matter."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import signal
import struct
import time
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers.server import Server, start_server
from tests.serve.inprocess import MAX_BODY, SIZE, fake_model, served
from tests.serve.inprocess import png as fake_png


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_health_and_metadata() -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert (await client.get("/v2/health/ready")).status_code == 200
        meta = (await client.get("/v2/models/signs")).json()
        assert meta["inputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, 3, SIZE, SIZE]}]
        assert {o["name"] for o in meta["outputs"]} == {"probabilities", "class_id"}
        assert len(meta["parameters"]["classes"]) == 43
        assert (await client.get("/v2/models/signs/ready")).status_code == 200
        spec = (await client.get("/openapi.json")).json()["paths"]
        assert {"400", "408", "413", "415", "503", "504"} <= set(spec["/v1/predict"]["post"]["responses"])
        assert {"400", "404", "413", "503"} <= set(spec["/v2/models/{name}/infer"]["post"]["responses"])

    served(scenario)


def test_oip_json_tensor_matches_the_runtime(server: Server) -> None:
    images = server.test_images[:4]
    batch = (images.transpose(0, 3, 1, 2) / np.float32(255)).astype(np.float32)
    body = {
        "id": "req-1",
        "inputs": [
            {"name": "images", "shape": list(batch.shape), "datatype": "FP32", "data": batch.reshape(-1).tolist()}
        ],
    }
    reply = httpx.post(f"{server.url}/v2/models/signs/infer", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["id"] == "req-1" and result["model_name"] == "signs"
    outputs = {o["name"]: o for o in result["outputs"]}
    probabilities = np.array(outputs["probabilities"]["data"], dtype=np.float32).reshape(4, 43)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(probabilities, server.direct_probabilities(batch), atol=1e-5)
    assert outputs["class_id"]["data"] == probabilities.argmax(axis=1).tolist()


def test_tritonclient_fp32_and_bytes_inputs(server: Server) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("signs")
    assert client.get_model_metadata("signs")["name"] == "signs"

    batch = (server.test_images[:8].transpose(0, 3, 1, 2) / np.float32(255)).astype(np.float32)
    tensor = triton.InferInput("images", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)  # binary tensor extension
    result = client.infer("signs", [tensor])
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (8, 43)
    np.testing.assert_allclose(probabilities, server.direct_probabilities(batch), atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("class_id"), probabilities.argmax(axis=1))

    files = np.array([png(image) for image in server.test_images[:3]], dtype=np.object_)
    encoded = triton.InferInput("image_files", [3], "BYTES")
    encoded.set_data_from_numpy(files)
    requested = triton.InferRequestedOutput("class_id", binary_data=False)
    result = client.infer("signs", [encoded], outputs=[requested])
    assert result.as_numpy("class_id").tolist() == server.file_classes(list(files))  # framed as served


def test_kserves_own_v2_client_speaks_to_the_server(server: Server, tmp_path: Path) -> None:
    """KServe's InferenceRESTClient (protocol v2), as a KServe InferenceService's callers use it: liveness,
    readiness, model readiness, and an FP32 tensor and BYTES image files through /v2/models/{name}/infer.
    (In a process of its own: tests/helpers/isolated.py says why.)"""
    from tests.helpers.isolated import run_isolated

    batch = (server.test_images[:4].transpose(0, 3, 1, 2) / np.float32(255)).astype(np.float32)
    expected = server.direct_probabilities(batch)
    np.save(tmp_path / "batch.npy", batch)
    # JSON has no bytes: BYTES elements as base64 strings, as the server documents
    files = [png(image) for image in server.test_images[:2]]
    encoded = [base64.b64encode(f).decode() for f in files]
    answer = run_isolated(
        f"""
        import asyncio, json, numpy as np
        from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
        url, batch = {server.url!r}, np.load({str(tmp_path / "batch.npy")!r})
        async def talk():
            client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=30))
            try:
                live = await client.is_server_live(url)
                ready = await client.is_server_ready(url)
                model_ready = await client.is_model_ready(url, "signs")
                tensor = InferInput("images", list(batch.shape), "FP32", batch.flatten().tolist())
                answer = await client.infer(url, InferRequest("signs", [tensor], request_id="kserve-1"), "signs")
                probabilities = next(o for o in answer.outputs if o.name == "probabilities").as_numpy()
                files = InferInput("image_files", [2], "BYTES", {encoded!r})
                answer = await client.infer(url, InferRequest("signs", [files]), "signs")
                classes = next(o for o in answer.outputs if o.name == "class_id").as_numpy().tolist()
                return [live, ready, model_ready, probabilities.tolist(), classes]
            finally:
                await client.close()
        print(json.dumps(asyncio.run(talk())))
        """
    )
    live, ready, model_ready, probabilities, classes = answer
    assert live and ready and model_ready
    np.testing.assert_allclose(np.array(probabilities).reshape(expected.shape), expected, atol=1e-5)
    assert classes == server.file_classes(files)  # framed as served


def test_uint8_pixels_give_the_fp32_answer_with_a_quarter_of_the_bytes(server: Server) -> None:
    """OIP v2 UINT8 input (the pixels, 0..255) through tritonclient, binary and JSON: the same probabilities as
    the FP32 tensor of the same pixels / 255; out-of-range JSON values are a 400."""
    import tritonclient.http as triton

    pixels = np.ascontiguousarray(server.test_images[:6].transpose(0, 3, 1, 2))
    expected = server.direct_probabilities((pixels / np.float32(255)).astype(np.float32))
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    for binary in (True, False):
        tensor = triton.InferInput("images", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels, binary_data=binary)
        got = client.infer("signs", [tensor]).as_numpy("probabilities")
        np.testing.assert_allclose(got, expected, atol=1e-5)
    body = {"inputs": [{"name": "images", "shape": [1, 3, server.image_size, server.image_size], "datatype": "UINT8",
                        "data": [256] * (3 * server.image_size**2)}]}  # fmt: skip
    answer = httpx.post(f"{server.url}/v2/models/signs/infer", json=body)
    assert answer.status_code == 400 and "0..255" in answer.json()["error"]


def test_versioned_routes_serve_only_this_version() -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        meta = (await client.get("/v2/models/signs")).json()
        (version,) = meta["versions"]
        assert (await client.get(f"/v2/models/signs/versions/{version}")).json()["name"] == "signs"
        assert (await client.get(f"/v2/models/signs/versions/{version}/ready")).status_code == 200
        tensor = {
            "name": "image_files",
            "shape": [1],
            "datatype": "BYTES",
            "data": [base64.b64encode(fake_png()).decode()],
        }
        answer = await client.post(f"/v2/models/signs/versions/{version}/infer", json={"inputs": [tensor]})
        assert answer.status_code == 200 and answer.json()["model_version"] == version
        wrong = await client.post("/v2/models/signs/versions/nope/infer", json={"inputs": [tensor]})
        assert wrong.status_code == 404 and "unknown version 'nope'" in wrong.json()["error"]

    served(scenario)


def test_original_files_through_the_api_give_optimizes_served_answers_file_for_file(
    server: Server, tiny_project: Path
) -> None:
    """What users send (the original test files, whole, byte for byte) through tritonclient (OIP v2 BYTES) and
    through /v1/predict must give, per file, the class optimize recorded as the variant's served prediction:
    the figure optimize's gate judged is the one the API delivers. Fails if the server frames a file
    differently (another crop or resize) from what the stages measured."""
    import tritonclient.http as triton

    from pipeline.artifacts.prepared import read_manifest as read_prepared
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.runtimes import read_manifest

    prepared = tiny_project / "data" / "prepared"
    originals = read_test_files(prepared)
    variant = read_manifest(server.models_dir).variant("fp32-onnx")
    assert variant.served_predicted is not None and len(variant.served_predicted) == len(originals)
    assert read_prepared(prepared).crop != (0.0, 0.0, 0.0, 0.0)  # the served framing is exercised, not trivial

    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    through_triton: list[int] = []
    for start in range(0, len(originals), 16):  # this test server takes bodies up to 256 KiB
        files = np.array([f.read_bytes() for f in originals[start : start + 16]], dtype=np.object_)
        encoded = triton.InferInput("images", [len(files)], "BYTES")
        encoded.set_data_from_numpy(files)
        result = client.infer("signs", [encoded], outputs=[triton.InferRequestedOutput("class_id")])
        through_triton.extend(result.as_numpy("class_id").tolist())
    assert through_triton == variant.served_predicted

    answers = []
    for f in originals:  # as curl -F files=@NAME.ppm sends them
        response = httpx.post(f"{server.url}/v1/predict", files=[("files", (f.path.name, f.read_bytes()))])
        assert response.status_code == 200
        answers.append(response.json()["predictions"][0]["top_k"][0]["class_id"])
    assert answers == variant.served_predicted
    labels = [f.label for f in originals]
    assert variant.served_accuracy == sum(a == b for a, b in zip(answers, labels, strict=True)) / len(labels)
    # (evaluate's headline against the running server: tests/stages/test_evaluate.py)


def test_v1_predict_multipart_and_json(server: Server) -> None:
    images = server.test_images[:2]
    files = [("files", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(images)]
    reply = httpx.post(f"{server.url}/v1/predict", files=files)
    assert reply.status_code == 200, reply.text
    predictions = reply.json()["predictions"]
    assert len(predictions) == 2 and len(predictions[0]["top_k"]) == 5
    expected = server.file_classes([f[1][1] for f in files])  # framed as served
    assert [p["top_k"][0]["class_id"] for p in predictions] == expected
    top = predictions[0]["top_k"][0]
    assert top["name"] == server.classes[top["class_id"]]
    assert all(
        a["probability"] >= b["probability"]
        for a, b in zip(predictions[0]["top_k"], predictions[0]["top_k"][1:], strict=False)
    )

    # A text field beside the file takes the general multipart parser; a large image is decoded in a
    # worker thread instead of on the event loop: both answer as the fast path does.
    big = np.asarray(Image.fromarray(images[0]).resize((320, 320)))
    files = [("files", ("big.png", png(big), "image/png")), ("files", ("0.png", png(images[0]), "image/png"))]
    reply = httpx.post(f"{server.url}/v1/predict", files=files, data={"note": "hello"})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["predictions"]) == 2
    assert reply.json()["predictions"][1] == predictions[0]

    # JSON with base64 and an optional box: the box crops like training does.
    whole = np.zeros((60, 60, 3), dtype=np.uint8)
    whole[10:50, 10:50] = np.asarray(Image.fromarray(images[0]).resize((40, 40)))
    body = {"images": [{"data": base64.b64encode(png(whole)).decode(), "box": [10, 10, 49, 49]}], "top_k": 3}
    reply = httpx.post(f"{server.url}/v1/predict", json=body)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["predictions"][0]["top_k"]) == 3


def _huge_png_header() -> bytes:
    ihdr = struct.pack(">IIBBBBB", 30_000, 30_000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return head + struct.pack(">I", 0) + b"IDAT" + struct.pack(">I", zlib.crc32(b"IDAT"))


# The first bytes of an iPhone photo (an ISO base media file of brand heic): what a phone sends unconverted.
HEIC_HEAD = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)


def test_bad_input_is_a_clear_4xx_and_the_server_survives() -> None:
    good = fake_png(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    size = SIZE
    b64 = base64.b64encode(good).decode()
    cases: list[tuple[str, str, str, dict[str, Any], int, str]] = [
        ("no content type", "POST", "/v1/predict", {"content": b"abc"}, 415, "unsupported content type"),
        ("text body", "POST", "/v1/predict", {"content": b"abc", "headers": {"content-type": "text/plain"}}, 415, "text/plain"),
        ("garbage image", "POST", "/v1/predict", {"files": {"files": ("x.png", b"not an image")}}, 400, "image 0: not an image in an accepted format"),
        ("truncated image", "POST", "/v1/predict", {"files": {"files": ("x.png", good[: len(good) // 2])}}, 400, "image 0"),
        ("a phone's HEIC", "POST", "/v1/predict", {"files": {"files": ("x.heic", HEIC_HEAD)}}, 415, "HEIC/HEIF is not a supported image format (supported: PNG, JPEG"),
        ("huge dimensions", "POST", "/v1/predict", {"files": {"files": ("x.png", _huge_png_header())}}, 400, "larger than"),
        ("oversized body", "POST", "/v1/predict", {"files": {"files": ("x.png", b"0" * (MAX_BODY + 1))}}, 413, "larger than"),
        ("no files", "POST", "/v1/predict", {"files": {"note": (None, "hello")}}, 400, "no image files"),
        ("malformed multipart", "POST", "/v1/predict", {"content": b"--xyz\r\nContent-Disposition: form-data; filename=\"a.png\"\r\n\r\n" + good + b"\r\n--xyz--\r\n", "headers": {"content-type": "multipart/form-data; boundary=xyz"}}, 400, "\"name\" must be provided"),
        ("form-urlencoded", "POST", "/v1/predict", {"data": {"a": "b"}}, 415, "x-www-form-urlencoded"),
        ("bad json", "POST", "/v1/predict", {"content": b"{", "headers": {"content-type": "application/json"}}, 400, "invalid request"),
        ("bad base64", "POST", "/v1/predict", {"json": {"images": ["%%%"]}}, 400, "not valid base64"),
        ("bad box", "POST", "/v1/predict", {"json": {"images": [{"data": b64, "box": [9, 9, 1, 1]}]}}, 400, "invalid ROI"),
        ("unknown model", "POST", "/v2/models/nope/infer", {"json": {"inputs": []}}, 404, "unknown model"),
        ("no inputs", "POST", "/v2/models/signs/infer", {"json": {"inputs": []}}, 400, "inputs"),
        ("wrong shape", "POST", "/v2/models/signs/infer", {"json": {"inputs": [{"name": "x", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192}]}}, 400, f"[N, 3, {size}, {size}]"),
        ("wrong count", "POST", "/v2/models/signs/infer", {"json": {"inputs": [{"name": "x", "shape": [1, 3, size, size], "datatype": "FP32", "data": [0.0]}]}}, 400, "needs"),
        ("wrong dtype", "POST", "/v2/models/signs/infer", {"json": {"inputs": [{"name": "x", "shape": [1], "datatype": "INT8", "data": [1]}]}}, 400, "datatype must be"),
        ("strings as numbers", "POST", "/v2/models/signs/infer", {"json": {"inputs": [{"name": "x", "shape": [1, 3, size, size], "datatype": "FP32", "data": ["a"] * (3 * size * size)}]}}, 400, "numbers"),
        ("bad binary header", "POST", "/v2/models/signs/infer", {"content": b"{}", "headers": {"Inference-Header-Content-Length": "999"}}, 400, "does not fit"),
        ("unknown output", "POST", "/v2/models/signs/infer", {"json": {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [b64]}], "outputs": [{"name": "nope"}]}}, 400, "unknown output"),
        ("metadata of unknown model", "GET", "/v2/models/nope", {}, 404, "unknown model"),
    ]  # fmt: skip

    async def scenario(client: httpx.AsyncClient) -> None:
        for name, method, path, kwargs, status, fragment in cases:
            reply = await client.request(method, path, **kwargs)
            assert reply.status_code == status, f"{name}: {reply.status_code} {reply.text}"
            assert fragment in reply.json()["error"], f"{name}: {reply.text}"
        assert (await client.get("/v2/health/ready")).status_code == 200
        assert (await client.post("/v1/predict", files={"files": ("ok.png", good)})).status_code == 200

    served(scenario)


def test_chunked_oversized_body_is_refused() -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while streaming
        for _ in range(10):
            yield b"x" * (MAX_BODY // 4)

    async def scenario(client: httpx.AsyncClient) -> int:
        reply = await client.post("/v1/predict", content=chunks(), headers={"content-type": "application/json"})
        return reply.status_code

    assert served(scenario) == 413


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def test_concurrent_requests_are_batched() -> None:
    data = fake_png()

    async def scenario(client: httpx.AsyncClient) -> tuple[list[int], str, str]:
        before = (await client.get("/metrics")).text
        replies = await asyncio.gather(
            *(client.post("/v1/predict", files={"files": ("a.png", data)}) for _ in range(128))
        )
        return [r.status_code for r in replies], before, (await client.get("/metrics")).text

    statuses, before, after = served(scenario, fake_model(batch_delay_s=0.005))
    assert statuses == [200] * 128
    images = _metric(after, "inference_batch_size_sum") - _metric(before, "inference_batch_size_sum")
    batches = _metric(after, "inference_batch_size_count") - _metric(before, "inference_batch_size_count")
    assert images == 128
    assert batches < 128, "no two requests were ever coalesced"
    assert 'inference_requests_total{route="/v1/predict",status="200"}' in after
    assert "inference_request_latency_seconds_bucket" in after and "inference_queue_images" in after


def test_the_inference_routes_shortcut_keeps_the_routers_answers() -> None:
    """The inference routes skip the router (serve.hotpath.HotPath): other methods still get the router's 405,
    client mistakes the same JSON 4xx, and each answer is counted under its route's template."""

    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.get("/v1/predict")).status_code == 405
        assert (await client.get("/v2/models/signs/infer")).status_code == 405
        wrong = await client.post("/v2/models/nope/infer", json={"inputs": []})
        assert wrong.status_code == 404 and "unknown model 'nope'" in wrong.json()["error"]
        bad = await client.post("/v1/predict", content=b"x", headers={"Content-Type": "text/plain"})
        assert bad.status_code == 415 and bad.json()["error"].startswith("unsupported content type")
        broken = await client.post("/v2/models/signs/infer", content=b"{", headers={"Content-Type": "application/json"})
        assert broken.status_code == 400 and "error" in broken.json()
        metrics = (await client.get("/metrics")).text
        assert 'inference_requests_total{route="/v2/models/{name}/infer",status="404"} 1.0' in metrics
        assert 'inference_requests_total{route="/v1/predict",status="415"} 1.0' in metrics
        # A body the fast multipart splitter does not take (a text field too) goes down the stack to the general
        # parser, read once and replayed: the same request id, counted once.
        ok = 'inference_requests_total{route="/v1/predict",status="200"}'
        ok_before = _metric(metrics, ok)
        files = {"files": ("a.png", fake_png(), "image/png")}
        general = await client.post(
            "/v1/predict", files=files, data={"note": "x"}, headers={"X-Request-ID": "client-7"}
        )
        assert general.status_code == 200 and general.headers["x-request-id"] == "client-7"
        assert _metric((await client.get("/metrics")).text, ok) - ok_before == 1

    served(scenario)


def test_full_queue_answers_503_with_retry_after() -> None:
    data = fake_png()

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return await asyncio.gather(*(client.post("/v1/predict", files={"files": ("a.png", data)}) for _ in range(32)))

    settings = {"max_queue_images": 1, "max_batch_size": 1, "max_images_per_request": 1}
    replies = served(scenario, fake_model(batch_delay_s=0.02), **settings)
    statuses = {r.status_code for r in replies}
    assert statuses <= {200, 503} and 503 in statuses and 200 in statuses
    busy = next(r for r in replies if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and "queue is full" in busy.json()["error"]


def test_sigterm_drains_in_flight_requests_and_exits_promptly(models_dir: Path, tmp_path: Path) -> None:
    server = start_server(models_dir, tmp_path, {"max_images_per_request": 256, "max_body_bytes": 8 * 2**20})
    images = np.resize(server.test_images, (256, *server.test_images.shape[1:]))
    files = [("files", (f"{i}.png", png(image), "image/png")) for i, image in enumerate(images)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(httpx.post, f"{server.url}/v1/predict", files=files, timeout=30) for _ in range(32)]
        deadline = time.monotonic() + 20
        while _metric(httpx.get(f"{server.url}/metrics").text, "inference_in_flight_requests") < 2:
            assert time.monotonic() < deadline, "requests never got in flight"
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=15)
        elapsed = time.monotonic() - started
        outcomes = []
        for f in futures:
            try:
                outcomes.append(f.result().status_code)
            except httpx.HTTPError:
                outcomes.append("refused")  # arrived after the listener closed: never half-answered
    # uvicorn re-raises the signal after its graceful shutdown, so the status says SIGTERM.
    assert code in (0, -signal.SIGTERM) and elapsed < 10
    assert b"Finished server process" in (server.process.stderr.read() if server.process.stderr else b"")
    assert all(o in (200, 503, "refused") for o in outcomes) and 200 in outcomes


@pytest.mark.slow
def test_openapi_fuzzing_finds_no_server_error(server: Server, tmp_path: Path) -> None:
    import subprocess
    import sys

    report = tmp_path / "junit.xml"
    result = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
            "--checks", "not_a_server_error", "--max-examples", "25", "--report", "junit",
            "--report-junit-path", str(report), "--no-color",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert json.dumps("not_a_server_error") and report.is_file()


def test_without_the_benchmarks_choice_auto_refuses_to_guess(models_dir: Path, tmp_path: Path) -> None:
    """An interrupted benchmark leaves no models/serving.json: `auto` then names the problem instead of serving
    (or shipping) some other variant; an explicit variant still works."""
    import shutil

    from pipeline.config import ServeConfig
    from pipeline.errors import StageError
    from pipeline.serve.model import load_served_model
    from pipeline.ship.context import choose_model

    models = tmp_path / "models"
    shutil.copytree(models_dir, models)
    (models / "serving.json").unlink(missing_ok=True)
    with pytest.raises(StageError, match=r"serving.json is missing: the benchmark stage has not chosen"):
        load_served_model(models, ServeConfig())
    with pytest.raises(StageError, match=r"set containerize.variant"):
        choose_model(models, "auto")
    assert load_served_model(models, ServeConfig(variant="fp32-onnx")).variant == "fp32-onnx"
    assert choose_model(models, "fp32-onnx").variant == "fp32-onnx"


def test_the_benchmarks_choice_of_a_smaller_onnx_model_ships(models_dir: Path, tmp_path: Path) -> None:
    """The benchmark may choose a smaller accepted model (the distilled student, the pruned copy): containerize
    ships whichever accepted ONNX variant it chose, and names why a torch file, a rejected variant or an unknown
    name cannot ship."""
    import shutil

    from pipeline.artifacts import serving as serving_file
    from pipeline.artifacts.variants import read_manifest, write_manifest
    from pipeline.errors import StageError
    from pipeline.ship.context import choose_model

    models = tmp_path / "models"
    shutil.copytree(models_dir, models)
    manifest = read_manifest(models)
    int8 = manifest.variant("int8-onnx")
    student = int8.model_copy(update={"name": "student-int8-onnx", "file": "variants/student-int8-onnx.onnx"})
    shutil.copy(models / int8.file, models / student.file)
    rejected = int8.model_copy(update={"name": "pruned-int8-onnx", "file": "", "accepted": False, "reason": "drop"})
    write_manifest(models, manifest.model_copy(update={"variants": [*manifest.variants, student, rejected]}))
    serving_file.write(
        serving_file.ServingChoice(variant="student-int8-onnx", backend="onnxruntime", sha256=student.sha256), models
    )
    chosen = choose_model(models, "auto")
    assert (chosen.variant, chosen.files, chosen.version) == (
        "student-int8-onnx",
        [Path(student.file)],
        student.sha256[:12],
    )
    with pytest.raises(StageError, match=r"'fp32' is not an ONNX file.*use one of .*student-int8-onnx"):
        choose_model(models, "fp32")
    with pytest.raises(StageError, match=r"'pruned-int8-onnx' is not accepted"):
        choose_model(models, "pruned-int8-onnx")
    with pytest.raises(StageError, match=r"'int9-onnx' is not in the manifest"):
        choose_model(models, "int9-onnx")


def test_a_choice_measured_on_another_file_is_refused(models_dir: Path, tmp_path: Path) -> None:
    """optimize rebuilt the variants after the benchmark (same names, other files): the old choice is stale."""
    import shutil

    from pipeline.artifacts import serving as serving_file
    from pipeline.artifacts.variants import read_manifest
    from pipeline.config import ServeConfig
    from pipeline.errors import StageError
    from pipeline.serve.model import load_served_model
    from pipeline.ship.context import choose_model

    models = tmp_path / "models"
    shutil.copytree(models_dir, models)
    measured = read_manifest(models).variant("fp32-onnx").sha256
    serving_file.write(serving_file.ServingChoice(variant="fp32-onnx", backend="onnxruntime", sha256=measured), models)
    assert load_served_model(models, ServeConfig()).variant == "fp32-onnx"
    assert choose_model(models, "auto").variant == "fp32-onnx"
    serving_file.write(serving_file.ServingChoice(variant="fp32-onnx", backend="onnxruntime", sha256="0" * 64), models)
    with pytest.raises(StageError, match=r"as measured on another file .*Run `pipeline benchmark`"):
        load_served_model(models, ServeConfig())
    with pytest.raises(StageError, match=r"as measured on another file"):
        choose_model(models, "auto")


def _malformed_corpus(good: bytes, size: int, max_body: int) -> list[tuple[str, str, dict[str, object]]]:
    """(name, path, httpx request kwargs) of hostile or broken requests: images, multipart, JSON and OIP."""
    b64 = base64.b64encode(good).decode()
    cases: list[tuple[str, str, dict[str, object]]] = []
    for cut in (0, 1, 8, 16, 33, 57, len(good) // 3, len(good) // 2, len(good) - 12, len(good) - 1):
        cases.append((f"png cut at {cut}", "/v1/predict", {"files": {"files": ("x.png", good[:cut])}}))
    for seed in range(10):
        noise = np.random.default_rng(seed).integers(0, 256, 64 + 97 * seed, dtype=np.uint8).tobytes()
        cases.append((f"noise {seed}", "/v1/predict", {"files": {"files": ("x.jpg", noise)}}))
        flipped = bytearray(good)
        flipped[40 + seed * 7] ^= 0xFF
        cases.append((f"png flipped byte {seed}", "/v1/predict", {"files": {"files": ("x.png", bytes(flipped))}}))
    for magic in (
        b"GIF89a",
        b"\xff\xd8\xff",
        b"BM",
        b"P6\n",
        b"RIFF\x00\x00\x00\x00WEBP",
        b"II*\x00",
        b"8BPS",
        b"%!PS",
    ):
        cases.append((f"magic {magic[:4]!r}", "/v1/predict", {"files": {"files": ("x.bin", magic + b"\x00" * 40)}}))
    for w, h in ((65_535, 65_535), (1, 2**31 - 1), (2**31 - 1, 1), (0, 0)):
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        chunk = b"IHDR" + ihdr
        bomb = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
        cases.append((f"png header {w}x{h}", "/v1/predict", {"files": {"files": ("x.png", bomb)}}))
    ppm_lie = b"P6\n60000 60000\n255\n" + b"\x00" * 100
    cases.append(("ppm header lie", "/v1/predict", {"files": {"files": ("x.ppm", ppm_lie)}}))
    boxes = ([-1, 0, 5, 5], [0, 0, 10**6, 10**6], [10**400, 0, 10**401, 1], [5, 5, 4, 4], [1000, 1000, 1001, 1001],
             [0, 0, 0], "abc", [0.5, 0, 1, 1], None)  # fmt: skip
    for i, box in enumerate(boxes):
        cases.append((f"box {i}", "/v1/predict", {"json": {"images": [{"data": b64, "box": box}]}}))
    for i, body in enumerate((b"", b"null", b"[]", b'{"images": []}', b'{"images": [1]}', b'{"images": "x"}',
                              b'{"images": [{"data": 5}]}', b'{"top_k": 0, "images": ["' + b64.encode() + b'"]}',
                              b'{"top_k": 1e999, "images": []}', b"[" * 5000 + b"]" * 5000,
                              b'{"a":' * 3000 + b"1" + b"}" * 3000, b"\xff\xfe\x00", b'{"images": ["' + b"A" * 1001 + b'"]}')):  # fmt: skip
        cases.append(
            (f"json body {i}", "/v1/predict", {"content": body, "headers": {"content-type": "application/json"}})
        )
    infer = "/v2/models/signs/infer"
    shapes = ([2**64], [2**63, 2**63], [1] * 40, [-1, 3, size, size], [0, 3, size, size], [1, 3, size],
              [10**30, 3, size, size], ["a"], [1.5, 3, size, size], [1, 3, 2**40, 2**40], [])  # fmt: skip
    for i, shape in enumerate(shapes):
        cases.append(
            (
                f"fp32 shape {i}",
                infer,
                {"json": {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [0.0]}]}},
            )
        )
    n = 3 * size * size
    for i, data in enumerate(
        ([float("nan")] * n, [1e39] * n, [10**400] * n, [[0.0]] * n, [True] * n, [None] * n, "x", {"a": 1})
    ):
        cases.append((f"fp32 data {i}", infer, {"content": json.dumps({"inputs": [{"name": "x", "shape": [1, 3, size, size], "datatype": "FP32", "data": data}]}, allow_nan=True).encode(), "headers": {"content-type": "application/json"}}))  # fmt: skip
    for i, (header, body) in enumerate((("-1", b"{}"), ("0", b"{}"), ("abc", b"{}"), (str(10**30), b"{}"), ("2", b"{}xx"),
                                        ("1", b"{"), ("5", b'{"a":1}\x00\x00'))):  # fmt: skip
        cases.append(
            (f"binary header {i}", infer, {"content": body, "headers": {"Inference-Header-Content-Length": header}})
        )
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": 10}}]}
    ).encode()
    for i, raw in enumerate(
        (b"", b"\x05\x00\x00\x00abc", b"\xff\xff\xff\xff" + b"x" * 6, b"\x01\x00\x00\x00a" * 3, b"\x00" * 10)
    ):
        cases.append(
            (
                f"bytes elements {i}",
                infer,
                {"content": header + raw, "headers": {"Inference-Header-Content-Length": str(len(header))}},
            )
        )
    for i, params in enumerate(
        ({"binary_data_output": "false"}, {"binary_data_output": 1}, {"binary_data_output": None}, [])
    ):
        cases.append(
            (
                f"parameters {i}",
                infer,
                {
                    "json": {
                        "parameters": params,
                        "inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": [b64]}],
                    }
                },
            )
        )
    for i, dtype in enumerate(("FP16", "UINT8", "", "fp32", 5, None)):
        cases.append(
            (
                f"datatype {i}",
                infer,
                {"json": {"inputs": [{"name": "x", "shape": [1], "datatype": dtype, "data": [1]}]}},
            )
        )
    cases.append(
        ("oversized json", infer, {"content": b"[" * (max_body + 10), "headers": {"content-type": "application/json"}})
    )
    cases.append(("many tiny files", "/v1/predict", {"files": [("files", (f"{i}.png", b"x")) for i in range(300)]}))
    cases.append(("unicode filename", "/v1/predict", {"files": {"files": ("\u202e\x00.png", good)}}))
    cases.append(
        ("multipart no boundary", "/v1/predict", {"content": good, "headers": {"content-type": "multipart/form-data"}})
    )
    cases.append(
        (
            "multipart bad boundary",
            "/v1/predict",
            {"content": good, "headers": {"content-type": "multipart/form-data; boundary=" + "x" * 5000}},
        )
    )
    return cases


def test_a_malformed_input_corpus_gets_4xx_never_5xx_or_a_reset(server: Server) -> None:
    """More than 100 broken or hostile requests over one keep-alive connection pool: each answered with a 4xx
    and a JSON error, or served when it is valid after all; never a 5xx, no connection dropped, the server
    healthy and correct afterwards."""
    good = png(server.test_images[0])
    cases = _malformed_corpus(good, server.image_size, server.max_body)
    assert len(cases) >= 100
    drift_series_before = _drift_series(server)
    failures: list[str] = []
    refusals = 0
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name, path, kwargs in cases:
            try:
                reply = client.post(path, **kwargs)  # type: ignore[arg-type]
            except httpx.TransportError as exc:  # a reset or a dropped keep-alive connection
                failures.append(f"{name}: {type(exc).__name__}")
                continue
            refused = 400 <= reply.status_code < 500 and "error" in reply.json()
            # Some are odd but valid (a PNG missing its end marker, a box running past the edge): answered.
            if not (refused or reply.status_code == 200):
                failures.append(f"{name}: {reply.status_code} {reply.text[:120]}")
            refusals += refused
        assert client.get("/v2/health/live").status_code == 200
        assert client.post("/v1/predict", files={"files": ("ok.png", good)}).status_code == 200
    assert failures == [], "\n".join(f[:110] for f in failures)
    assert refusals >= 100
    assert _drift_series(server) == drift_series_before  # no label value came from a request


def _drift_series(server: Server) -> set[str]:
    """The drift metrics' series (name + labels) in /metrics."""
    from pipeline.monitoring import drift

    names = (*tuple(s.metric for s in drift.SIGNALS.values()), drift.CLASS_METRIC)
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0] for line in lines if line.startswith(names)}


def test_drift_signals_count_answered_images_and_the_reference_route_says_when_there_is_none() -> None:
    """A fresh server counts nothing; two answered files add two to every signal (sizes from the files as sent);
    a refused request adds nothing; /v1/drift-reference is a JSON 404 naming the stage to run (no evaluate here)."""
    from pipeline.monitoring import drift

    classes = fake_model().classes
    square = np.random.default_rng(1).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    wide = np.ascontiguousarray(np.repeat(square, 2, axis=1))  # twice as wide as tall

    async def scenario(client: httpx.AsyncClient) -> None:
        assert sum(drift.parse_metrics((await client.get("/metrics")).text, classes).class_counts) == 0
        files = [("files", ("a.png", fake_png(square))), ("files", ("b.png", fake_png(wide)))]
        assert (await client.post("/v1/predict", files=files)).status_code == 200
        assert (await client.post("/v1/predict", files={"files": ("x.png", b"not an image")})).status_code == 400
        counts = drift.parse_metrics((await client.get("/metrics")).text, classes)
        assert sum(counts.class_counts) == 2 and all(sum(c) == 2 for c in counts.buckets.values()), counts
        assert counts.sums["aspect"] == pytest.approx(3.0) and counts.sums["height"] == 2 * SIZE
        answer = await client.get("/v1/drift-reference")
        assert answer.status_code == 404 and "pipeline evaluate" in answer.json()["error"]

    served(scenario)


def test_a_huge_shape_does_not_stall_the_server(server: Server) -> None:
    """Shape validation comes before any arithmetic: a body of huge dimensions is refused as fast as a body of the
    same size whose dimensions are all 1 (timed side by side, best of five each), and health checks running
    meanwhile are all answered."""
    huge = ", ".join(["18446744073709551616"] * 10_000)  # 2**64, 10,000 times: their product is 0.5 s of big-int work
    ones = ", ".join(["1" + " " * 19] * 10_000)  # the same bytes, nothing to multiply
    assert len(huge) == len(ones) and len(huge) < server.max_body  # parsed and validated, not refused by size

    def body(shape: str) -> bytes:
        return ('{"inputs": [{"name": "x", "datatype": "FP32", "data": [0], "shape": [' + shape + "]}]}").encode()

    def refused_in(client: httpx.Client, content: bytes) -> float:
        started = time.perf_counter()
        reply = client.post("/v2/models/signs/infer", content=content, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "shape must be at most 4 integers" in reply.text, reply.text
        return time.perf_counter() - started

    with httpx.Client(base_url=server.url, timeout=30) as client, ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(refused_in, client, body(huge))
        while not pending.done():  # the loop keeps answering while the huge body is handled
            assert httpx.get(f"{server.url}/v2/health/live", timeout=5).status_code == 200
        pending.result()
        timings = {"huge": [], "ones": []}
        for _ in range(5):
            timings["huge"].append(refused_in(client, body(huge)))
            timings["ones"].append(refused_in(client, body(ones)))
    fastest = {name: min(seconds) for name, seconds in timings.items()}
    assert fastest["huge"] < 3 * fastest["ones"], fastest


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_the_worst_request_the_limits_allow_stays_within_256_mb(server: Server) -> None:
    """The largest decodable request under the default limits (serve.max_request_pixels of the largest images
    serve.max_image_pixels allows, as tiny 1-bit PNGs) raises the server's peak RSS by at most 256 MB: images
    are decoded and freed one at a time. A request beyond the pixel cap is refused before decoding."""
    from pipeline.config import ServeConfig

    limits = ServeConfig()
    side = int(limits.max_image_pixels**0.5)
    buffer = io.BytesIO()
    Image.new("1", (side, side), 1).save(buffer, format="PNG", optimize=True)
    bomb = buffer.getvalue()
    count = limits.max_request_pixels // limits.max_image_pixels
    assert len(bomb) * (count + 1) < server.max_body  # the body limit does not stop it: the pixel caps must
    before = _peak_rss_mb(server.process.pid)
    files = [("files", (f"{i}.png", bomb, "image/png")) for i in range(count)]
    reply = httpx.post(f"{server.url}/v1/predict", files=files, timeout=120)
    assert reply.status_code == 200, reply.text
    grown = _peak_rss_mb(server.process.pid) - before
    assert grown <= 256, f"peak RSS grew by {grown:.0f} MB"
    over = [*files, ("files", ("extra.png", bomb, "image/png"))]
    reply = httpx.post(f"{server.url}/v1/predict", files=over, timeout=120)
    assert reply.status_code == 413 and "pixels together" in reply.json()["error"]
    print(f"peak RSS grew by {grown:.0f} MB for {count} images of {side}x{side}")
