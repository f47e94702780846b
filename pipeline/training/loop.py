"""One process's training run (`worker`): the network on the prepared training split, epoch by epoch, resumable.

Every `train.checkpoint_every` steps and at the end, the model, optimizer and loader position are saved with
torch.distributed.checkpoint beside the run's TrainState (state.py: the history, the time budget, early stopping); a
run resumed from one continues at the same global sample, with any number of processes, and plans what an
uninterrupted run would. Rank 0 writes models/model.pt and returns the run's figures.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import console
from pipeline.architectures import nets
from pipeline.architectures.backbones import WeightsInfo
from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import PreparedManifest, read_manifest
from pipeline.config import Params
from pipeline.data.loader import AugmentConfig, Split, TrainLoader, eval_batches, load_split, training_images
from pipeline.machine.memory_budget import Budget
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed
from pipeline.training.distributed import Dist
from pipeline.training.engine import Engine, Loss, accuracy, make_optimizer, one_cycle_lr, recalibrate_batchnorm
from pipeline.training.inputs import build_model, initial_weights, input_stats, model_arch, prepared_files
from pipeline.training.state import EpochRecord, MadeWith, TrainState

# Test hook: SIGKILL this process right after the given global step (and its checkpoint, if any); with
# KILL_NODE_ENV=1 its parent first (torchrun's agent): the whole machine lost at once.
KILL_AFTER_STEP_ENV = "PIPELINE_KILL_AFTER_STEP"
KILL_NODE_ENV = "PIPELINE_KILL_NODE"

# DCP warns on every save/load without a process group that it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

Log = Callable[[Mapping[str, float], int], None]
"""Per-epoch metrics (MLflow, Optuna's pruner): (metrics, epoch)."""


def worker(rank: int, world: int, params: Params, resume: ckpt.Resume | None, log: Log) -> dict[str, Any]:
    """Train in this process (one of `world`); returns the final summary on rank 0."""
    run = Session.start(rank, world, params, resume, log)
    run.train()
    return run.finish()


def no_log(metrics: Mapping[str, float], step: int) -> None:
    """The Log of a process that reports nothing (ranks other than 0)."""
    return None


def figure(accuracy: float | None) -> str:
    """A validation accuracy as the log lines say it."""
    return "- (validation trained on: train.train_on_val)" if accuracy is None else f"{accuracy:.4f}"


@dataclass(frozen=True)
class Schedule:
    """The one-cycle learning rate over the run's epochs as the time budget plans them now."""

    state: TrainState
    steps_per_epoch: int
    peak: float
    """`train.lr`."""
    warmup_fraction: float

    @property
    def total(self) -> int:
        """The run's steps: its epochs now (train.epochs, or the budget's last plan) times an epoch's."""
        return self.state.epochs * self.steps_per_epoch

    def __call__(self, at: int) -> float:
        return one_cycle_lr(at, total=self.total, peak=self.peak, warmup_fraction=self.warmup_fraction)


@dataclass
class Trainable:
    """This process's network (initial weights, wrapped for the strategy), its optimizer, the forward to call
    (compiled or not), and the batch sizes its memory budget allows."""

    weights: WeightsInfo | None
    model: nn.Module
    optim: torch.optim.Optimizer
    forward: nn.Module
    micro_batch: int
    eval_batch_size: int


@dataclass
class Session:
    """One process's training run, from its set-up (or resume) to models/model.pt."""

    params: Params
    d: Dist
    """This process's rank, of how many, on which device."""
    amp: torch.dtype | None
    """bf16 autocast, or None (fp32)."""
    manifest: PreparedManifest
    loader: TrainLoader
    """The training split's batches; its position (epoch, offset) is where the run is."""
    val_split: Split | None
    """None: validation is trained on (`train.train_on_val`)."""
    net: Trainable
    state: TrainState
    """What a checkpoint keeps beside the weights: the history, the time budget, early stopping."""
    schedule: Schedule
    """The learning rate at a step: over the epochs the budget plans now."""
    engine: Engine
    folder: Path
    """The run's checkpoint folder (checkpoint.run_folder)."""
    made: MadeWith
    log: Log
    """The main process's per-epoch metrics (MLflow, a tune trial's pruner); no_log elsewhere."""
    step: int
    """Global steps done."""
    last_saved: int
    """The step of the last checkpoint (-1: none in this session or before it)."""
    kill_after: int
    """The test hook's step (KILL_AFTER_STEP_ENV); -1: never."""
    clock: EpochClock

    @classmethod
    def start(cls, rank: int, world: int, params: Params, resume: ckpt.Resume | None, log: Log) -> Session:
        t = params.train
        d = distributed.place(rank, world, t.device, t.threads)
        prepared = prepared_files(t.data_from)
        manifest = read_manifest(prepared)
        train_split = training_images(t.train_on_val, prepared)
        # With train_on_val the shipped model learns from every labelled image: nothing is held out to score.
        val_split = None if t.train_on_val else load_split("val", prepared)
        loader = TrainLoader(train_split, t.batch_size, t.seed, rank, world, AugmentConfig.of(params.augment))
        net = trainable(params, manifest, loader, d)
        state = TrainState.new(t, held_out=val_split is not None)
        if resume is not None:
            resumed(resume, net.model, net.optim, loader, state, d.main)
        schedule = Schedule(state, loader.steps_per_epoch, t.lr, t.warmup_fraction)
        amp = distributed.amp_dtype(t.amp, d.device)
        engine = _engine(params, len(manifest.classes), loader, net, schedule, d, amp)
        made = MadeWith(ckpt.fingerprint(params, manifest), world, t.strategy if world > 1 else "single")
        step = loader.epoch * loader.steps_per_epoch + loader.step_in_epoch
        folder = ckpt.run_folder(params, manifest)
        last_saved = step if resume is not None else -1
        run = cls(params, d, amp, manifest, loader, val_split, net, state, schedule, engine, folder, made, log,
                  step, last_saved, _kill_after_step(), EpochClock())  # fmt: skip
        for entry in state.history if d.main else []:  # a resumed run's MLflow run gets the whole curve
            log_epoch(log, entry)
        return run

    def train(self) -> None:
        """Epochs until the run's epochs (the budget may plan fewer after each) or early stopping end it."""
        self.net.model.train()
        while self.loader.epoch < self.state.epochs and not self.state.done:
            self._epoch()

    def _epoch(self) -> None:
        t, spe = self.params.train, self.loader.steps_per_epoch
        epoch = self.loader.epoch
        remaining = spe - self.loader.step_in_epoch
        samples = 0
        self.clock.restart()
        batches: Iterator[Any] = iter(self.loader)
        if self.d.main:
            batches = console.progress(batches, remaining, f"epoch {epoch + 1}/{self.state.epochs}")
        lr = self.schedule(max(self.step - 1, 0))  # the last step's, if none is left
        for batch in batches:
            lr = self.schedule(self.step)
            self.state.add(
                self.engine.step(self.step, batch.images, batch.labels, batch.global_size), len(batch.labels)
            )
            self.step += 1
            samples += len(batch.labels)
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < self.schedule.total:
                with self.clock.paused():  # saving is not training time
                    self.save()
            if self.step == self.kill_after:
                _kill_for_the_test()
        self._end_epoch(epoch, remaining, lr, samples)

    def _end_epoch(self, epoch: int, remaining: int, lr: float, samples: int) -> None:
        """Validation, then the epoch's record, the budget's plan and early stopping (`epoch` counted from 0,
        `remaining` its steps this session trained)."""
        elapsed = self.clock.seconds()
        self.state.train_seconds += elapsed
        if self.val_split is not None and nets.is_backbone(self.params.model.name):
            # validation, and the state it keeps, read the statistics the model will serve with
            self._recalibrate(max_images=512)
        val_acc = None
        if self.val_split is not None:
            batches = eval_batches(self.val_split, self.net.eval_batch_size, self.d.rank, self.d.world)
            val_acc = accuracy(self.net.model, batches, self.d, self.amp)
        # the epoch's seconds: this session's part over the whole epoch, + validation
        spe = self.loader.steps_per_epoch
        seconds = elapsed * spe / max(remaining, 1) + self.clock.seconds() - elapsed
        self.state.budget.after_epoch(epoch + 1, seconds, self.d.world, self.d.main)
        self._close_epoch(epoch + 1, lr, val_acc, samples / max(elapsed, 1e-9))
        self.state.stopping.after_epoch(epoch + 1, val_acc, lambda: ckpt.full_state_dict(self.net.model), self.d.main)

    def _close_epoch(self, epoch: int, lr: float, val_acc: float | None, images_per_s: float) -> None:
        """The epoch's record (loss and speed summed over the processes) joins the history; the main process logs
        it, to the console and `log`."""
        totals = torch.tensor([self.state.epoch_loss, self.state.epoch_samples, images_per_s], dtype=torch.float64)
        if self.d.world > 1:
            dist.all_reduce(totals)
        record = EpochRecord(epoch, float(totals[0] / max(1.0, float(totals[1]))), val_acc, lr, float(totals[2]))
        self.state.close_epoch(record)
        if self.d.main:
            console.log(
                f"epoch {epoch}/{self.state.epochs}: loss {record.train_loss:.4f}, val accuracy {figure(val_acc)}, "
                f"lr {lr:.2e}, {record.images_per_s:.0f} images/s"
            )
            log_epoch(self.log, record)

    def save(self) -> None:
        """A checkpoint: rank 0's buffers to every rank, then the weights, optimizer and TrainState, sealed."""
        t = self.params.train
        distributed.buffers_from_rank0(self.net.model, t.strategy, self.d)
        saved = self.state.checkpoint(self.made, self.step, self.loader.state_dict(), self.clock.seconds())
        best = self.state.stopping.weights if self.d.main else None
        ckpt.save(self.folder, self.step, self.net.model, self.net.optim, saved, self.d, t.keep_checkpoints, best)
        self.last_saved = self.step

    def finish(self) -> dict[str, Any]:
        """The last checkpoint and models/model.pt (early stopping's best epoch, else the last); rank 0's figures."""
        stopping, model = self.state.stopping, self.net.model
        if nets.is_backbone(self.params.model.name) and not stopping.kept:
            self._recalibrate()
        if self.last_saved != self.step:
            self.save()
        full = stopping.weights if stopping.kept else ckpt.full_state_dict(model)
        summary: dict[str, Any] = {}
        if self.d.main:
            assert full is not None  # rank 0 holds the best epoch's weights (resumed: from the checkpoint)
            weights, manifest = self.net.weights, self.manifest
            mean, std = input_stats(manifest, weights)
            arch = model_arch(self.params, manifest, weights)
            model_file.write(model_file.MODEL_PATH, arch, mean, std, manifest.classes, full)
            summary = self.summary()
        self.d.barrier()
        return summary

    def summary(self) -> dict[str, Any]:
        """What rank 0 returns: the figures train.json and MLflow report."""
        t, history = self.params.train, self.state.history
        summary = {
            "val_accuracy": history[-1].val_accuracy if history else None,  # None: validation was trained on
            "validation": "trained on" if t.train_on_val else "held out",
            "train_images": len(self.loader.split),
            "train_loss": history[-1].train_loss if history else float("nan"),
            "epochs": self.state.epochs,
            "steps": self.step,
            "train_seconds": self.state.train_seconds,
            "images_per_s": (self.step * t.batch_size) / max(self.state.train_seconds, 1e-9),
            "parameters": nets.count_parameters(self.net.model),
            "world_size": self.d.world,
            "device": str(self.d.device),
            "history": [entry.row() for entry in history],
        }
        if self.state.stopping.kept:
            summary |= {
                "best_epoch": self.state.stopping.best_epoch,
                "best_val_accuracy": self.state.stopping.best_accuracy,
            }
        if t.max_minutes:
            summary["max_minutes"] = t.max_minutes
        return summary

    def _recalibrate(self, max_images: int = 2048) -> None:
        # Library networks keep BatchNorm statistics with small momenta (0.01 in torchvision's MobileNetV3 and
        # EfficientNet): re-estimated on up to `max_images` training images, so eval mode sees this data's statistics.
        split = self.loader.split
        spread = torch.linspace(0, len(split) - 1, min(len(split), max_images)).long()  # every class
        batch = self.net.eval_batch_size // 4 or 1
        recalibrate_batchnorm(self.net.model, split.images[spread], batch, self.d, self.amp)


def trainable(params: Params, manifest: PreparedManifest, loader: TrainLoader, d: Dist) -> Trainable:
    """This process's network, optimizer, forward and batch sizes (Trainable)."""
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
    per_process = -(-t.batch_size // d.world)
    micro_batch = budget.micro_batch(per_process, nets.count_parameters(model), "train.batch_size", d.main)
    eval_batch_size = budget.eval_batch(t.eval_batch_size, "train.eval_batch_size", d.main)
    return Trainable(weights, model, optim, forward, micro_batch, eval_batch_size)


def resumed(
    resume: ckpt.Resume, model: nn.Module, optim: torch.optim.Optimizer, loader: TrainLoader, state: TrainState,
    main: bool,
) -> None:  # fmt: skip
    """The checkpoint's weights, optimizer, loader position and TrainState (with early stopping's best weights on
    the main process) loaded in place."""
    ckpt.load(resume.folder, model, optim)
    loader.load_state_dict(resume.state["loader"])
    state.restore(resume.state, resume.folder)
    if main and state.stopping.kept:
        state.stopping.weights = ckpt.best_weights(resume.folder)
    if main:
        console.log(f"resumed from {resume.folder} (epoch {loader.epoch + 1}, step {resume.state['step']})")


def _engine(
    params: Params, classes: int, loader: TrainLoader, net: Trainable, schedule: Schedule, d: Dist,
    amp: torch.dtype | None,
) -> Engine:  # fmt: skip
    """The step: the loss (label smoothing, the classes' prior shift), the schedule, autocast, micro-batches."""
    t = params.train
    prior_shift = _prior_shift(t.logit_adjustment, loader.split.labels, classes, d.device)
    loss = Loss(label_smoothing=params.regularize.label_smoothing, prior_shift=prior_shift)
    return Engine(net.model, net.optim, schedule, loss, forward=net.forward, d=d, amp=amp, seed=t.seed,
                  micro_batch=net.micro_batch)  # fmt: skip


def _prior_shift(tau: float, labels: torch.Tensor, classes: int, device: torch.device) -> torch.Tensor | None:
    """Logit adjustment (Menon et al., 2021): training on logits + tau * log(class prior) makes the plain logits at
    inference estimate a class-balanced posterior, so rare classes are not out-voted. None when tau is 0."""
    if tau <= 0:
        return None
    counts = torch.bincount(labels, minlength=classes).clamp_(min=1).float()
    return (tau * torch.log(counts / counts.sum())).to(device)


def log_epoch(log: Log, entry: EpochRecord) -> None:
    log({k: v for k, v in entry.row().items() if k != "epoch" and v is not None}, entry.epoch)


class EpochClock:
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


def _kill_after_step() -> int:
    """The step after which a test kills this worker (KILL_AFTER_STEP_ENV); -1: never."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return -1  # a test's kill fires once: torchrun's restarted workers run on
    return int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0) or -1


def _kill_for_the_test() -> None:
    if os.environ.get(KILL_NODE_ENV) == "1":
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
