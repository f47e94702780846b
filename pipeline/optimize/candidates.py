"""Making and judging the optimize stage's variants of the trained model (pipeline/stages/optimize.py ships them).

Every candidate file is made in a staging folder, evaluated through pipeline.runtimes (the code the benchmark and
the server use), and accepted only when its top-1 on the gate's images is within `optimize.max_accuracy_drop` of
the fp32 model's (and, for ONNX exports, its parity with torch passes).

The gate decides on images whose labels no decision may read but validation's: with validation held out from training
(`train.train_on_val: false`, framed as served) it is the candidates' accuracy there; otherwise it is label-free,
each candidate's top-1 agreement with the fp32 model on the test split's original files as the server decodes them
(disagreement bounds any accuracy change from above, so the gate is never looser than an accuracy drop). The test
labels only fill the report (`served_accuracy`), read once by evaluate for the headline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from pipeline import console
from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from pipeline.artifacts.checksum import sha256_of
from pipeline.artifacts.prepared import PREPARED_DIR, ModelInput, PreparedManifest, read_split
from pipeline.artifacts.variants import TRAINED, InputSpec, ModelManifest, Parity, Preprocess, Variant
from pipeline.config import OptimizeConfig, Params
from pipeline.errors import StageError
from pipeline.images.served_input import served_test_input
from pipeline.machine.memory_budget import Budget
from pipeline.optimize import export, quantize
from pipeline.optimize.families import VARIANT_FAMILIES, MetricLogger, family
from pipeline.runtimes import open_file, runtimes_for


def load_images(split: str, image_size: int) -> ModelInput:
    """A prepared split as model input, read a batch at a time."""
    images = ModelInput.of_split(split, PREPARED_DIR, image_size=image_size)
    if len(images) == 0:
        raise StageError(f"{PREPARED_DIR / split} holds no images; rerun `pipeline prepare`")
    return images


def calibration_images(image_size: int, count: int, seed: int) -> np.ndarray:
    """A seeded random subset of the training split, in memory (a few hundred images), as model input."""
    arrays = read_split("train", PREPARED_DIR, image_size=image_size, limit=count, seed=seed)
    if len(arrays) == 0:
        raise StageError(f"{PREPARED_DIR / 'train'} holds no images; rerun `pipeline prepare`")
    return arrays.model_input()


def held_out_validation(params: Params, prepared: PreparedManifest) -> ModelInput | None:
    """The validation split when it joins the gate (the module's docstring): held out from training
    (`train.train_on_val: false`) and framed as served; else None."""
    if params.train.train_on_val or prepared.framing != "served":
        return None
    val = ModelInput.of_split("val", PREPARED_DIR, image_size=prepared.image_size)
    return val if len(val) else None


def predict_all(runtime: Any, images: ModelInput, batch_size: int) -> np.ndarray:
    """[N, C] logits, the images read and converted a batch at a time."""
    return np.concatenate([runtime.predict(batch) for batch in images.batches(batch_size)])


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


class VariantMaker:
    """Makes the candidates in a staging folder and evaluates them; `run` ships the accepted ones."""

    def __init__(self, params: Params, staging: Path, prepared: PreparedManifest, budget: Budget | None = None) -> None:
        self.params = params
        self.budget = budget or Budget(0, 0)  # memory_budget: what each batch may hold
        self.cfg: OptimizeConfig = params.optimize
        self.staging = staging
        self.image_size = prepared.image_size
        self.test = load_images("test", self.image_size)
        self.calibration = calibration_images(self.image_size, self.cfg.calibration_images, self.cfg.seed)
        self.served = served_test_input()  # what users send, as the server decodes it
        self.served_is_test = not prepared.boxes  # without boxes the test arrays are that input: scored once
        self.gate_val = None if self.served is None else held_out_validation(params, prepared)
        self.results: list[Variant] = []
        self.baseline: float | None = None
        self.baseline_predicted: np.ndarray | None = None  # the fp32 model's classes of the served test files

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
        logits = predict_all(runtime, self.test, self.cfg.batch_size)
        seconds = time.perf_counter() - start
        accuracy = float((logits.argmax(1) == self.test.labels).mean())
        if self.served is not None:  # what users send: the original files, whole, as the server decodes them
            served_logits = logits if self.served_is_test else predict_all(runtime, self.served, self.cfg.batch_size)
            served_predicted = served_logits.argmax(1)
            hits = served_predicted == self.served.labels
            c.details["served_accuracy"] = float(hits.mean())
            c.details["served_predicted"] = served_predicted.astype(int).tolist()
            if self.gate_val is not None:  # validation held out: the decision reads its labels, never the test's
                val_predicted = predict_all(runtime, self.gate_val, self.cfg.batch_size).argmax(1)
                c.details["val_accuracy"] = float((val_predicted == self.gate_val.labels).mean())
                c.details["gate_accuracy"] = c.details["val_accuracy"]
                c.details["gate_images"] = len(self.gate_val.labels)
                c.details["gate_on"] = "validation"
            else:  # label-free: agreement with the fp32 model on the files users send
                if self.baseline_predicted is None:
                    self.baseline_predicted = served_predicted
                c.details["gate_accuracy"] = float((served_predicted == self.baseline_predicted).mean())
                c.details["gate_images"] = len(served_predicted)
                c.details["gate_on"] = "agreement with fp32 (no labels)"
        return accuracy, logits, seconds

    def judge(self, c: Candidate, made: bool = True, error: str = "") -> Variant:
        """Evaluate a candidate and apply the gates; returns its manifest entry (also kept in results)."""
        path = self.staging / c.file
        accuracy, drop, logits, parity_entry, reasons = 0.0, 0.0, None, None, []
        if not made:
            reasons.append(error)
        else:
            backend = runtimes_for(c.format)[0]  # the table's first backend for the format
            accuracy, logits, seconds = self.evaluate(c, backend)
            c.details.update(evaluated_on=backend, eval_seconds=round(seconds, 3))
            # The gate is on what users get: the original files as served (and validation framed as served), where
            # the prepared data keeps them; else on the ROI crops.
            gated = float(c.details.get("gate_accuracy", accuracy))
            if self.baseline is None:
                self.baseline = gated
            drop = self.baseline - gated
            if drop > self.cfg.max_accuracy_drop + 1e-12:
                reasons.append(
                    f"accuracy drop {100 * drop:.2f} points > {100 * self.cfg.max_accuracy_drop:.2f} allowed"
                )
            if c.reference_logits is not None:
                parity_entry = self.parity(c, c.reference_logits, logits)
                if not parity_entry.passed:
                    reasons.append(
                        f"parity with {c.source} failed (max |diff| {parity_entry.max_abs_diff:.2e}, "
                        f"{parity_entry.max_rel_diff:.2e} of the image's largest logit, "
                        f"top-1 agreement {parity_entry.top1_agreement:.4f})"
                    )
        accepted = made and not reasons
        variant = Variant(
            name=c.name,
            file=c.file if accepted else "",
            format=c.format,
            runtimes=c.runtimes,
            precision=c.precision,
            accuracy=accuracy,
            served_accuracy=c.details.pop("served_accuracy", None) if made else None,
            served_predicted=c.details.pop("served_predicted", None) if made else None,
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
        self.last_logits = logits
        console.log(judged_line(variant))
        return variant

    def parity(self, c: Candidate, reference: np.ndarray, logits: np.ndarray) -> Parity:
        """An export's logits against its source's on the same test images (`optimize.parity_*` bounds)."""
        cfg = self.cfg
        p = export.parity(reference, logits, cfg.parity_max_abs_diff, cfg.parity_min_top1_agreement,
                          cfg.parity_max_rel_diff)  # fmt: skip
        return Parity(reference=c.source, max_abs_diff=p.max_abs_diff, max_rel_diff=p.max_rel_diff,
                      top1_agreement=p.top1_agreement, passed=p.passed)  # fmt: skip

    def attempt(self, c: Candidate, make: Callable[[], object]) -> Variant:
        """Make a candidate's file (a failure rejects it with the reason) and judge it."""
        how = f"calibrating on {len(self.calibration)} training images" if c.precision == "int8" else c.format
        console.log(f"{c.name}: making it from {c.source or 'the trained model'} ({how}) ...")
        started = time.perf_counter()
        try:
            make()
        except StageError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            return self.judge(c, made=False, error=f"could not be made: {type(exc).__name__}: {first}")
        console.log(f"{c.name}: made in {time.perf_counter() - started:.1f} s; checking accuracy and parity")
        return self.judge(c)

    def torch_family(self, prefix: str, model: nn.Module, payload: dict[str, Any], settings: dict[str, Any]) -> None:
        """`<prefix>` (a torch fp32 file) then `<prefix>-onnx` and `<prefix>-int8-onnx` from it (the trained
        model's are fp32-onnx and int8-onnx); `settings` go into each one's details."""
        params = nets.count_parameters(model)
        settings = {**settings, "macs": nets.count_macs(model, self.image_size)}  # the same graph in every format
        fmt = "torch-state-dict"
        torch_file = Candidate(prefix, f"{prefix}.pt", fmt, runtimes_for(fmt), "fp32", params)
        torch_file.details.update(settings)
        self.attempt(
            torch_file, lambda: model_file.write_like(self.staging / torch_file.file, model, payload, variant=prefix)
        )
        torch_logits = self.last_logits
        onnx_name = f"{prefix}-onnx"
        onnx = Candidate(onnx_name, f"{onnx_name}.onnx", "onnx", runtimes_for("onnx"), "fp32", params, prefix)
        onnx.reference_logits = torch_logits
        onnx.details["macs"] = settings["macs"]
        exported = self.attempt(onnx, lambda: export.export_onnx(model, self.staging / onnx.file, self.image_size))
        if not self.cfg.int8_onnx or not (self.staging / onnx.file).exists() or exported.reason.startswith("could not"):
            return
        int8_name = "int8-onnx" if prefix == TRAINED else f"{prefix}-int8-onnx"
        int8 = Candidate(int8_name, f"{int8_name}.onnx", "onnx", runtimes_for("onnx"), "int8", params, onnx_name)
        int8.details["macs"] = settings["macs"]

        def make_int8() -> None:
            batch = self.budget.calibration_batch(quantize.CALIBRATION_BATCH, "int8 calibration batch")
            int8.details.update(
                quantize.quantize_onnx(
                    self.staging / onnx.file, self.calibration, self.staging / int8.file, batch_size=batch
                )
            )

        self.attempt(int8, make_int8)

    def run(self, model: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
        """Every family of the table that `optimize.*` asks for, in the table's order (the trained model first)."""
        for name in VARIANT_FAMILIES:
            made = family(name)
            if made.wanted(self.cfg):
                made.make(self, name, model, payload, log)


def judged_line(variant: Variant) -> str:
    """The log's line for a judged variant: its figures and whether it ships."""
    state = "accepted" if variant.accepted else f"REJECTED ({variant.reason})"
    served = f"served {variant.served_accuracy:.4f}, " if variant.served_accuracy is not None else ""
    on_gate = variant.details.get("gate_accuracy")
    gate = "" if on_gate is None else f"gate {float(on_gate):.4f} on {variant.details['gate_images']} served images, "
    return (
        f"{variant.name}: {served}{gate}ROI top-1 {variant.accuracy:.4f}; {-100 * variant.accuracy_drop:+.2f} points "
        f"on the gate, {state}"
    )


def build_manifest(
    params: Params, prepared: PreparedManifest, payload: dict[str, Any], maker: VariantMaker
) -> ModelManifest:
    size = prepared.image_size
    return ModelManifest(
        architecture=str(payload["arch"]["name"]),
        initial_weights=payload["arch"].get("weights"),
        classes=list(prepared.classes),
        num_classes=len(prepared.classes),
        image_size=size,
        preprocess=Preprocess(
            roi_margin=prepared.roi_margin,
            resize=size,
            mean=[float(v) for v in payload["mean"]],
            std=[float(v) for v in payload["std"]],
            crop=prepared.crop,
            resize_mode=prepared.resize_mode,
            interpolation=prepared.interpolation,
            reduced_jpeg_decode=prepared.reduced_jpeg_decode,
        ),
        input=InputSpec(name=export.INPUT_NAME, shape=[-1, 3, size, size]),
        output=InputSpec(name=export.OUTPUT_NAME, shape=[-1, len(prepared.classes)]),
        baseline_accuracy=float(maker.baseline or 0.0),
        test_images=len(maker.test.labels),
        max_accuracy_drop=params.optimize.max_accuracy_drop,
        variants=maker.results,
    )


def markdown_table(manifest: ModelManifest) -> str:
    gate_images = next((v.details.get("gate_images") for v in manifest.variants if "gate_images" in v.details), None)
    with_val = any("val_accuracy" in v.details for v in manifest.variants)
    what = (
        "validation accuracy, held out" if with_val else "top-1 agreement with fp32 on the test files, no labels read"
    )
    gate = f"{gate_images} served images, {what}" if gate_images else "the test split's crops"
    lines = [
        f"Gate: {gate}; fp32 {manifest.baseline_accuracy:.4f}; a variant ships within "
        f"{100 * manifest.max_accuracy_drop:.2f} points of it.",
        "",
        "| variant | format | top-1 (ROI crops) | served top-1 (test files, whole) | gate top-1 | drop (points) "
        "| file size | parameters | parity (max abs diff / relative / top-1 agreement) | shipped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for v in manifest.variants:
        parity = "-"
        if v.parity:
            rel = "-" if v.parity.max_rel_diff is None else f"{v.parity.max_rel_diff:.2e}"
            parity = f"{v.parity.max_abs_diff:.2e} / {rel} / {v.parity.top1_agreement:.4f}"
        shipped = "yes" if v.accepted else f"no: {v.reason}"
        gated = v.details.get("gate_accuracy")
        lines.append(
            f"| {v.name} | {v.format} | {v.accuracy:.4f} | "
            f"{'-' if v.served_accuracy is None else f'{v.served_accuracy:.4f}'} | "
            f"{'-' if gated is None else f'{float(gated):.4f}'} | {100 * v.accuracy_drop:+.2f} | "
            f"{v.size_bytes / 1024:.1f} KiB | {v.parameters:,} | {parity} | {shipped} |"
        )
    return "\n".join(lines) + "\n"
