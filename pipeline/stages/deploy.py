"""The deploy stage: run the server image and smoke-test it through its API on the real test images.

Targets (`deploy.target`):
- `local`: run the image containerize built (by id) on this engine;
- `registry`: push it to `deploy.registry`, pull it back by digest, run what was pulled.
Either way the container runs as in Kubernetes (read-only root, no capabilities). What users send: every
original test file, whole, byte for byte as an OIP v2 BYTES tensor and re-encoded as PNG and JPEG through
/v1/predict (multipart); the lossless paths must give, file for file, the class the evaluate stage recorded for the
shipped variant (its headline accuracy). The prepared crops also go through OIP as FP32 tensors (and a sample as PNG)
and must give evaluate's class for every crop (its ROI-protocol accuracy). With `deploy.accuracy_tolerance` > 0 only
the accuracies are compared, within it. Then the container is stopped (`docker stop`, timed) unless `deploy.keep_running`.
Writes reports/deploy/smoke.json and reports/deploy/metrics.json.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts import image as image_file
from pipeline.artifacts import predictions as predictions_file
from pipeline.artifacts.prepared import PREPARED_DIR, read_split, read_test_files
from pipeline.config import DeployConfig, Params
from pipeline.console import Steps, log
from pipeline.errors import StageError
from pipeline.machine.ports import ensure_free
from pipeline.serve.client import SmokeResult, encode, infer_files, predict_files, smoke_test
from pipeline.ship import container
from pipeline.ship import docker_engine as eng

REPORT_DIR = REPORTS_DIR / "deploy"
EXPECTED_FROM = f"evaluate ({predictions_file.PREDICTIONS_PATH})"  # what the container's answers are held to


def load_test_split(limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    test = read_split("test", PREPARED_DIR, head=limit or None)  # only what is sent is read
    images, labels = test.images, test.labels.astype(np.int64)
    if not len(images):
        raise StageError(f"{PREPARED_DIR / 'test'} holds no test images")
    return images, labels


def originals_through_api(url: str, model_name: str, limit: int = 0) -> dict[str, Any] | None:
    """The test split's original files, whole (no box), sent as users send them: byte for byte as an OIP v2
    BYTES tensor (what tritonclient sends), re-encoded as PNG (lossless: the server decodes the originals'
    pixels) and as JPEG (quality 95, what cameras and phones send) through /v1/predict (multipart)."""
    from PIL import Image

    files = read_test_files(PREPARED_DIR)[: limit or None]
    if not files:
        return None
    labels = np.asarray([f.label for f in files])
    out: dict[str, Any] = {"images": len(files)}
    predicted: dict[str, list[int]] = {}
    steps = Steps("deploy: original files", 3)
    for kind in ("oip_bytes", "png", "jpeg"):
        label = f"{len(files)} as {'OIP v2 BYTES' if kind == 'oip_bytes' else kind.upper() + ' via /v1/predict'}"
        with steps.running(label):
            if kind == "oip_bytes":
                predicted[kind] = infer_files(url, model_name, [f.read_bytes() for f in files])
            else:
                encoded = []
                for f in files:
                    with Image.open(f.path) as image:
                        encoded.append(encode(image, kind))
                predicted[kind] = predict_files(url, encoded, kind)
        out[f"{kind}_accuracy"] = float((np.asarray(predicted[kind]) == labels).mean())
        out[f"{kind}_errors"] = int((np.asarray(predicted[kind]) != labels).sum())
        steps.finished(label, f"accuracy {out[f'{kind}_accuracy']:.4f}")
    out["predicted"] = predicted
    log(
        f"deploy: original test files, whole: OIP v2 BYTES {out['oip_bytes_accuracy']:.4f}, /v1/predict PNG "
        f"{out['png_accuracy']:.4f}, JPEG {out['jpeg_accuracy']:.4f} on {len(files)} images"
    )
    return out


def mismatches(got: list[int], expected: list[int]) -> list[int]:
    """Indices where the API's answer differs from the recorded per-image prediction."""
    return [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]


def skipped(reason: str) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "smoke.json").write_text(json.dumps({"skipped": True, "reason": reason}, indent=2) + "\n")
    (REPORT_DIR / "metrics.json").write_text(json.dumps({"skipped": True}, indent=2) + "\n")
    log(f"deploy: skipped ({reason})")


