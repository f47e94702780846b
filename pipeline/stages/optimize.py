"""The optimize stage: verified variants of the trained model, one manifest, one registered model.

    models/model.pt (artifacts.model) + data/prepared (artifacts.prepared)
        --optimize.candidates: prune + distil, int8 (ONNX Runtime QDQ, torchao pt2e), ONNX export, bf16-->
        models/variants/<file> + models/manifest.json (artifacts.variants), reports/optimize/{metrics.json,
        variants.md}; one MLflow run whose accepted variants are registered as versions of
        `tracking.registered_model_name`.

Variants: the families of pipeline/optimize/families (one module each, one line in its table) that optimize.* asks
for: the trained model (fp32, fp32-onnx, int8-onnx) always, then int8-pt2e, bf16, pruned and student ones.
"""

from __future__ import annotations

import json
import platform
import shutil
from typing import Any

import torch

from pipeline import console
from pipeline.artifacts import MODELS_DIR, REPORTS_DIR
from pipeline.artifacts import model as model_file
from pipeline.artifacts import variants as variants_file
from pipeline.artifacts.prepared import PREPARED_DIR, read_manifest
from pipeline.config import Params
from pipeline.machine.memory_budget import Budget
from pipeline.optimize.candidates import VariantMaker, build_manifest, markdown_table
from pipeline.tracking import stage_run, tracking_uri

OPTIMIZE_REPORTS = REPORTS_DIR / "optimize"


def register_variants(params: Params, manifest: variants_file.ModelManifest) -> list[int]:
    """Each accepted variant logged as an MLflow model of the active run (tracking.log_variant_model: it classifies
    image files as the server does) and registered as a version of `tracking.registered_model_name`, tagged;
    returns the version numbers. Evaluate moves the `champion` alias once its gate passes one."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.artifacts.prepared import read_test_files
    from pipeline.tracking import log_variant_model

    client = MlflowClient(tracking_uri=tracking_uri(params.tracking))
    name = params.tracking.registered_model_name
    try:
        client.create_registered_model(name, description="Image classifier variants (pipeline optimize)")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    test_files = read_test_files(PREPARED_DIR)
    example = test_files[0].path.read_bytes() if test_files else _blank_png(manifest.image_size)
    contract = manifest.preprocess.model_dump(mode="json") | {"classes": manifest.classes}
    versions = []
    for v in manifest.accepted():
        info = log_variant_model(MODELS_DIR, v, example, {"preprocess": contract})
        tags = {
            "variant": v.name,
            "format": v.format,
            "precision": v.precision,
            "accuracy": f"{v.accuracy:.6f}",
            "accuracy_drop": f"{v.accuracy_drop:.6f}",
            "size_bytes": str(v.size_bytes),
            "parameters": str(v.parameters),
            "sha256": v.sha256,
            "runtimes": ",".join(v.runtimes),
        }
        if v.served_accuracy is not None:
            tags["served_accuracy"] = f"{v.served_accuracy:.6f}"
            mlflow.log_metric("served_accuracy", v.served_accuracy, model_id=info.model_id)
        mlflow.log_metric("accuracy", v.accuracy, model_id=info.model_id)
        mv = client.create_model_version(
            name,
            source=info.model_uri,
            run_id=info.run_id,
            tags=tags,
            description=f"{v.name}: top-1 {v.accuracy:.4f}, {v.size_bytes} bytes",
            model_id=info.model_id,
        )
        versions.append(int(mv.version))
    return versions


def _blank_png(size: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


def report_metrics(manifest: variants_file.ModelManifest) -> dict[str, Any]:
    """reports/optimize/metrics.json: what shipped, what was rejected and why, each variant's figures."""
    variants: dict[str, Any] = {}
    for v in manifest.variants:
        figures: dict[str, Any] = {"accuracy": v.accuracy, "accuracy_drop": v.accuracy_drop}
        if v.served_accuracy is not None:
            figures["served_accuracy"] = v.served_accuracy
        figures |= {"size_bytes": v.size_bytes, "parameters": v.parameters, "accepted": v.accepted}
        if v.parity:
            figures |= {
                "parity_max_abs_diff": v.parity.max_abs_diff,
                "parity_max_rel_diff": v.parity.max_rel_diff,
                "parity_top1_agreement": v.parity.top1_agreement,
            }
        variants[v.name] = figures
    return {
        "baseline_accuracy": manifest.baseline_accuracy,
        "test_images": manifest.test_images,
        "shipped": [v.name for v in manifest.accepted()],
        "rejected": {v.name: v.reason for v in manifest.variants if not v.accepted},
        "variants": variants,
    }


def run(params: Params) -> None:
    cfg = params.optimize
    prepared = read_manifest(PREPARED_DIR)
    model, payload = model_file.read()
    model_file.check_against(payload, model_file.MODEL_PATH, len(prepared.classes), prepared.image_size)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    budget = Budget.of(params.memory_gb, model, prepared.image_size)
    fitted = budget.eval_batch(cfg.batch_size, "optimize.batch_size")
    params = params.model_copy(update={"optimize": cfg.model_copy(update={"batch_size": fitted})})
    staging = MODELS_DIR / "variants.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    maker = VariantMaker(params, staging, prepared, budget)
    with stage_run("optimize", params, {"optimize": cfg.model_dump(mode="json")}) as mlrun:
        mlrun.set_tags({"machine": platform.machine(), "torch": torch.__version__})
        maker.run(model, payload, lambda m, s: mlrun.log_metrics(m, step=s))
        # Ship: only accepted files move into models/variants/, then the manifest naming them is written.
        manifest = variants_file.publish(staging, build_manifest(params, prepared, payload, maker))
        manifest_path = MODELS_DIR / variants_file.MANIFEST_NAME

        OPTIMIZE_REPORTS.mkdir(parents=True, exist_ok=True)
        metrics = report_metrics(manifest)
        (OPTIMIZE_REPORTS / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (OPTIMIZE_REPORTS / "variants.md").write_text(markdown_table(manifest))

        for v in manifest.variants:
            key = v.name
            mlrun.log_metrics(
                {f"{key}.accuracy": v.accuracy, f"{key}.size_bytes": v.size_bytes, f"{key}.accepted": v.accepted}
            )
        mlrun.log_artifact(manifest_path, "reports")
        mlrun.log_artifact(OPTIMIZE_REPORTS / "metrics.json", "reports")
        mlrun.log_artifact(OPTIMIZE_REPORTS / "variants.md", "reports")
        if mlrun.active and mlrun.run_id:
            versions = register_variants(params, manifest)
            console.log(f"registered {len(versions)} versions of {params.tracking.registered_model_name!r}: {versions}")
    console.log("\n" + markdown_table(manifest))
    console.log(
        f"shipped {len(manifest.accepted())} variants in {MODELS_DIR / variants_file.VARIANTS_FOLDER}; "
        f"manifest {manifest_path}"
    )
