"""The optimize stage: verified variants of the trained model, one manifest, one registered model.

Inputs: models/model.pt (train), data/prepared/{train,test}.npz + manifest.json (prepare).
Outputs: models/variants/<file> for every accepted variant, models/manifest.json,
reports/optimize/{metrics.json, variants.md}; one MLflow run whose accepted variants are registered as
versions of `optimize.registered_model_name`.

Variants: fp32 (the trained model), fp32-onnx, int8-onnx, int8-pt2e, bf16 (native bf16 CPUs only, or
bf16=on), pruned, pruned-onnx, pruned-int8-onnx. Each is evaluated on the test split through
pipeline.runtimes (the code the benchmark and the server use) and shipped only when its top-1 is within
`max_accuracy_drop` of fp32 (and, for ONNX exports, its parity with torch passes).
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import console, nets
from pipeline.checkpoint import sha256_of
from pipeline.config import MODELS_DIR, PREPARED_DIR, REPORTS_DIR, OptimizeConfig, Params
from pipeline.errors import StageError
from pipeline.optimize import export, prune, quantize
from pipeline.runtimes import ONNXRUNTIME, TORCH_COMPILE, TORCH_EAGER, open_file
from pipeline.runtimes.manifest import (
    InputSpec,
    ModelManifest,
    Parity,
    Preprocess,
    Variant,
    write_manifest,
)
from pipeline.runtimes.torch_models import load_model, save_model
from pipeline.tracking import stage_run, tracking_uri

MODEL_PATH = MODELS_DIR / "model.pt"
VARIANTS_DIR = MODELS_DIR / "variants"
OPTIMIZE_REPORTS = REPORTS_DIR / "optimize"
TORCH_RUNTIMES = [TORCH_EAGER, TORCH_COMPILE]


# ------------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Images:
    images: np.ndarray  # float32 [N, 3, S, S] in [0, 1]
    labels: np.ndarray  # int64 [N]


def load_images(path: Path, image_size: int, limit: int | None = None, seed: int = 0) -> Images:
    """A prepared split as model input; a StageError naming the file when missing or of the wrong shape.
    With `limit`, a seeded random subset of that many images."""
    if not path.exists():
        raise StageError(f"{path} not found: run `pipeline prepare` first")
    try:
        with np.load(path) as arrays:
            images, labels = arrays["images"], arrays["labels"]
    except (OSError, ValueError, KeyError) as exc:
        raise StageError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    expected = f"uint8 [N, {image_size}, {image_size}, 3]"
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (image_size, image_size, 3):
        raise StageError(
            f"{path}: images are {images.dtype} {list(images.shape)}, expected {expected} "
            "(the model's image size; rerun `pipeline prepare` with the same data.image_size)"
        )
    if len(labels) != len(images) or len(images) == 0:
        raise StageError(f"{path}: {len(images)} images but {len(labels)} labels")
    if limit is not None and limit < len(images):
        pick = np.sort(np.random.default_rng(seed).choice(len(images), size=limit, replace=False))
        images, labels = images[pick], labels[pick]
    floats = np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255)
    return Images(floats, labels.astype(np.int64))


def load_prepared_manifest(prepared: Path) -> dict[str, Any]:
    path = prepared / "manifest.json"
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} not found: run `pipeline prepare` first") from None
    except ValueError as exc:
        raise StageError(f"{path} is not valid JSON ({exc})") from None
    for key in ("image_size", "classes", "mean", "std"):
        if key not in raw:
            raise StageError(f"{path}: missing key {key!r}; rerun `pipeline prepare`")
    return raw


def load_trained(path: Path, prepared: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """The trained model, checked against the prepared data it will be evaluated on."""
    model, payload = load_model(path)
    arch = payload["arch"]
    n_classes, size = len(prepared["classes"]), int(prepared["image_size"])
    if int(arch.get("num_classes", nets.NUM_CLASSES)) != n_classes:
        raise StageError(
            f"{path}: the model has {arch.get('num_classes')} classes, the prepared data {n_classes}; "
            "retrain (`pipeline train`) on this data"
        )
    if int(arch["image_size"]) != size:
        raise StageError(
            f"{path}: the model was trained at {arch['image_size']}x{arch['image_size']}, the prepared "
            f"data is {size}x{size}; retrain (`pipeline train`) or re-prepare"
        )
    return model, payload


# ------------------------------------------------------------------------------------------- helpers


def predict_all(runtime: Any, images: np.ndarray, batch_size: int) -> np.ndarray:
    return np.concatenate([runtime.predict(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])


@dataclass
class Candidate:
    """A variant file made in the staging folder, before the gate decides whether it ships."""

    name: str
    file: str
    format: str
    runtimes: list[str]
    precision: str
    parameters: int
    source: str = ""
    reference_logits: np.ndarray | None = None  # for ONNX exports: the torch model's test logits
    details: dict[str, Any] = field(default_factory=dict)


DISTILL_TEMPERATURE = 2.0


def finetune(
    model: nn.Module,
    params: Params,
    log: Callable[[dict[str, float], int], None] | None = None,
    teacher: nn.Module | None = None,
) -> nn.Module:
    """A short fine-tune after pruning, on the training split with train's augmentation; with a teacher
    (the unpruned model) and `optimize.finetune_distill` > 0, the loss also pulls the pruned model's
    outputs towards the teacher's (knowledge distillation), which recovers accuracy faster than labels alone."""
    from pipeline.data.loader import TrainLoader, load_split
    from pipeline.train import augment_config

    cfg = params.optimize
    if cfg.finetune_epochs == 0:
        return model
    split = load_split(PREPARED_DIR, "train")
    batch = min(cfg.finetune_batch_size, len(split))
    loader = TrainLoader(split, batch, cfg.seed, augment=augment_config(params))
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": params.train.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.finetune_lr,
    )
    total = cfg.finetune_epochs * loader.steps_per_epoch
    step = 0
    torch.manual_seed(cfg.seed)
    model.train()
    while loader.epoch < cfg.finetune_epochs:
        epoch_loss, seen = 0.0, 0
        batches = console.progress(
            iter(loader), loader.steps_per_epoch, f"fine-tune {loader.epoch + 1}/{cfg.finetune_epochs}"
        )
        for b in batches:
            lr = cfg.finetune_lr * 0.5 * (1 + math.cos(math.pi * step / max(1, total)))
            for group in optim.param_groups:
                group["lr"] = lr
            # A committee's members are stacked along the batch; each learns at the rate it would alone.
            logits, labels = nets.member_loss_inputs(model(b.images), b.labels)
            members = len(labels) // len(b.labels)
            loss = F.cross_entropy(logits, labels, label_smoothing=params.train.label_smoothing)
            if teacher is not None and cfg.finetune_distill > 0:
                with torch.no_grad():
                    target = F.log_softmax(teacher(b.images) / DISTILL_TEMPERATURE, dim=1).repeat(members, 1)
                distill = F.kl_div(
                    F.log_softmax(logits / DISTILL_TEMPERATURE, dim=1), target, log_target=True, reduction="batchmean"
                ) * (DISTILL_TEMPERATURE**2)
                loss = (1 - cfg.finetune_distill) * loss + cfg.finetune_distill * distill
            loss = loss * members
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
            epoch_loss += float(loss.detach()) / members * len(b.labels)
            seen += len(b.labels)
        if log is not None:
            log({"finetune_loss": epoch_loss / max(1, seen)}, loader.epoch)
    return model.eval()