def run(params: Params) -> None:
    config = params.deploy
    image = image_file.read()
    engine = _engine_or_skip(config, image)
    if engine is None:
        return
    images, labels = load_test_split(config.smoke_images)
    reference = _evaluate_of(image, labels.tolist(), len(images))
    report: dict[str, Any] = {"skipped": False, "target": config.target, "image_id": image.id, "tag": image.tag}
    ref = image.id
    if not eng.image_exists(engine, ref):
        raise StageError(f"image {image.tag} ({ref[7:19]}) is not on this engine: rerun `pipeline containerize`")
    if config.target == "registry":
        ref = _through_registry(engine, config, image, report)

    running, result, originals = _smoke_in_container(engine, ref, params, images, labels, report)
    differing = _compare_with_evaluate(report, image, result, originals, reference)
    _write_reports(report, originals)
    log(
        f"deploy: accuracy through the API {result.accuracy:.4f} on {result.images} images "
        f"(expected {reference.accuracy:.4f} from {EXPECTED_FROM}; PNG path agrees on "
        f"{result.png_agree}/{result.png_checked})"
        + (
            f"; stopped in {report['stop_seconds']:.1f} s"
            if "stop_seconds" in report
            else f"; running at {running.url}"
        )
    )
    _gate(config, image.variant, result, report, originals, differing)


def _smoke_in_container(
    engine: eng.DockerEngine, ref: str, params: Params, images: np.ndarray, labels: np.ndarray, report: dict[str, Any]
) -> tuple[container.Running, SmokeResult, dict[str, Any] | None]:
    """Start the image, smoke-test it (the prepared test images as tensors, the original files through the API),
    then stop and remove it unless `deploy.keep_running`; (container, smoke result, originals' figures)."""
    config = params.deploy
    log(f"deploy: starting {ref} as container {config.container_name} ...")
    ensure_free("127.0.0.1", config.host_port, "deploy.host_port")
    running = container.start(engine, ref, config.container_name, config.host_port, config.ready_timeout_s)
    report |= {"container": running.name, "url": running.url, "ready_seconds": round(running.ready_seconds, 2)}
    log(f"deploy: ready at {running.url} after {running.ready_seconds:.1f} s; smoke test on {len(images)} images")
    try:
        result = smoke_test(running.url, params.serve.model_name, images, labels)
        log(f"deploy: {result.images} prepared test images as FP32 tensors: accuracy {result.accuracy:.4f}")
        originals = originals_through_api(running.url, params.serve.model_name, config.smoke_images)
    except StageError:
        log(container.logs(engine, running.name))
        if not config.keep_running:
            container.remove(engine, running.name)
        raise
    if not config.keep_running:
        stop_seconds, exit_code = container.stop(engine, running.name)
        container.remove(engine, running.name)
        report |= {"stop_seconds": round(stop_seconds, 2), "exit_code": exit_code}
    return running, result, originals


def _compare_with_evaluate(
    report: dict[str, Any],
    image: image_file.ImageRecord,
    result: SmokeResult,
    originals: dict[str, Any] | None,
    reference: predictions_file.Predictions,
) -> dict[str, list[int]]:
    """The container's answers beside evaluate's, into `report`; the images on which each path differs."""
    tensor_differing = mismatches(result.predictions, reference.predicted)
    report |= {
        "images": result.images,
        "accuracy": result.accuracy,
        "expected_accuracy": reference.accuracy,
        "expected_from": EXPECTED_FROM,
        "evaluate_accuracy": reference.accuracy,
        "agreement_with_evaluate": 1 - len(tensor_differing) / max(1, result.images),
        "png_checked": result.png_checked,
        "png_agree_with_tensor": result.png_agree,
        "smoke_seconds": round(result.seconds, 2),
        "served_model": result.model,
        "variant": image.variant,
    }
    differing: dict[str, list[int]] = {"fp32_tensor": tensor_differing}
    if originals:
        if reference.served_predicted:
            # Lossless paths must give evaluate's answer for every file; JPEG is re-encoded, so only reported.
            for kind in ("oip_bytes", "png"):
                differing[kind] = mismatches(originals["predicted"][kind], reference.served_predicted)
        report |= {
            "original_files": {k: v for k, v in originals.items() if k != "predicted"},
            "expected_served_accuracy": reference.served_accuracy if reference.served_predicted else None,
        }
    report["per_image_mismatches"] = differing
    return differing


def _engine_or_skip(config: DeployConfig, image: image_file.ImageRecord) -> eng.DockerEngine | None:
    """The engine to deploy on; None when the stage is skipped (no image or no engine, deploy.skip_without_engine)."""
    if image.skipped:
        if eng.skips_without_engine(config.skip_without_engine):
            skipped(f"containerize was skipped: {image.reason}")
            return None
        raise StageError(f"containerize built no image ({image.reason or 'skipped'}): nothing to deploy")
    try:
        return eng.find_engine("deploy.skip_without_engine")
    except eng.NoEngine as exc:
        if eng.skips_without_engine(config.skip_without_engine):
            skipped(str(exc))
            return None
        raise


