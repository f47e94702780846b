"""The deploy stage and the running container (marked `docker`): readiness, probes, predictions through
both APIs equal to the evaluate stage's, bad input answered 4xx, a prompt `docker stop`, and the
registry path (push, pull by digest, run) against a local registry on 127.0.0.1."""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import StageError
from pipeline.serve.client import http as request
from pipeline.serve.client import infer_fp32, predict_png
from pipeline.ship import container
from tests.ship.conftest import Image, chdir, docker

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def running(built_image: Image) -> Iterator[container.Running]:
    name = f"signs-test-{time.monotonic_ns()}"
    started = container.start(
        built_image.engine,
        built_image.ref,
        name,
        ready_timeout_s=120,
        # and the image's gRPC port; a CPU quota as a Kubernetes limit sets one
        extra_args=["--health-interval", "1s", "-p", "127.0.0.1::8001", "--cpus", "1"],
    )
    yield started
    container.remove(built_image.engine, name)


def _evaluate_predictions(image: Image) -> list[int]:
    """evaluate's class for each prepared (ROI-cropped) test image: what the FP32 tensor path must reproduce."""
    from pipeline.artifacts import predictions

    return predictions.read(image.project / predictions.PREDICTIONS_PATH).predicted


def test_probes_metadata_and_metrics(running: container.Running, built_image: Image) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/signs/ready"):
        assert request("GET", running.url + path)[0] == 200, path
    status, _, body = request("GET", running.url + "/v2/models/signs")
    metadata = json.loads(body)
    assert status == 200 and metadata["versions"] == [built_image.report["model_version"]]
    assert metadata["platform"] == "onnxruntime" and metadata["parameters"]["variant"] == "fp32-onnx"
    status, _, body = request("GET", running.url + "/metrics")
    assert status == 200 and b"inference_requests" in body
    # The model card went into the image with the variant it describes.
    status, _, body = request("GET", running.url + "/v1/model-card")
    assert status == 200 and body.decode() == (built_image.project / "reports" / "model_card.md").read_text()
    # Docker's own HEALTHCHECK (every second here) turns healthy.
    deadline = time.monotonic() + 30
    health = ""
    while time.monotonic() < deadline and health != "healthy":
        health = docker("inspect", "-f", "{{.State.Health.Status}}", running.name).stdout.strip()
        time.sleep(0.5)
    assert health == "healthy"


def test_predictions_through_the_api_equal_evaluate(running: container.Running, built_image: Image) -> None:
    images, labels = built_image.test_arrays()
    expected = _evaluate_predictions(built_image)
    got = np.concatenate([infer_fp32(running.url, "signs", images[i : i + 64]) for i in range(0, len(images), 64)])
    assert got.tolist() == expected
    metrics = json.loads((built_image.project / "reports" / "evaluate" / "metrics.json").read_text())
    assert float((got == labels).mean()) == pytest.approx(metrics["roi_accuracy"], abs=0)  # the crops' figure
    # The same images as PNG files through /v1/predict.
    assert predict_png(running.url, images[:16]) == expected[:16]


def test_runtime_threads_follow_the_containers_cpu_quota(running: container.Running) -> None:
    """`--cpus 1` (a 1-CPU limit) on a machine with more cores: the server sizes its runtime to 1 thread."""
    log = docker("logs", running.name).stdout + docker("logs", running.name).stderr
    assert "(1 threads)" in log, log[-2000:]


