"""The train stage: the network on the prepared training split, resumable, on 1..N processes.

One process by default; `train.nproc > 1` starts that many worker processes (gloo on CPU, nccl on CUDA),
and a run under torchrun uses torchrun's processes. Every `train.checkpoint_every` steps and at the end,
the model, optimizer and loader position are saved with torch.distributed.checkpoint; rerunning the stage
resumes from the last complete checkpoint, with any number of processes, at the same global sample.

    data/prepared (artifacts.prepared) --training.engine--> models/model.pt (artifacts.model)
        + models/checkpoints/ (training.checkpoint), reports/train/{metrics.json, history.csv, curves.png}
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import console
from pipeline.architectures import backbones, nets
from pipeline.architectures.backbones import WeightsInfo
from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts import initial_weights as weights_record
from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import (
    PREPARED_DIR,
    DvcRemoteFiles,
    Files,
    PreparedManifest,
    SplitReader,
    read_manifest,
)
from pipeline.config import Params, TrainConfig
from pipeline.data.loader import AugmentConfig, TrainLoader, eval_batches, load_split, training_images
from pipeline.errors import StageError
from pipeline.machine.memory_budget import Budget
from pipeline.tracking import git_commit, metrics_logger, stage_run
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed, features
from pipeline.training.engine import Engine, Loss, accuracy, make_optimizer, one_cycle_lr, recalibrate_batchnorm

TRAIN_REPORTS = REPORTS_DIR / "train"
# Test hook: SIGKILL this process right after the given global step (and its checkpoint, if any); with
# KILL_NODE_ENV=1 its parent first (torchrun's agent): the whole machine lost at once.
KILL_AFTER_STEP_ENV = "PIPELINE_KILL_AFTER_STEP"
KILL_NODE_ENV = "PIPELINE_KILL_NODE"

# DCP warns on every save/load without a process group that it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Params that do not change the training trajectory: a checkpoint made with other values still resumes.
_NOT_TRAJECTORY = {
    "checkpoint_dir",
    "nproc",
    "strategy",
    "device",
    "compile",
    "threads",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_batch_size",
}


KEEP_OTHER_RUNS = 2  # checkpoint folders of other params/data kept beside the current run's (newest first)


def run_checkpoints(params: Params, manifest: PreparedManifest) -> Path:
    """This run's checkpoint folder: one per fingerprint, so changing a param (or the data) starts a new folder
    and switching back resumes the old one; nothing is deleted on the way."""
    return Path(params.train.checkpoint_dir) / fingerprint(params, manifest)


def retire_other_runs(current: Path, main: bool) -> None:
    """Keep the KEEP_OTHER_RUNS most recent other runs' folders; remove older ones (and step folders of the
    layout before fingerprint folders), saying so."""
    root = current.parent
    if not main or not root.is_dir():
        return
    others = [p for p in root.iterdir() if p.is_dir() and p != current]
    legacy = [p for p in others if p.name.startswith("step_")]
    runs = sorted((p for p in others if p not in legacy), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in legacy + runs[KEEP_OTHER_RUNS:]:
        console.log(f"removing old checkpoints of other params or data: {old}")
        shutil.rmtree(old, ignore_errors=True)


def fingerprint(params: Params, manifest: PreparedManifest) -> str:
    """What a checkpoint must match to be resumed: model, recipe and data (its content hash included)."""
    train = {k: v for k, v in params.train.model_dump().items() if k not in _NOT_TRAJECTORY}
    blob = json.dumps(
        {
            "model": params.model.model_dump(),
            "train": train,
            "augment": params.augment.model_dump(),
            "regularize": params.regularize.model_dump(),
            "image_size": manifest.image_size,
            "mean": manifest.mean,
            "std": manifest.std,
            "data": manifest.content_sha256,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def initial_weights(params: Params) -> tuple[WeightsInfo | None, dict[str, torch.Tensor] | None]:
    """A torchvision/timm network's initial weights (`model.weights`), checked before any training step: an
    unknown network, a missing file, another hash or a pickle that would run code is one line (StageError)."""
    m = params.model
    if not nets.is_backbone(m.name):
        if m.weights not in ("none", "auto"):
            raise StageError(f"model.weights is {m.weights!r}, but {m.name} has no pretrained weights: use none")
        return None, None
    try:
        return backbones.resolve(m.name, m.weights, m.weights_sha256)
    except (backbones.WeightsError, ValueError) as exc:
        raise StageError(str(exc)) from None


def model_arch(params: Params, manifest: PreparedManifest, weights: WeightsInfo | None = None) -> dict[str, object]:
    """The network's description, saved with the weights: the one record both building and loading use (a
    torchvision/timm network's also says where its initial weights came from and the input they expect)."""
    m = params.model
    members = nets.trained_members(m.name, m.members)
    arch = nets.arch_kwargs(
        m.name, manifest.image_size, m.width, m.dropout, len(manifest.classes), m.input_norm, members
    )
    if weights is not None:
        arch["weights"] = weights.record()
    return arch