# ------------------------------------------------------------------------------------------- the stage


class Optimizer:
    """Makes the candidates in a staging folder and evaluates them; `run` ships the accepted ones."""

    def __init__(self, params: Params, staging: Path, prepared: dict[str, Any]) -> None:
        self.params = params
        self.cfg: OptimizeConfig = params.optimize
        self.staging = staging
        self.image_size = int(prepared["image_size"])
        self.test = load_images(PREPARED_DIR / "test.npz", self.image_size)
        self.calibration = load_images(
            PREPARED_DIR / "train.npz", self.image_size, limit=self.cfg.calibration_images, seed=self.cfg.seed
        ).images
        self.results: list[Variant] = []
        self.baseline: float | None = None

    def evaluate(self, c: Candidate, backend: str) -> tuple[float, np.ndarray, float]:
        """(accuracy, logits, seconds) of a candidate on the test images, through pipeline.runtimes."""
        info = Variant(
            name=c.name,
            file=c.file,
            format=c.format,
            runtimes=c.runtimes,
            precision=c.precision,
            accuracy=0.0,
            accuracy_drop=0.0,
            size_bytes=0,
            sha256="",
            parameters=c.parameters,
            accepted=True,
        )
        runtime = open_file(self.staging / c.file, info, self.image_size, backend)
        start = time.perf_counter()
        logits = predict_all(runtime, self.test.images, self.cfg.batch_size)
        seconds = time.perf_counter() - start
        accuracy = float((logits.argmax(1) == self.test.labels).mean())
        return accuracy, logits, seconds

    def judge(self, c: Candidate, made: bool = True, error: str = "") -> Variant:
        """Evaluate a candidate and apply the gates; returns its manifest entry (also kept in results)."""
        path = self.staging / c.file
        accuracy, drop, logits, parity_entry, reasons = 0.0, 0.0, None, None, []
        if not made:
            reasons.append(error)
        else:
            backend = TORCH_EAGER if c.format != "onnx" else ONNXRUNTIME
            accuracy, logits, seconds = self.evaluate(c, backend)
            c.details.update(evaluated_on=backend, eval_seconds=round(seconds, 3))
            if self.baseline is None:
                self.baseline = accuracy
            drop = self.baseline - accuracy
            if drop > self.cfg.max_accuracy_drop + 1e-12:
                reasons.append(
                    f"accuracy drop {100 * drop:.2f} points > {100 * self.cfg.max_accuracy_drop:.2f} allowed"
                )
            if c.reference_logits is not None:
                p = export.parity(
                    c.reference_logits,
                    logits,
                    self.cfg.parity_max_abs_diff,
                    self.cfg.parity_min_top1_agreement,
                )
                parity_entry = Parity(
                    reference=c.source,
                    max_abs_diff=p.max_abs_diff,
                    top1_agreement=p.top1_agreement,
                    passed=p.passed,
                )
                if not p.passed:
                    reasons.append(
                        f"parity with {c.source} failed (max |diff| {p.max_abs_diff:.2e}, "
                        f"top-1 agreement {p.top1_agreement:.4f})"
                    )
        accepted = made and not reasons
        variant = Variant(
            name=c.name,
            file=c.file if accepted else "",
            format=c.format,
            runtimes=c.runtimes,
            precision=c.precision,
            accuracy=accuracy,
            accuracy_drop=drop,
            size_bytes=path.stat().st_size if path.exists() else 0,
            sha256=sha256_of(path) if path.exists() else "",
            parameters=c.parameters,
            accepted=accepted,
            reason="; ".join(reasons),
            parity=parity_entry,
            source=c.source,
            details={k: v for k, v in c.details.items() if isinstance(v, str | int | float | bool)},
        )
        self.results.append(variant)
        state = "accepted" if accepted else f"REJECTED ({variant.reason})"
        console.log(f"{c.name}: top-1 {accuracy:.4f} ({-100 * drop:+.2f} points), {state}")
        self.last_logits = logits
        return variant

    def attempt(self, c: Candidate, make: Callable[[], object]) -> Variant:
        """Make a candidate's file (a failure rejects it with the reason) and judge it."""
        try:
            make()
        except StageError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            return self.judge(c, made=False, error=f"could not be made: {type(exc).__name__}: {first}")
        return self.judge(c)

    def torch_family(self, prefix: str, model: nn.Module, like: dict[str, Any], extra: dict[str, Any]) -> None:
        """`<prefix>` (torch fp32) then `<prefix>-onnx` and `<prefix>-int8-onnx` from it."""
        params = nets.count_parameters(model)
        fp32 = Candidate(prefix, f"{prefix}.pt", "torch-state-dict", TORCH_RUNTIMES, "fp32", params)
        fp32.details.update(extra)
        self.attempt(fp32, lambda: save_model(self.staging / fp32.file, model, like, variant=prefix))
        torch_logits = self.last_logits
        onnx_name = "fp32-onnx" if prefix == "fp32" else f"{prefix}-onnx"
        onnx = Candidate(onnx_name, f"{onnx_name}.onnx", "onnx", [ONNXRUNTIME], "fp32", params, prefix)
        onnx.reference_logits = torch_logits
        exported = self.attempt(onnx, lambda: export.export_onnx(model, self.staging / onnx.file, self.image_size))
        if not self.cfg.int8_onnx or not (self.staging / onnx.file).exists() or exported.reason.startswith("could not"):
            return
        int8_name = "int8-onnx" if prefix == "fp32" else f"{prefix}-int8-onnx"
        int8 = Candidate(int8_name, f"{int8_name}.onnx", "onnx", [ONNXRUNTIME], "int8", params, onnx_name)

        def make_int8() -> None:
            int8.details.update(
                quantize.quantize_onnx(self.staging / onnx.file, self.calibration, self.staging / int8.file)
            )

        self.attempt(int8, make_int8)

    def run(self, model: nn.Module, payload: dict[str, Any], log: Callable[..., None]) -> None:
        cfg = self.cfg
        self.torch_family("fp32", model, payload, {})

        if cfg.int8_torch:
            c = Candidate(
                "int8-pt2e",
                "int8-pt2e.pt2",
                "torch-export",
                [TORCH_COMPILE, TORCH_EAGER],
                "int8",
                nets.count_parameters(model),
                "fp32",
            )

            def make_pt2e() -> None:
                c.details.update(
                    quantize.quantize_pt2e(model, self.calibration, self.staging / c.file),
                    machine=platform.machine(),
                )

            self.attempt(c, make_pt2e)

        native = quantize.has_native_bf16()
        if cfg.bf16 == "on" or (cfg.bf16 == "auto" and native):
            bf16_model = load_model(self.staging / "fp32.pt")[0].to(torch.bfloat16)
            c = Candidate("bf16", "bf16.pt", "torch-state-dict", TORCH_RUNTIMES, "bf16", nets.count_parameters(model))
            c.details["native_bf16"] = native
            c.source = "fp32"
            self.attempt(c, lambda: save_model(self.staging / c.file, bf16_model, payload, variant="bf16"))
        else:
            console.log("bf16: skipped (this CPU has no native bf16; set optimize.bf16 to `on` to force it)")

        if cfg.prune_amount > 0:
            pruned = load_model(self.staging / "fp32.pt")[0]
            report = prune.prune_filters(pruned, cfg.prune_amount, cfg.prune_norm)
            console.log(
                f"pruned {cfg.prune_amount:.0%} of the filters ({cfg.prune_norm}): channels "
                f"{report.channels_before} -> {report.channels_after}; fine-tuning {cfg.finetune_epochs} epoch(s)"
            )
            pruned = finetune(pruned, self.params, log, teacher=load_model(self.staging / "fp32.pt")[0].eval())
            extra = {
                "channels_before": str(report.channels_before),
                "channels_after": str(report.channels_after),
                "prune_amount": cfg.prune_amount,
                "prune_norm": cfg.prune_norm,
                "finetune_epochs": cfg.finetune_epochs,
                "finetune_distill": cfg.finetune_distill,
            }
            self.torch_family("pruned", pruned, payload, extra)