def test_grpc_in_the_container_with_tritonclient(running: container.Running, built_image: Image) -> None:
    """The image serves OIP v2 over gRPC on 8001 by default: NVIDIA's client gets evaluate's classes too."""
    import tritonclient.grpc as triton

    address = docker("port", running.name, "8001/tcp").stdout.strip().splitlines()[0]
    client = triton.InferenceServerClient(url=address)
    assert client.is_server_ready() and client.is_model_ready("signs")
    images, _ = built_image.test_arrays()
    batch = (images[:32].transpose(0, 3, 1, 2) / np.float32(255)).astype(np.float32)
    tensor = triton.InferInput("images", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    got = client.infer("signs", [tensor]).as_numpy("class_id")
    assert got is not None and got.tolist() == _evaluate_predictions(built_image)[:32]


def test_bad_input_gets_4xx_with_a_message(running: container.Running) -> None:
    cases = [
        ("/v2/models/signs/infer", b"{not json", "application/json", 400),
        (
            "/v2/models/signs/infer",
            json.dumps(
                {"inputs": [{"name": "images", "shape": [1, 3, 2, 2], "datatype": "FP32", "data": [0.0] * 12}]}
            ).encode(),
            "application/json",
            400,
        ),
        ("/v2/models/nope/infer", b"{}", "application/json", 404),
        (
            "/v1/predict",
            json.dumps({"images": [base64.b64encode(b"not an image").decode()]}).encode(),
            "application/json",
            400,
        ),
        ("/v1/predict", b"x", "text/plain", 415),
    ]
    for path, body, content_type, want in cases:
        status, _, answer = request("POST", running.url + path, body, {"Content-Type": content_type})
        assert status == want, (path, status, answer[:200])
        assert "error" in json.loads(answer)
    # Over the body limit (by its Content-Length): 413 before the body is read; the server is fine afterwards.
    host, port = running.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/v1/predict")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(64 * 1024 * 1024))
    connection.endheaders()
    assert connection.getresponse().status == 413
    connection.close()
    assert request("GET", running.url + "/v2/health/ready")[0] == 200


def test_root_filesystem_is_read_only_and_user_is_not_root(running: container.Running) -> None:
    out = docker("exec", running.name, "sh", "-c", "id -u; touch /app/x 2>/dev/null && echo writable || echo ro")
    assert out.stdout.split() == ["10001", "ro"]
    assert docker("exec", running.name, "sh", "-c", "touch /tmp/x && echo ok").stdout.strip() == "ok"


def test_docker_stop_is_prompt_and_clean(built_image: Image) -> None:
    name = f"signs-stop-{time.monotonic_ns()}"
    started = container.start(built_image.engine, built_image.ref, name, ready_timeout_s=120)
    try:
        seconds, code = container.stop(built_image.engine, name, timeout_s=10)
        assert seconds < 5, f"docker stop took {seconds:.1f} s (the stop signal did not stop the server)"
        assert code == 0
        logs = container.logs(built_image.engine, name)
        assert "Traceback" not in logs
    finally:
        container.remove(built_image.engine, name)
    assert started.ready_seconds < 60


def test_deploy_stage_local(built_image: Image) -> None:
    from pipeline.stages import deploy

    with chdir(built_image.project):
        deploy.run(built_image.params)
    report = json.loads((built_image.project / "reports" / "deploy" / "smoke.json").read_text())
    assert report["accuracy"] == report["evaluate_accuracy"] and report["agreement_with_evaluate"] == 1.0
    assert report["png_agree_with_tensor"] == report["png_checked"] > 0
    # The original test files, whole, byte for byte as OIP v2 BYTES and as PNG through /v1/predict: exactly
    # evaluate's measurement of the shipped file, file for file (and the crops as FP32 tensors, crop for crop).
    originals = report["original_files"]
    evaluated = json.loads((built_image.project / "reports" / "evaluate" / "metrics.json").read_text())
    assert originals["images"] == 86
    assert originals["png_accuracy"] == originals["oip_bytes_accuracy"] == report["expected_served_accuracy"]
    assert (
        report["expected_served_accuracy"] == evaluated["accuracy"] and report["accuracy"] == evaluated["roi_accuracy"]
    )
    assert report["per_image_mismatches"] == {"fp32_tensor": [], "oip_bytes": [], "png": []}
    assert 0.0 <= originals["jpeg_accuracy"] <= 1.0
    assert report["stop_seconds"] < 5 and report["exit_code"] == 0
    assert docker("ps", "-aq", "-f", f"name=^{report['container']}$").stdout.strip() == ""


def test_deploy_refuses_an_evaluation_of_another_file(built_image: Image, tmp_path: Path) -> None:
    """evaluate measured another file than the image ships (a stale record): deploy says so before it starts
    anything, rather than comparing the API with figures of another model."""
    import shutil

    from pipeline.stages import deploy

    work = tmp_path / "project"
    shutil.copytree(built_image.project, work, symlinks=True)
    path = work / "reports" / "evaluate" / "predictions.json"
    record = json.loads(path.read_text())
    record["model_version"] = "0" * 12
    path.write_text(json.dumps(record))
    with chdir(work), pytest.raises(StageError, match=r"evaluate measured .* but the image ships .*rerun"):
        deploy.run(built_image.params)


def test_push_pull_by_digest_and_run(
    built_image: Image,
    local_registry: str,
    running: container.Running,
) -> None:
    """The registry target, for real: push, delete the local image, pull it back by digest, smoke-test it."""
    from pipeline.config import DeployConfig
    from pipeline.stages import deploy

    engine = built_image.engine
    container.remove(engine, running.name)  # the module's container holds the image: done with it
    remote = f"{local_registry}/{built_image.report['image']}:{built_image.report['model_version']}"
    by_digest = container.push(engine, built_image.ref, remote)
    manifest_url = f"http://{local_registry}/v2/{built_image.report['image']}/manifests/{by_digest.split('@')[1]}"
    request = urllib.request.Request(
        manifest_url, headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        layers = json.load(response)["layers"]
    assert layers
    # Remove every local name of the image, so the pull below downloads it.
    tags = json.loads(docker("image", "inspect", built_image.ref).stdout)[0]["RepoTags"]
    docker("rmi", *tags)
    assert docker("image", "inspect", built_image.ref, check=False).returncode != 0
    container.pull(engine, by_digest)
    assert json.loads(docker("image", "inspect", by_digest).stdout)[0]["Id"] == built_image.ref
    for tag in tags:  # give the names back for the other tests
        docker("tag", built_image.ref, tag)
    docker("rmi", remote, check=False)  # leaves the image: only the registry name goes
    # And the deploy stage's registry target end to end.
    params = built_image.params.model_copy(
        update={
            "deploy": DeployConfig(
                **{**built_image.params.deploy.model_dump(), "target": "registry", "registry": local_registry}
            )
        }
    )
    with chdir(built_image.project):
        deploy.run(params)
    report = json.loads((built_image.project / "reports" / "deploy" / "smoke.json").read_text())
    assert report["pulled"].startswith(f"{local_registry}/") and "@sha256:" in report["pulled"]
    assert report["accuracy"] == report["evaluate_accuracy"]
