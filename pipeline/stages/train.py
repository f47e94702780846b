"""The train stage: the network on the prepared training split, resumable, on 1..N processes.

One process by default; `train.nproc > 1` starts that many worker processes (gloo on CPU, nccl on CUDA),
and a run under torchrun uses torchrun's processes. Every `train.checkpoint_every` steps and at the end,
the model, optimizer and loader position are saved with torch.distributed.checkpoint; rerunning the stage
resumes from the last complete checkpoint, with any number of processes, at the same global sample.

    data/prepared (artifacts.prepared) --training.loop--> models/model.pt (artifacts.model)
        + models/checkpoints/ (training.checkpoint), reports/train/{metrics.json, history.csv, curves.png}

What the stage itself does: check its inputs and the initial weights before any process starts, pick the path (one
process, spawned processes, torchrun's, or `train.from_pretrained: features`), the one MLflow run every path opens the
same way, and the reports. The training is pipeline/training's: loop.py (one process's run), state.py (what a
checkpoint keeps), budget.py and stopping.py, inputs.py (the data and network it starts from), launch.py.
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline import console
from pipeline.architectures import nets
from pipeline.architectures.backbones import WeightsInfo
from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import PREPARED_DIR, PreparedManifest
from pipeline.config import Params
from pipeline.data.loader import load_split
from pipeline.errors import StageError
from pipeline.tracking import StageRun, git_commit, stage_run
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed, features, launch
from pipeline.training.inputs import build_model, check_inputs, input_stats, model_arch, starting_weights
from pipeline.training.loop import figure, no_log, worker

# worker: `pipeline tune` trains its trials with it; build_model and model_arch: what train builds, for tests
__all__ = ["TRAIN_REPORTS", "build_model", "model_arch", "run", "worker", "write_reports"]

TRAIN_REPORTS = REPORTS_DIR / "train"


def run(params: Params) -> None:
    under_torchrun = distributed.torchrun_world()
    if under_torchrun is not None:
        _run_torchrun(params, *under_torchrun)
        return
    manifest = check_inputs(params)
    weights, state = starting_weights(params, manifest, main=True)
    if state is not None and params.train.from_pretrained == "features":
        _run_features(params, manifest, weights, state)
        return
    world = params.train.nproc
    device = distributed.choose_device(params.train.device)
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise StageError(f"train.nproc is {world} but only {torch.cuda.device_count()} CUDA devices exist")
    resume = ckpt.find_resume(params, manifest, main=True)
    ckpt.retire_other_runs(ckpt.run_folder(params, manifest), main=True)
    with _tracked(params, manifest, weights, world, resume) as tracked:
        if world == 1:
            summary = worker(0, 1, params, resume, tracked.run.log_metrics)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "summary.json"
                args = (
                    world,
                    params.model_dump_json(),
                    resume,
                    tracked.run.run_id,
                    distributed.free_port(),
                    str(result),
                )
                distributed.spawn(launch.spawned, world, args)
                summary = json.loads(result.read_text())
        tracked.finish(summary)


def _run_torchrun(params: Params, rank: int, world: int) -> None:
    """Under torchrun: every process calls run() and checks its inputs; rank 0 says what it starts from and owns the
    MLflow run and the reports."""
    manifest = check_inputs(params)
    weights, _ = starting_weights(params, manifest, main=rank == 0)
    distributed.init_torchrun_group(rank, world, distributed.choose_device(params.train.device))
    try:
        folder = ckpt.run_folder(params, manifest)
        launch.check_same_run_everywhere(folder, rank, world)
        resume = ckpt.find_resume(params, manifest, main=rank == 0)
        ckpt.retire_other_runs(folder, main=rank == 0)
        dist.barrier()
        if rank != 0:
            worker(rank, world, params, resume, no_log)
            return
        with _tracked(params, manifest, weights, world, resume) as tracked:
            tracked.finish(worker(rank, world, params, resume, tracked.run.log_metrics))
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------- MLflow


@dataclass(frozen=True)
class _Tracked:
    """The stage's open MLflow run, and when the stage began (the summary's `wall_seconds`)."""

    run: StageRun
    wall: float

    def finish(self, summary: dict[str, Any]) -> None:
        _finish(self.run, summary, self.wall)


@contextmanager
def _tracked(
    params: Params, manifest: PreparedManifest, weights: WeightsInfo | None, world: int, resume: ckpt.Resume | None
) -> Iterator[_Tracked]:
    """The stage's MLflow run, opened the same way on every path (one process, spawned, torchrun's rank 0,
    features): every param, the environment and initial weights' tags, the data, and where a resume began."""
    wall = time.perf_counter()
    with stage_run("train", params, params.model_dump(mode="json"), system_metrics=True) as mlrun:
        mlrun.set_tags(_environment(params, world) | _weights_tags(weights))
        counts = {split: info.count for split, info in manifest.splits.items()}
        mlrun.log_dataset(manifest.dataset, PREPARED_DIR, manifest.content_sha256, counts, "training")
        if resume is not None:
            mlrun.set_tags({"resumed_from": str(resume.folder)})
        yield _Tracked(mlrun, wall)