def input_stats(manifest: PreparedManifest, weights: WeightsInfo | None) -> tuple[list[float], list[float]]:
    """The mean/std the network normalises with: pretrained weights' own (what they learned on), else the
    training split's."""
    if weights is None or weights.source == "none":
        return list(manifest.mean), list(manifest.std)
    return list(weights.mean), list(weights.std)


def build_model(
    params: Params,
    manifest: PreparedManifest,
    weights: WeightsInfo | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The network to train, with its initial weights loaded into every member (the classifier stays fresh)."""
    mean, std = input_stats(manifest, weights)
    model = nets.build_from_arch(model_arch(params, manifest, weights), mean, std)
    if state is not None and weights is not None:
        members = list(model.members) if isinstance(model, nets.Committee) else [model]
        for member in members:
            try:
                backbones.load_into(member.net, state, weights.file)  # type: ignore[arg-type]
            except backbones.WeightsError as exc:
                raise StageError(str(exc)) from None
    return model


# ----------------------------------------------------------------------------------------------- worker


def worker(
    rank: int,
    world: int,
    params: Params,
    resume: ckpt.Resume | None,
    log: Callable[[Mapping[str, float], int], None],
) -> dict[str, Any]:
    """Train in this process (one of `world`); returns the final summary on rank 0."""
    t = params.train
    d = distributed.place(rank, world, t.device, t.threads)
    amp = distributed.amp_dtype(t.amp, d.device)

    prepared = prepared_files(t.data_from)
    manifest = read_manifest(prepared)
    train_split = training_images(t.train_on_val, prepared)
    # With train_on_val the shipped model learns from every labelled image: nothing is held out to score.
    val_split = None if t.train_on_val else load_split("val", prepared)
    loader = TrainLoader(train_split, t.batch_size, t.seed, rank, world, AugmentConfig.of(params.augment))

    weights, model, optim, forward, micro_batch, eval_batch_size = _trainable(params, manifest, loader, d, world)

    trainer = _new_trainer() if resume is None else _resumed(resume, model, optim, loader, _new_trainer(), d.main)
    spe = loader.steps_per_epoch
    # `train.max_minutes` plans the epochs after each one (kept in checkpoints): the schedule anneals over those.
    epochs = _epochs(t, trainer)
    schedule = {"total": epochs * spe}

    def lr_at(at: int) -> float:
        return one_cycle_lr(at, total=schedule["total"], peak=t.lr, warmup_fraction=t.warmup_fraction)

    engine = _engine(params, len(manifest.classes), loader, model, optim, forward, lr_at, d, amp, micro_batch)

    step = loader.epoch * spe + loader.step_in_epoch
    kill_after = _kill_after_step()
    last_saved = step if resume is not None else -1
    clock = _EpochClock()

    for entry in trainer["history"] if d.main else []:  # a resumed run's MLflow run gets the whole curve
        _log_epoch(log, entry)

    # Early stopping (validation held out): the best epoch's weights, kept in memory (a resumed run keeps the best
    # since it resumed); val accuracy is the same on every rank, so every rank stops together.
    best: dict[str, Any] = {"accuracy": -1.0, "state": None, "epoch": 0, "stale": 0}
    patience = t.early_stopping_patience if val_split is not None else 0

    model.train()
    while loader.epoch < epochs and not trainer["stopped_early"]:
        epoch = loader.epoch
        remaining = spe - loader.step_in_epoch
        session_samples = 0
        clock.restart()
        batches = iter(loader)
        if d.main:
            batches = console.progress(batches, remaining, f"epoch {epoch + 1}/{epochs}")
        lr = lr_at(max(step - 1, 0))  # the last step's, if none is left
        for batch in batches:
            lr = lr_at(step)
            trainer["epoch_loss"] += engine.step(step, batch.images, batch.labels, batch.global_size)
            step += 1
            trainer["epoch_samples"] += len(batch.labels)
            session_samples += len(batch.labels)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < schedule["total"]:
                with clock.paused():  # saving is not training time
                    _save_checkpoint(params, manifest, world, step, model, optim, loader, trainer, clock, d)
                last_saved = step
            if step == kill_after:
                _kill_for_the_test()
        elapsed = clock.seconds()
        trainer["train_seconds"] += elapsed
        if val_split is not None and nets.is_backbone(params.model.name):
            # validation, and the state it keeps, read the statistics the model will serve with
            _recalibrate(model, loader, eval_batch_size, d, amp, max_images=512)
        val_acc = (
            None
            if val_split is None
            else accuracy(model, eval_batches(val_split, eval_batch_size, d.rank, d.world), d, amp)
        )
        rate = session_samples / max(elapsed, 1e-9)
        if t.max_minutes:
            # Planned again after every epoch at the mean pace so far (as Ultralytics' `time`): one slow first epoch
            # (warm-up, another program busy for a while) does not decide the whole run.
            trainer["budget_seconds"] += elapsed * spe / max(remaining, 1) + clock.seconds() - elapsed  # + validation
            mean = trainer["budget_seconds"] / (epoch + 1)
            epochs = _budgeted_epochs(t, mean, world, d.main, epoch + 1, trainer["planned_epochs"])
            trainer["planned_epochs"] = epochs
            schedule["total"] = epochs * spe
        _close_epoch(trainer, (epoch + 1, epochs), lr, val_acc, rate, world, log if d.main else None)
        if patience and val_acc is not None and _stale_for(patience, best, val_acc, model, epoch + 1, d.main):
            trainer["stopped_early"] = True
            break

    if nets.is_backbone(params.model.name) and best["state"] is None:
        _recalibrate(model, loader, eval_batch_size, d, amp)
    if last_saved != step:
        _save_checkpoint(params, manifest, world, step, model, optim, loader, trainer, clock, d)
    full = best["state"] if best["state"] is not None else ckpt.full_state_dict(model)
    summary: dict[str, Any] = {}
    if d.main:
        mean, std = input_stats(manifest, weights)
        model_file.write(
            model_file.MODEL_PATH, model_arch(params, manifest, weights), mean, std, manifest.classes, full
        )
        summary = _summary(params, trainer, best, step, len(train_split), nets.count_parameters(model), world, d)
    d.barrier()
    return summary


def _epochs(t: TrainConfig, trainer: dict[str, Any]) -> int:
    """The run's epochs: `train.epochs`, or fewer where `train.max_minutes` planned them."""
    return min(t.epochs, trainer["planned_epochs"] or t.epochs)


def _budgeted_epochs(
    t: TrainConfig, epoch_seconds: float, world: int, main: bool, done: int = 1, before: int | None = None
) -> int:
    """The epochs that fit in `train.max_minutes` at `epoch_seconds` an epoch (the mean of the `done` epochs so far,
    validation included), between `done` and `train.epochs`; every process plans with the slowest one's pace, so all
    stop together. Logged the first time and whenever the plan (`before`) changes."""
    pace = torch.tensor([epoch_seconds], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(pace, op=dist.ReduceOp.MAX)
    planned = max(1, done, min(t.epochs, int(t.max_minutes * 60 / max(float(pace[0]), 1e-9))))
    if main and planned != before:
        console.log(
            f"time budget: an epoch takes {float(pace[0]):.0f} s here"
            f"{'' if before is None else f' (the mean of {done})'}, so {planned} of train.epochs' {t.epochs} fit "
            f"in train.max_minutes={t.max_minutes:g}; the learning rate anneals over {planned}"
        )
    return planned


def _new_trainer() -> dict[str, Any]:
    """What a run carries from epoch to epoch and through a checkpoint."""
    return {
        "history": [],
        "epoch_loss": 0.0,
        "epoch_samples": 0,
        "train_seconds": 0.0,
        "stopped_early": False,  # a rerun after early stopping resumes to the end, not to more epochs
        "planned_epochs": None,  # what train.max_minutes allows, planned after each epoch (None: no budget, or not yet)
        "budget_seconds": 0.0,  # the finished epochs' seconds, validation included: their mean plans the budget
    }


def _engine(
    params: Params,
    classes: int,
    loader: TrainLoader,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    forward: nn.Module,
    lr_at: Callable[[int], float],
    d: Any,
    amp: torch.dtype | None,
    micro_batch: int,
) -> Engine:
    """The step: the loss (label smoothing, the classes' prior shift), the schedule, autocast, micro-batches."""
    t = params.train
    prior_shift = _prior_shift(t.logit_adjustment, loader.split.labels, classes, d.device)
    loss = Loss(label_smoothing=params.regularize.label_smoothing, prior_shift=prior_shift)
    return Engine(model, optim, lr_at, loss, forward=forward, d=d, amp=amp, seed=t.seed, micro_batch=micro_batch)


def _trainable(
    params: Params, manifest: Any, loader: TrainLoader, d: Any, world: int
) -> tuple[WeightsInfo | None, nn.Module, torch.optim.Optimizer, nn.Module, int, int]:
    """This process's network (initial weights, wrapped for the strategy), its optimizer, the forward to call
    (compiled or not), and the micro- and evaluation batch sizes its memory budget allows."""
    t = params.train
    torch.manual_seed(t.seed)  # the initial weights: the same on every rank, for any number of ranks
    weights, state = initial_weights(params)
    # Inputs are channels-last, so convolutions run channels-last; parameters stay contiguous (FSDP2 needs it).
    model = build_model(params, manifest, weights, state).to(device=d.device)
    budget = Budget.of(params.memory_gb, model, manifest.image_size, d.device)
    model = distributed.wrap_model(model, t.strategy, d)
    # A gentler, or frozen, backbone protects pretrained features; random weights have none to protect.
    pretrained = state is not None
    frozen_steps = t.freeze_backbone_epochs * loader.steps_per_epoch if pretrained else 0
    lr_factor = t.backbone_lr_factor if pretrained else 1.0
    optim = make_optimizer(model, t.optimizer, t.lr, params.regularize.weight_decay, lr_factor, frozen_steps)
    forward: nn.Module = torch.compile(model) if t.compile else model  # type: ignore[assignment]
    per_process = -(-t.batch_size // world)
    micro_batch = budget.micro_batch(per_process, nets.count_parameters(model), "train.batch_size", d.main)
    eval_batch_size = budget.eval_batch(t.eval_batch_size, "train.eval_batch_size", d.main)
    return weights, model, optim, forward, micro_batch, eval_batch_size


def _close_epoch(
    trainer: dict[str, Any],
    epoch_of: tuple[int, int],
    lr: float,
    val_acc: float | None,
    images_per_s: float,
    world: int,
    log: Callable[[Mapping[str, float], int], None] | None,
) -> None:
    """The epoch's record (loss and speed summed over the processes) joins the history, once; the sums restart.
    `epoch_of`: (this epoch, counted from 1; the run's epochs). `log`: the main process's, to the console and MLflow."""
    epoch, epochs = epoch_of
    loss_tensor = torch.tensor(
        [trainer["epoch_loss"], trainer["epoch_samples"], images_per_s],
        dtype=torch.float64,
    )
    if world > 1:
        dist.all_reduce(loss_tensor)
    entry = {
        "epoch": epoch,
        "train_loss": float(loss_tensor[0] / max(1.0, float(loss_tensor[1]))),
        "val_accuracy": val_acc,
        "lr": lr,
        "images_per_s": float(loss_tensor[2]),
    }
    trainer["epoch_loss"], trainer["epoch_samples"] = 0.0, 0
    if not (trainer["history"] and trainer["history"][-1]["epoch"] == entry["epoch"]):
        trainer["history"].append(entry)
    if log is not None:
        console.log(
            f"epoch {epoch}/{epochs}: loss {entry['train_loss']:.4f}, val accuracy {_figure(val_acc)}, "
            f"lr {lr:.2e}, {entry['images_per_s']:.0f} images/s"
        )
        _log_epoch(log, entry)


def _recalibrate(
    model: nn.Module, loader: TrainLoader, eval_batch_size: int, d: Any, amp: Any, max_images: int = 2048
) -> None:
    # Library networks keep BatchNorm statistics with small momenta (0.01 in torchvision's MobileNetV3 and
    # EfficientNet): re-estimated on up to `max_images` training images, so eval mode sees this data's statistics.
    spread = torch.linspace(0, len(loader.split) - 1, min(len(loader.split), max_images)).long()  # every class
    recalibrate_batchnorm(model, loader.split.images[spread], eval_batch_size // 4 or 1, d, amp)


class _EpochClock:
    """This session's part of the epoch, in training seconds: checkpoint saves are not counted."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.start, self.saving = time.perf_counter(), 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.start - self.saving

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.saving += time.perf_counter() - began


def _save_checkpoint(
    params: Params, manifest: PreparedManifest, world: int, step: int, model: nn.Module,
    optim: torch.optim.Optimizer, loader: TrainLoader, trainer: dict[str, Any], clock: _EpochClock, d: distributed.Dist,
) -> None:  # fmt: skip
    """Rank 0's buffers to every rank, then the weights, optimizer and where training is, sealed."""
    t = params.train
    distributed.buffers_from_rank0(model, t.strategy, d)
    state = _checkpoint_state(params, manifest, world, step, loader, trainer, clock.seconds())
    ckpt.save(run_checkpoints(params, manifest), step, model, optim, state, d, t.keep_checkpoints)


def _checkpoint_state(
    params: Params, manifest: PreparedManifest, world: int, step: int, loader: TrainLoader,
    trainer: dict[str, Any], session_seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """What a checkpoint records beside the weights: where training is, and what it was trained with."""
    return {
        "step": step,
        "loader": loader.state_dict(),
        "fingerprint": fingerprint(params, manifest),
        "world_size": world,
        "strategy": params.train.strategy if world > 1 else "single",
        **trainer,
        "train_seconds": trainer["train_seconds"] + session_seconds,
    }


def _resumed(
    resume: ckpt.Resume, model: nn.Module, optim: torch.optim.Optimizer, loader: TrainLoader,
    trainer: dict[str, Any], main: bool,
) -> dict[str, Any]:  # fmt: skip
    """The checkpoint's weights, optimizer and loader position loaded; its trainer state returned."""
    ckpt.load(resume.folder, model, optim)
    loader.load_state_dict(resume.state["loader"])
    if main:
        console.log(f"resumed from {resume.folder} (epoch {loader.epoch + 1}, step {resume.state['step']})")
    return {k: resume.state.get(k, v) for k, v in trainer.items()}


def _log_epoch(log: Callable[[Mapping[str, float], int], None], entry: dict[str, Any]) -> None:
    log({k: v for k, v in entry.items() if k != "epoch" and v is not None}, int(entry["epoch"]))


def _prior_shift(tau: float, labels: torch.Tensor, classes: int, device: torch.device) -> torch.Tensor | None:
    """Logit adjustment (Menon et al., 2021): training on logits + tau * log(class prior) makes the plain logits at
    inference estimate a class-balanced posterior, so rare classes are not out-voted. None when tau is 0."""
    if tau <= 0:
        return None
    counts = torch.bincount(labels, minlength=classes).clamp_(min=1).float()
    return (tau * torch.log(counts / counts.sum())).to(device)


def _kill_after_step() -> int:
    """The step after which a test kills this worker (KILL_AFTER_STEP_ENV); -1: never."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return -1  # a test's kill fires once: torchrun's restarted workers run on
    return int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0) or -1


def _kill_for_the_test() -> None:
    if os.environ.get(KILL_NODE_ENV) == "1":
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _stale_for(patience: int, best: dict[str, Any], val_acc: float, model: nn.Module, epoch: int, main: bool) -> bool:
    """Early stopping: keep the best epoch's weights in `best`; True once `patience` epochs brought no better one."""
    if val_acc > best["accuracy"]:
        best.update(accuracy=val_acc, state=ckpt.full_state_dict(model), epoch=epoch, stale=0)
    else:
        best["stale"] += 1
    if best["stale"] < patience:
        return False
    if main:
        console.log(
            f"early stopping after epoch {epoch}: no better validation accuracy for {patience} "
            f"epoch(s); keeping epoch {best['epoch']}'s weights ({best['accuracy']:.4f})"
        )
    return True


def _summary(
    params: Params,
    trainer: dict[str, Any],
    best: dict[str, Any],
    step: int,
    train_images: int,
    parameters: int,
    world: int,
    d: distributed.Dist,
) -> dict[str, Any]:
    """What rank 0 returns: the figures train.json and MLflow report."""
    t, history = params.train, trainer["history"]
    summary = {
        "val_accuracy": history[-1]["val_accuracy"] if history else None,  # None: validation was trained on
        "validation": "trained on" if t.train_on_val else "held out",
        "train_images": train_images,
        "train_loss": history[-1]["train_loss"] if history else float("nan"),
        "epochs": _epochs(t, trainer),
        "steps": step,
        "train_seconds": trainer["train_seconds"],
        "images_per_s": (step * t.batch_size) / max(trainer["train_seconds"], 1e-9),
        "parameters": parameters,
        "world_size": world,
        "device": str(d.device),
        "history": history,
    }
    if best["state"] is not None:
        summary |= {"best_epoch": best["epoch"], "best_val_accuracy": best["accuracy"]}
    if t.max_minutes:
        summary["max_minutes"] = t.max_minutes
    return summary


# ------------------------------------------------------------------------------------------ processes


def _spawned(
    rank: int,
    world: int,
    params_json: str,
    resume: ckpt.Resume | None,
    run_id: str | None,
    port: int,
    result_path: str,
) -> None:
    params = Params.model_validate_json(params_json)
    distributed.init_local_group(rank, world, distributed.choose_device(params.train.device), port)
    try:
        log = metrics_logger(params.tracking, run_id) if rank == 0 else _no_log
        summary = worker(rank, world, params, resume, log)
        if rank == 0:
            Path(result_path).write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def _no_log(metrics: Mapping[str, float], step: int) -> None:
    return None


def _check_same_run_everywhere(folder: Path, rank: int, world: int) -> None:
    """With torchrun on several machines, every rank must train the same params and data and see the same
    checkpoint folder (rank 0 seals what all ranks write): else one line on every rank, before any step."""
    token = [secrets.token_hex(8) if rank == 0 else ""]
    dist.broadcast_object_list(token, src=0)
    probe = folder.parent / f".shared-{token[0]}"
    if rank == 0:
        folder.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
    dist.barrier()
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, (folder.name, probe.exists(), socket.gethostname()))
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    differ = [r for r, (name, _, _) in enumerate(seen) if name != seen[0][0]]
    if differ:
        raise StageError(
            f"ranks {differ} ({', '.join(seen[r][2] for r in differ)}) have other params or prepared data than rank 0 "
            "(their checkpoint fingerprint differs): run every node from the same commit, params and `dvc pull`ed data"
        )
    blind = [r for r, (_, saw, _) in enumerate(seen) if not saw]
    if blind:
        raise StageError(
            f"train.checkpoint_dir {folder.parent} is not shared: ranks {blind} ({', '.join(seen[r][2] for r in blind)}) "
            "do not see what rank 0 writes there; on several machines set it to a folder every node mounts "
            "(NFS, a ReadWriteMany volume)"
        )


def _find_resume(params: Params, manifest: PreparedManifest, main: bool) -> ckpt.Resume | None:
    folder = run_checkpoints(params, manifest)
    if main:
        for partial in ckpt.partial_folders(folder):
            console.log(f"removing incomplete checkpoint {partial} (interrupted while saving)")
            shutil.rmtree(partial, ignore_errors=True)
    resume = ckpt.latest(folder)
    if resume is None:
        return None
    if resume.state.get("fingerprint") != fingerprint(params, manifest):  # a folder copied or renamed by hand
        raise StageError(f"{resume.folder} was made with other params or data than its folder name says; delete it")
    return resume


def prepared_files(data_from: str) -> Path | Files:
    """data/prepared here, or as dvc.lock records it on the DVC remote (`train.data_from`)."""
    if data_from == "dvc-remote":
        try:
            return DvcRemoteFiles(".")
        except Exception as exc:  # not a DVC repository, no remote configured: DVC's own message, in one line
            raise StageError(f"train.data_from: dvc-remote: {type(exc).__name__}: {exc}") from None
    return PREPARED_DIR


def _check_inputs(params: Params) -> PreparedManifest:
    """The prepared manifest, after checking that the training and validation shards are all there, whole (one
    line naming a missing or truncated one before any process starts)."""
    prepared = prepared_files(params.train.data_from)
    manifest = read_manifest(prepared)
    for split in ("train", "val"):
        SplitReader(split, prepared).close()
    return manifest


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


def _tracked_params(params: Params) -> dict[str, Any]:
    return params.model_dump(mode="json")


def run(params: Params) -> None:
    under_torchrun = distributed.torchrun_world()
    if under_torchrun is not None:
        _run_torchrun(params, *under_torchrun)
        return
    manifest = _check_inputs(params)
    weights, state = initial_weights(params)  # a bad name or weights file: one line, before any process starts
    if state is not None:
        build_model(params, manifest, weights, state)  # tensors that do not fit: the same, before any step
    if weights is not None and weights.source == "random":
        console.log(
            f"WARNING {params.model.name}: no pretrained weights could be had, training from RANDOM weights "
            f"(model.weights auto: {weights.note}); the model card says so"
        )
    elif weights is not None:
        console.log(
            f"{params.model.name}: weights {weights.source}"
            + (f" ({weights.file}, sha256 {weights.sha256[:12]})" if weights.file else "")
        )
    _check_recorded(weights)
    if state is not None and params.train.from_pretrained == "features":
        _run_features(params, manifest, weights, state)
        return
    world = params.train.nproc
    device = distributed.choose_device(params.train.device)
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise StageError(f"train.nproc is {world} but only {torch.cuda.device_count()} CUDA devices exist")
    resume = _find_resume(params, manifest, main=True)
    retire_other_runs(run_checkpoints(params, manifest), main=True)
    wall = time.perf_counter()
    with stage_run("train", params, _tracked_params(params), system_metrics=True) as mlrun:
        mlrun.set_tags(_environment(params, world) | _weights_tags(weights))
        _log_dataset(mlrun, manifest)
        if resume is not None:
            mlrun.set_tags({"resumed_from": str(resume.folder)})
        if world == 1:
            summary = worker(0, 1, params, resume, mlrun.log_metrics)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "summary.json"
                args = (world, params.model_dump_json(), resume, mlrun.run_id, distributed.free_port(), str(result))
                distributed.spawn(_spawned, world, args)
                summary = json.loads(result.read_text())
        _finish(mlrun, summary, wall)


def _check_recorded(weights: WeightsInfo | None) -> None:
    """The weights stage's record (models/weights.json), when there, names the file train resolved: else the
    file changed between the two, and DVC would not know what train started from."""
    if weights is None or not weights_record.WEIGHTS_PATH.is_file():
        return
    recorded = weights_record.read()
    if recorded.sha256 != weights.sha256:
        raise StageError(
            f"{weights_record.WEIGHTS_PATH} records {recorded.source} weights (sha256 {recorded.sha256[:12] or '-'}), "
            f"but train resolved {weights.source} (sha256 {weights.sha256[:12] or '-'}): run `dvc repro` (or "
            "`pipeline weights`) so the record names what train starts from"
        )


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
    wall = time.perf_counter()
    with stage_run("train", params, _tracked_params(params), system_metrics=True) as mlrun:
        mlrun.set_tags(_environment(params, 1) | _weights_tags(weights))
        _log_dataset(mlrun, manifest)
        outcome = features.fit(model, t.tail_blocks, train_split, val_split, run)
        model.eval()
        mean, std = input_stats(manifest, weights)
        arch = model_arch(params, manifest, weights)
        arch["weights"] = {**arch["weights"], "training": outcome.describe(manifest.image_size)}  # type: ignore[dict-item]
        model_file.write(model_file.MODEL_PATH, arch, mean, std, manifest.classes, model.state_dict())
        summary = _features_summary(params, outcome, manifest, len(train_split), nets.count_parameters(model))
        mlrun.log_metrics({"val_accuracy": outcome.val_accuracy, "head_val_accuracy": outcome.head.val_accuracy})
        mlrun.set_tags({"features_kept": outcome.kept, "features_cached": str(outcome.cached)})
        _finish(mlrun, summary, wall)
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
        "tail_val_accuracy": outcome.tail_val_accuracy,
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


def _weights_tags(weights: WeightsInfo | None) -> dict[str, str]:
    if weights is None:
        return {}
    return {
        "initial_weights": weights.source,
        "initial_weights_file": weights.file or "none",
        "initial_weights_sha256": weights.sha256 or "none",
    }


def _log_dataset(mlrun: Any, manifest: PreparedManifest) -> None:
    counts = {split: info.count for split, info in manifest.splits.items()}
    mlrun.log_dataset(manifest.dataset, PREPARED_DIR, manifest.content_sha256, counts, "training")


def _finish(mlrun: Any, summary: dict[str, Any], wall: float) -> None:
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
        f"val accuracy {_figure(summary['val_accuracy'])}; "
        f"model in {model_file.MODEL_PATH}"
    )


def _run_torchrun(params: Params, rank: int, world: int) -> None:
    """Under torchrun: every process calls run(); rank 0 owns the MLflow run and the reports."""
    manifest = _check_inputs(params)
    distributed.init_torchrun_group(rank, world, distributed.choose_device(params.train.device))
    try:
        _check_same_run_everywhere(run_checkpoints(params, manifest), rank, world)
        resume = _find_resume(params, manifest, main=rank == 0)
        retire_other_runs(run_checkpoints(params, manifest), main=rank == 0)
        dist.barrier()
        if rank != 0:
            worker(rank, world, params, resume, _no_log)
            return
        wall = time.perf_counter()
        with stage_run("train", params, _tracked_params(params), system_metrics=True) as mlrun:
            mlrun.set_tags(_environment(params, world) | _weights_tags(initial_weights(params)[0]))
            _log_dataset(mlrun, manifest)
            if resume is not None:
                mlrun.set_tags({"resumed_from": str(resume.folder)})
            summary = worker(rank, world, params, resume, mlrun.log_metrics)
            _finish(mlrun, summary, wall)
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------- reports


def _figure(accuracy: float | None) -> str:
    return "- (validation trained on: train.train_on_val)" if accuracy is None else f"{accuracy:.4f}"


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        epochs = [e["epoch"] for e in history]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax1.plot(epochs, [e["train_loss"] for e in history], marker="o")
        ax1.set(xlabel="epoch", ylabel="train loss", title="Training loss")
        held_out = [e for e in history if e["val_accuracy"] is not None]
        ax2.plot([e["epoch"] for e in held_out], [e["val_accuracy"] for e in held_out], marker="o", color="tab:green")
        ax2.set(
            xlabel="epoch", ylabel="accuracy", title="Validation accuracy" if held_out else "Validation: trained on"
        )
        fig.tight_layout()
        fig.savefig(TRAIN_REPORTS / "curves.png", dpi=100)
        plt.close(fig)