def _manifest(params: Params, prepared: dict[str, Any], payload: dict[str, Any], opt: Optimizer) -> ModelManifest:
    size = int(prepared["image_size"])
    return ModelManifest(
        architecture=str(payload["arch"]["name"]),
        classes=[str(c) for c in prepared["classes"]],
        num_classes=len(prepared["classes"]),
        image_size=size,
        preprocess=Preprocess(
            roi_margin=float(prepared.get("roi_margin", params.data.roi_margin)),
            resize=size,
            mean=[float(v) for v in payload["mean"]],
            std=[float(v) for v in payload["std"]],
        ),
        input=InputSpec(name=export.INPUT_NAME, shape=[-1, 3, size, size]),
        output=InputSpec(name=export.OUTPUT_NAME, shape=[-1, len(prepared["classes"])]),
        baseline_accuracy=float(opt.baseline or 0.0),
        test_images=len(opt.test.labels),
        max_accuracy_drop=params.optimize.max_accuracy_drop,
        variants=opt.results,
    )


def markdown_table(manifest: ModelManifest) -> str:
    lines = [
        f"Test split: {manifest.test_images} images; fp32 top-1 {manifest.baseline_accuracy:.4f}; "
        f"gate: drop <= {100 * manifest.max_accuracy_drop:.2f} points.",
        "",
        "| variant | format | top-1 | drop (points) | file size | parameters | parity (max abs diff / top-1 agreement) "
        "| shipped |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for v in manifest.variants:
        parity = f"{v.parity.max_abs_diff:.2e} / {v.parity.top1_agreement:.4f}" if v.parity else "-"
        shipped = "yes" if v.accepted else f"no: {v.reason}"
        lines.append(
            f"| {v.name} | {v.format} | {v.accuracy:.4f} | {100 * v.accuracy_drop:+.2f} | "
            f"{v.size_bytes / 1024:.1f} KiB | {v.parameters:,} | {parity} | {shipped} |"
        )
    return "\n".join(lines) + "\n"


def register_variants(
    params: Params, run_id: str, variants: list[Variant], artifact_uri: Callable[[str], str]
) -> list[int]:
    """One version of the registered model per accepted variant, tagged; returns the version numbers."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking_uri(params.tracking))
    name = params.optimize.registered_model_name
    try:
        client.create_registered_model(name, description="GTSRB traffic-sign classifier variants")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    versions = []
    for v in variants:
        mv = client.create_model_version(
            name,
            source=artifact_uri(f"variants/{v.name}"),
            run_id=run_id,
            tags={
                "variant": v.name,
                "format": v.format,
                "precision": v.precision,
                "accuracy": f"{v.accuracy:.6f}",
                "accuracy_drop": f"{v.accuracy_drop:.6f}",
                "size_bytes": str(v.size_bytes),
                "parameters": str(v.parameters),
                "sha256": v.sha256,
                "runtimes": ",".join(v.runtimes),
            },
            description=f"{v.name}: top-1 {v.accuracy:.4f}, {v.size_bytes} bytes",
        )
        versions.append(int(mv.version))
    return versions


def run(params: Params) -> None:
    cfg = params.optimize
    prepared = load_prepared_manifest(PREPARED_DIR)
    model, payload = load_trained(MODEL_PATH, prepared)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    staging = MODELS_DIR / "variants.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    opt = Optimizer(params, staging, prepared)
    with stage_run("optimize", params.tracking, {"optimize": cfg.model_dump(mode="json")}) as mlrun:
        mlrun.set_tags({"machine": platform.machine(), "torch": torch.__version__})
        opt.run(model, payload, lambda m, s: mlrun.log_metrics(m, step=s))
        manifest = _manifest(params, prepared, payload, opt)

        # Ship: only accepted files move into models/variants/, then the manifest is written.
        shutil.rmtree(VARIANTS_DIR, ignore_errors=True)
        VARIANTS_DIR.mkdir(parents=True)
        shipped = []
        for v in manifest.variants:
            if v.accepted:
                (staging / v.file).replace(VARIANTS_DIR / v.file)
                shipped.append(v.model_copy(update={"file": f"{VARIANTS_DIR.name}/{v.file}"}))
            else:
                shipped.append(v)
        shutil.rmtree(staging, ignore_errors=True)
        manifest = manifest.model_copy(update={"variants": shipped})
        manifest_path = write_manifest(MODELS_DIR, manifest)

        OPTIMIZE_REPORTS.mkdir(parents=True, exist_ok=True)
        metrics: dict[str, Any] = {
            "baseline_accuracy": manifest.baseline_accuracy,
            "test_images": manifest.test_images,
            "shipped": [v.name for v in manifest.accepted()],
            "rejected": {v.name: v.reason for v in manifest.variants if not v.accepted},
            "variants": {
                v.name: {
                    "accuracy": v.accuracy,
                    "accuracy_drop": v.accuracy_drop,
                    "size_bytes": v.size_bytes,
                    "parameters": v.parameters,
                    "accepted": v.accepted,
                    **(
                        {"parity_max_abs_diff": v.parity.max_abs_diff, "parity_top1_agreement": v.parity.top1_agreement}
                        if v.parity
                        else {}
                    ),
                }
                for v in manifest.variants
            },
        }
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
            import mlflow

            for v in manifest.accepted():
                mlrun.log_artifact(MODELS_DIR / v.file, f"variants/{v.name}")
            versions = register_variants(params, mlrun.run_id, manifest.accepted(), mlflow.get_artifact_uri)
            console.log(f"registered {len(versions)} versions of {cfg.registered_model_name!r}: {versions}")
    console.log("\n" + markdown_table(manifest))
    console.log(f"shipped {len(manifest.accepted())} variants in {VARIANTS_DIR}; manifest {manifest_path}")