def _environment(params: Params, world: int) -> dict[str, str]:
    device = distributed.choose_device(params.train.device)
    return {
        "torch": torch.__version__,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "backend": distributed.backend_for(device) if world > 1 else "none",
        "world_size": str(world),
        "strategy": params.train.strategy if world > 1 else "single",
        "compile": str(params.train.compile),
        "amp": str(distributed.amp_dtype(params.train.amp, device)),
        "cpu_threads": str(distributed.cpu_threads(params.train.threads, world)),
        "git_commit": git_commit(),
    }


def _weights_tags(weights: WeightsInfo | None) -> dict[str, str]:
    if weights is None:
        return {}
    return {
        "initial_weights": weights.source,
        "initial_weights_file": weights.file or "none",
        "initial_weights_sha256": weights.sha256 or "none",
    }


def _finish(mlrun: StageRun, summary: dict[str, Any], wall: float) -> None:
    """Reports, final metrics and artifacts of the stage's MLflow run, and the closing log line."""
    summary["wall_seconds"] = time.perf_counter() - wall
    write_reports(summary)
    mlrun.log_metrics({"train_seconds": summary["train_seconds"]})
    if summary["val_accuracy"] is not None:
        mlrun.log_metrics({"final_val_accuracy": summary["val_accuracy"]})
        mlrun.log_headline({"val_accuracy": summary["val_accuracy"]}, here=False)  # this run has it per epoch
    for path in (TRAIN_REPORTS / "metrics.json", TRAIN_REPORTS / "history.csv", TRAIN_REPORTS / "curves.png"):
        mlrun.log_artifact(path, "reports")
    mlrun.log_artifact(model_file.MODEL_PATH, "model")
    console.log(
        f"trained {summary['epochs']} epochs ({summary['steps']} steps) in {summary['train_seconds']:.0f} s "
        f"on {summary['world_size']} process(es), {summary['train_images']} images: "
        f"val accuracy {figure(summary['val_accuracy'])}; "
        f"model in {model_file.MODEL_PATH}"
    )


# -------------------------------------------------------------------------------------------- features


def _run_features(
    params: Params, manifest: PreparedManifest, weights: WeightsInfo | None, state: Mapping[str, torch.Tensor]
) -> None:
    """`train.from_pretrained: features` (pipeline/training/features.py), in this process: the classifier on the
    frozen backbone's cached features, then the last blocks where validation prefers them."""
    t = params.train
    torch.manual_seed(t.seed)
    torch.set_num_threads(distributed.cpu_threads(t.threads, 1))
    train_split, val_split = load_split("train", PREPARED_DIR), load_split("val", PREPARED_DIR)
    model = build_model(params, manifest, weights, state)
    run = features.FeaturesRun(
        cache=Path(t.checkpoint_dir) / "features",
        key=features.cache_key(manifest.content_sha256, weights.sha256 if weights else "", params.model.name,
                               manifest.image_size, t.tail_blocks),
        classes=len(manifest.classes), seconds=t.max_minutes * 60 or float("inf"),
        tail=features.TailSettings(t.lr * t.backbone_lr_factor, params.regularize.weight_decay,
                                   params.regularize.label_smoothing, t.epochs, seed=t.seed),
        refit_on_val=t.train_on_val,  # decided on validation, then the kept classifier learns from it too
    )  # fmt: skip
    with _tracked(params, manifest, weights, 1, None) as tracked:
        outcome = features.fit(model, t.tail_blocks, train_split, val_split, run)
        model.eval()
        mean, std = input_stats(manifest, weights)
        arch = model_arch(params, manifest, weights)
        arch["weights"] = {**arch["weights"], "training": outcome.describe(manifest.image_size)}  # type: ignore[dict-item]
        model_file.write(model_file.MODEL_PATH, arch, mean, std, manifest.classes, model.state_dict())
        summary = _features_summary(params, outcome, manifest, len(train_split), nets.count_parameters(model))
        tracked.run.log_metrics({"val_accuracy": outcome.val_accuracy, "head_val_accuracy": outcome.head.val_accuracy})
        tracked.run.set_tags({"features_kept": outcome.kept, "features_cached": str(outcome.cached)})
        tracked.finish(summary)
    console.log(f"train: {outcome.describe(manifest.image_size)}")


