"""OIP v2 over gRPC against the real `pipeline serve` process, through NVIDIA's `tritonclient.grpc` (and KServe's
InferenceGRPCClient) unchanged: health, metadata, FP32 / UINT8 / BYTES inputs with the same answers as REST and as
the model run directly, the original test files as optimize measured them, status codes for client mistakes,
auth, request ids, metrics; and the generated message module matches its .proto."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeline.machine.ports import free_port
from tests.helpers.server import Server, start_server
from tests.serve.test_server import png


@pytest.fixture
def grpc_server(models_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, str]]:
    port = free_port()
    running = start_server(models_dir, tmp_path, {"grpc_port": port})
    yield running, f"127.0.0.1:{port}"
    running.stop()


def test_tritonclient_grpc_health_metadata_and_every_input_kind(grpc_server: tuple[Server, str]) -> None:
    import tritonclient.grpc as triton
    import tritonclient.http as triton_http

    server, address = grpc_server
    client = triton.InferenceServerClient(url=address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("signs")
    meta = client.get_model_metadata("signs")
    assert (
        meta.name == "signs"
        and meta.inputs[0].datatype == "FP32"
        and list(meta.inputs[0].shape)[1:] == [3, server.image_size, server.image_size]
    )
    assert client.is_model_ready("signs", meta.versions[0]) and client.get_server_metadata().name == "signs-server"

    pixels = np.ascontiguousarray(server.test_images[:5].transpose(0, 3, 1, 2))
    fp32 = (pixels / np.float32(255)).astype(np.float32)
    expected = server.direct_probabilities(fp32)
    for datatype, array in (("FP32", fp32), ("UINT8", pixels)):
        tensor = triton.InferInput("images", list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        result = client.infer("signs", [tensor], request_id=f"grpc-{datatype}")
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected, atol=1e-5)
        assert result.as_numpy("class_id").tolist() == expected.argmax(axis=1).tolist()
        assert result.get_response().id == f"grpc-{datatype}"

    # Image files as BYTES: the same answer as REST gives for the same files.
    files = np.array([png(image) for image in server.test_images[:3]], dtype=np.object_)
    tensor = triton.InferInput("image_files", [3], "BYTES")
    tensor.set_data_from_numpy(files)
    over_grpc = client.infer("signs", [tensor], outputs=[triton.InferRequestedOutput("probabilities")])
    assert over_grpc.as_numpy("class_id") is None  # only what was asked for
    rest = triton_http.InferenceServerClient(url=server.url.removeprefix("http://"))
    rest_tensor = triton_http.InferInput("image_files", [3], "BYTES")
    rest_tensor.set_data_from_numpy(files)
    np.testing.assert_array_equal(
        over_grpc.as_numpy("probabilities"), rest.infer("signs", [rest_tensor]).as_numpy("probabilities")
    )


def test_client_mistakes_are_status_codes_with_the_rest_message(grpc_server: tuple[Server, str]) -> None:
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    server, address = grpc_server
    client = triton.InferenceServerClient(url=address)
    s = server.image_size

    def status_of(call: object) -> tuple[str, str]:
        with pytest.raises(InferenceServerException) as caught:
            call()  # type: ignore[operator]
        return str(caught.value.status()), caught.value.message()

    good = triton.InferInput("images", [1, 3, s, s], "FP32")
    good.set_data_from_numpy(np.zeros((1, 3, s, s), np.float32))
    code, message = status_of(lambda: client.infer("other", [good]))
    assert code == "StatusCode.NOT_FOUND" and "unknown model" in message
    code, _ = status_of(lambda: client.infer("signs", [good], model_version="nope"))
    assert code == "StatusCode.NOT_FOUND"
    wrong_shape = triton.InferInput("images", [1, 3, 8, 8], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32))
    code, message = status_of(lambda: client.infer("signs", [wrong_shape]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "shape must be" in message
    garbage = triton.InferInput("image_files", [1], "BYTES")
    garbage.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    code, _ = status_of(lambda: client.infer("signs", [garbage]))
    assert code == "StatusCode.INVALID_ARGUMENT"
    nan = triton.InferInput("images", [1, 3, s, s], "FP32")
    nan.set_data_from_numpy(np.full((1, 3, s, s), np.nan, np.float32))
    code, message = status_of(lambda: client.infer("signs", [nan]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "finite" in message
    # Bigger than serve.max_body_bytes (256 KiB in the tests): refused before parsing.
    big = triton.InferInput("images", [64, 3, s, s], "FP32")
    big.set_data_from_numpy(np.zeros((64, 3, s, s), np.float32))
    code, _ = status_of(lambda: client.infer("signs", [big, big, big, big]))
    assert code == "StatusCode.RESOURCE_EXHAUSTED"
    # The server is still fine, and nothing above was a 5xx in its metrics.
    assert client.is_server_ready()
    import httpx

    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'inference_requests_total{route="grpc:ModelInfer",status="404"} 2.0' in metrics
    assert 'status="500"' not in metrics


def test_auth_and_request_ids_over_grpc(models_dir: Path, tmp_path: Path) -> None:
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    port = free_port()
    log = tmp_path / "access.log"
    running = start_server(
        models_dir, tmp_path, {"grpc_port": port}, env={"PIPELINE_SERVE_TOKEN": "grpc-token"}, stdout=log
    )
    try:
        client = triton.InferenceServerClient(url=f"127.0.0.1:{port}")
        assert client.is_server_ready() and client.is_model_ready("signs")  # health stays open
        s = running.image_size
        tensor = triton.InferInput("images", [1, 3, s, s], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 3, s, s), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("signs", [tensor], headers={"authorization": "Bearer wrong"})
        assert str(refused.value.status()) == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException):
            client.get_model_metadata("signs")
        answer = client.infer("signs", [tensor], headers={"authorization": "Bearer grpc-token", "x-request-id": "r-7"})
        assert answer.get_response().id == "r-7"
        named = client.infer("signs", [tensor], request_id="own-id", headers={"authorization": "Bearer grpc-token"})
        assert named.get_response().id == "own-id"
    finally:
        running.stop()
    lines = [line for line in log.read_text().splitlines() if '"grpc:ModelInfer"' in line]
    assert len(lines) == 3 and '"status":401' in lines[0] and '"request_id":"r-7"' in lines[1]


def test_kserves_grpc_client_speaks_to_the_server(grpc_server: tuple[Server, str], tmp_path: Path) -> None:
    """KServe's InferenceGRPCClient, in a process of its own (its generated messages and tritonclient's share
    protobuf names, so the two cannot load into one process; ours are named apart and load beside either)."""
    from tests.helpers.isolated import run_isolated

    server, address = grpc_server
    batch = (server.test_images[:3].transpose(0, 3, 1, 2) / np.float32(255)).astype(np.float32)
    np.save(tmp_path / "batch.npy", batch)
    answer = run_isolated(
        f"""
        import asyncio, json, numpy as np
        from kserve import InferenceGRPCClient, InferInput, InferRequest
        import pipeline.serve.oip.predict_v2_pb2  # beside KServe's messages: no clash
        async def talk():
            client = InferenceGRPCClient({address!r}, timeout=30)
            try:
                live = await client.is_server_live()
                batch = np.load({str(tmp_path / "batch.npy")!r})
                tensor = InferInput("images", list(batch.shape), "FP32")
                tensor.set_data_from_numpy(batch, binary_data=True)
                answer = await client.infer(InferRequest("signs", [tensor]))
                out = next(o for o in answer.outputs if o.name == "probabilities").as_numpy()
                return live, out.tolist()
            finally:
                await client.close()
        live, probabilities = asyncio.run(talk())
        print(json.dumps({{"live": live, "probabilities": probabilities}}))
        """
    )
    assert answer["live"] is True
    np.testing.assert_allclose(np.array(answer["probabilities"]), server.direct_probabilities(batch), atol=1e-5)


def test_the_generated_messages_match_the_proto(tmp_path: Path) -> None:
    from pipeline.serve.oip import generate

    generate.generate(tmp_path)
    fresh = tmp_path / "pipeline" / "serve" / "oip"
    for name in ("predict_v2_pb2.py", "predict_v2_pb2.pyi"):
        assert (fresh / name).read_text() == (generate.HERE / name).read_text(), f"regenerate {name}"