def _evaluate_of(image: image_file.ImageRecord, labels: list[int], count: int) -> predictions_file.Predictions:
    """evaluate's predictions for the first `count` test images, checked to be of the image's variant and version."""
    evaluated = predictions_file.read()
    if len(evaluated.labels) < count or evaluated.labels[:count] != labels:
        raise StageError(
            f"{predictions_file.PREDICTIONS_PATH} is not for these test images ({len(evaluated.labels)} "
            f"predictions); run `pipeline evaluate` first"
        )
    if (evaluated.variant, evaluated.model_version) != (image.variant, image.model_version):
        raise StageError(
            f"evaluate measured {evaluated.variant} ({evaluated.model_version}) but the image ships {image.variant} "
            f"({image.model_version}): rerun `pipeline evaluate` (dvc repro does)"
        )
    return evaluated.first(count)


def _through_registry(
    engine: eng.DockerEngine, config: DeployConfig, image: image_file.ImageRecord, report: dict[str, Any]
) -> str:
    """Push the image to deploy.registry, drop the local tag, pull it back: the digest to start."""
    if not container.registry_answers(config.registry):
        raise StageError(
            f"registry {config.registry} does not answer; for a local one run `docker/registry-up.sh "
            f"{config.registry}`, for GHCR/Docker Hub log in with `docker login` and set deploy.registry"
        )
    repository = image.image.rsplit("/", 1)[-1]
    remote = f"{config.registry}/{repository}:{image.tag.rsplit(':', 1)[-1]}"
    log(f"deploy: pushing {remote} ...")
    by_digest = container.push(engine, image.id, remote)
    eng.docker(engine, ["rmi", remote], check=False, timeout_s=60)
    pull_seconds = container.pull(engine, by_digest)
    report |= {"pushed": remote, "pulled": by_digest, "pull_seconds": round(pull_seconds, 2)}
    log(f"deploy: pulled back {by_digest}")
    return by_digest


def _write_reports(report: dict[str, Any], originals: dict[str, Any] | None) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    metrics: dict[str, Any] = {k: report[k] for k in ("accuracy", "evaluate_accuracy", "ready_seconds") if k in report}
    if originals:
        metrics |= {
            "served_accuracy_oip_bytes": originals["oip_bytes_accuracy"],
            "served_accuracy_png": originals["png_accuracy"],
            "served_accuracy_jpeg": originals["jpeg_accuracy"],
        }
    if "stop_seconds" in report:
        metrics["stop_seconds"] = report["stop_seconds"]
    (REPORT_DIR / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def _gate(
    config: DeployConfig,
    variant: str,
    result: SmokeResult,
    report: dict[str, Any],
    originals: dict[str, Any] | None,
    differing: dict[str, list[int]],
) -> None:
    """The deployed container answers as evaluate measured: the accuracy within deploy.accuracy_tolerance, and
    with no tolerance the same class for every image, on every lossless path."""
    expected, source, tolerance = report["expected_accuracy"], report["expected_from"], config.accuracy_tolerance
    if abs(result.accuracy - expected) > tolerance + 1e-12:
        raise StageError(
            f"smoke test failed: accuracy through the API {result.accuracy:.4f} differs from {expected:.4f} "
            f"({source}) by more than deploy.accuracy_tolerance {tolerance}"
        )
    served_expected = report.get("expected_served_accuracy")
    for kind in ("oip_bytes", "png"):
        if (
            originals
            and served_expected is not None
            and abs(originals[f"{kind}_accuracy"] - served_expected) > (tolerance + 1e-12)
        ):
            raise StageError(
                f"smoke test failed: the original test files ({kind}, whole) score "
                f"{originals[f'{kind}_accuracy']:.4f} through the API, {served_expected:.4f} in evaluate's "
                f"measurement of {variant} (same files, same decode)"
            )
    for kind, wrong in differing.items():
        if wrong and not tolerance:
            raise StageError(
                f"smoke test failed: through the API ({kind}) {len(wrong)} test images get another class than "
                f"evaluate recorded for {variant} (first: index {wrong[0]})"
            )
    if result.png_agree != result.png_checked:
        raise StageError(
            f"smoke test failed: /v1/predict (PNG) and OIP (tensor) disagree on "
            f"{result.png_checked - result.png_agree} of {result.png_checked} images"
        )