def _features_summary(
    params: Params, outcome: features.Outcome, manifest: PreparedManifest, train_images: int, parameters: int
) -> dict[str, Any]:
    """train.json's figures for a features run (the same keys as a full run's, plus what the features did)."""
    seconds = outcome.feature_seconds + outcome.fit_seconds
    return {
        "val_accuracy": outcome.val_accuracy,
        "validation": "decided on, then trained on" if outcome.refit_on_val else "held out",
        "train_images": train_images,
        "train_loss": float("nan"),
        "epochs": outcome.tail_epochs,
        "steps": 0,
        "train_seconds": seconds,
        "images_per_s": train_images / max(seconds, 1e-9),
        "parameters": parameters,
        "world_size": 1,
        "device": "cpu",
        "method": "features",
        "kept": outcome.kept,
        "tail_blocks": outcome.tail_blocks,
        "head_val_accuracy": outcome.head.val_accuracy,
        "head_folds_accuracy": outcome.head.folds_accuracy,
        "tail_val_accuracy": outcome.tail_val_accuracy,
        "tail_p_value": outcome.against_head.p_value if outcome.against_head else None,
        "refit_on_val": outcome.refit_on_val,
        "features_cached": outcome.cached,
        "feature_seconds": outcome.feature_seconds,
        "what": outcome.describe(manifest.image_size),
        # epoch 0: the head on frozen features; then each fine-tune epoch of the tail
        "history": [{"epoch": 0, "train_loss": float("nan"), "val_accuracy": outcome.head.val_accuracy,
                     "lr": 0.0, "images_per_s": 0.0}]
        + [{"epoch": i, "train_loss": loss, "val_accuracy": val, "lr": params.train.lr * params.train.backbone_lr_factor,
            "images_per_s": 0.0} for i, (loss, val) in enumerate(outcome.history, start=1)],
    }  # fmt: skip


# -------------------------------------------------------------------------------------------- reports


def write_reports(summary: Mapping[str, Any]) -> None:
    """reports/train/metrics.json (DVC metrics), history.csv (DVC plots) and curves.png, from one source."""
    TRAIN_REPORTS.mkdir(parents=True, exist_ok=True)
    history: list[dict[str, Any]] = list(summary.get("history", []))
    metrics = {k: v for k, v in summary.items() if k != "history"}
    (TRAIN_REPORTS / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    fields = ["epoch", "train_loss", "val_accuracy", "lr", "images_per_s"]
    with (TRAIN_REPORTS / "history.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for entry in history:
            writer.writerow({k: entry[k] for k in fields})
    if history:
        _plot_curves(history)


def _plot_curves(history: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e["epoch"] for e in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(epochs, [e["train_loss"] for e in history], marker="o")
    ax1.set(xlabel="epoch", ylabel="train loss", title="Training loss")
    held_out = [e for e in history if e["val_accuracy"] is not None]
    ax2.plot([e["epoch"] for e in held_out], [e["val_accuracy"] for e in held_out], marker="o", color="tab:green")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="Validation accuracy" if held_out else "Validation: trained on")
    fig.tight_layout()
    fig.savefig(TRAIN_REPORTS / "curves.png", dpi=100)
    plt.close(fig)
