"""The train stage: device, processes (DDP / FSDP2), torch.compile, bf16, checkpoints and exact resume.

One process by default; `train.nproc > 1` starts that many worker processes (gloo on CPU, nccl on CUDA),
and a run under torchrun uses torchrun's processes. Every `train.checkpoint_every` steps and at the end,
the model, optimizer and loader position are saved with torch.distributed.checkpoint; rerunning the stage
resumes from the last complete checkpoint, with any number of processes, at the same global sample.

Outputs: models/model.pt (plain state_dict + architecture, loadable with weights_only=True),
models/checkpoints/, reports/train/{metrics.json, history.csv, curves.png}; one MLflow run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import checkpoint as ckpt
from pipeline import console, nets
from pipeline.config import MODELS_DIR, PREPARED_DIR, REPORTS_DIR, Params
from pipeline.data.loader import AugmentConfig, Manifest, TrainLoader, eval_batches, load_manifest, load_split
from pipeline.errors import StageError
from pipeline.tracking import git_commit, metrics_logger, stage_run

CHECKPOINTS_DIR = MODELS_DIR / "checkpoints"
MODEL_PATH = MODELS_DIR / "model.pt"
TRAIN_REPORTS = REPORTS_DIR / "train"
# Test hook: SIGKILL this process right after the given global step (and its checkpoint, if any).
KILL_AFTER_STEP_ENV = "PIPELINE_KILL_AFTER_STEP"

# DCP warns on every save/load without a process group that it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Params that do not change the training trajectory: a checkpoint made with other values still resumes.
_NOT_TRAJECTORY = {
    "nproc",
    "strategy",
    "device",
    "compile",
    "threads",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_batch_size",
}


def fingerprint(params: Params, manifest: Manifest) -> str:
    """What a checkpoint must match to be resumed: model, recipe and data."""
    train = {k: v for k, v in params.train.model_dump().items() if k not in _NOT_TRAJECTORY}
    blob = json.dumps(
        {
            "model": params.model.model_dump(),
            "train": train,
            "image_size": manifest.image_size,
            "mean": manifest.mean,
            "std": manifest.std,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def lr_at(step: int, total: int, peak: float, warmup_fraction: float) -> float:
    """One-cycle: linear warm-up from peak/25 to peak, then cosine decay to zero. `step` counts from 0."""
    warm = int(total * warmup_fraction)
    if step < warm:
        return peak / 25 + (peak - peak / 25) * step / warm
    span = max(1, total - warm)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / span)))


def _seed(*values: int) -> int:
    digest = hashlib.sha256(",".join(map(str, values)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def choose_device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        raise StageError("train.device is cuda but no CUDA device is available")
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if amp == "bf16":
        return torch.bfloat16
    if amp == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def augment_config(params: Params) -> AugmentConfig:
    t = params.train
    if not t.augment:
        return AugmentConfig(0.0, 0.0, (1.0, 1.0), 0.0, 0.0, 0.0, 0.0)
    return AugmentConfig(
        degrees=t.rotation,
        translate=t.translate,
        scale=(1 - t.scale, 1 + t.scale),
        shear=t.shear,
        brightness=t.color_jitter,
        contrast=t.color_jitter,
        saturation=t.color_jitter,
    )


def model_arch(params: Params, manifest: Manifest) -> dict[str, object]:
    """The network's description, saved with the weights: the one record both building and loading use."""
    m = params.model
    return nets.arch_kwargs(
        m.name, manifest.image_size, m.width, m.dropout, len(manifest.classes), m.input_norm, m.members
    )


def build_model(params: Params, manifest: Manifest) -> nn.Module:
    return nets.build_from_arch(model_arch(params, manifest), manifest.mean, manifest.std)


# ----------------------------------------------------------------------------------------------- worker


def wrap_model(model: nn.Module, params: Params, d: Dist) -> nn.Module:
    if d.world == 1:
        return model
    if params.train.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [d.device.index] if d.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,))
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module, params: Params) -> torch.optim.Optimizer:
    t = params.train
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # biases and BatchNorm: no weight decay
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(groups, lr=t.lr)


def evaluate_accuracy(model: nn.Module, split: Any, batch_size: int, d: Dist, dtype: torch.dtype | None) -> float:
    """Accuracy over the whole split; every rank evaluates its shard and the counts are summed."""
    was_training = model.training
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), _autocast(d.device, dtype):
        for images, labels, valid in eval_batches(split, batch_size, d.rank, d.world):
            logits = model(images.to(d.device, non_blocking=True))
            pred = logits[:valid].argmax(1).cpu()
            correct[0] += float((pred == labels[:valid]).sum())
            correct[1] += valid
    if d.world > 1:
        dist.all_reduce(correct)
    model.train(was_training)
    return float(correct[0] / max(1.0, float(correct[1])))


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def _save(
    step: int,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    d: Dist,
    keep: int,
) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    partial = CHECKPOINTS_DIR / (ckpt.folder_name(step) + ckpt.PARTIAL_SUFFIX)
    if d.main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    d.barrier()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    d.barrier()
    final = CHECKPOINTS_DIR / ckpt.folder_name(step)
    if d.main:
        ckpt.seal(partial, trainer_state)
        ckpt.prune(CHECKPOINTS_DIR, keep)
    d.barrier()
    return final


def _load(folder: Path, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))  # loads in place
    except Exception as exc:
        raise StageError(f"checkpoint {folder} cannot be loaded ({type(exc).__name__}: {exc})") from None
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def worker(
    rank: int,
    world: int,
    params: Params,
    resume: ckpt.Resume | None,
    log: Callable[[Mapping[str, float], int], None],
) -> dict[str, Any]:
    """Train in this process (one of `world`); returns the final summary on rank 0."""
    t = params.train
    device = choose_device(t.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(t.threads or max(1, (os.cpu_count() or 1) // world))
    d = Dist(rank, world, device)
    dtype = amp_dtype(t.amp, device)

    manifest = load_manifest(PREPARED_DIR)
    train_split = load_split(PREPARED_DIR, "train")
    val_split = load_split(PREPARED_DIR, "val")
    loader = TrainLoader(train_split, t.batch_size, t.seed, rank, world, augment_config(params))

    torch.manual_seed(t.seed)  # the initial weights: the same on every rank, for any number of ranks
    # Inputs are channels-last, so convolutions run channels-last; parameters stay contiguous (FSDP2 needs it).
    model = build_model(params, manifest).to(device=device)
    model = wrap_model(model, params, d)
    optim = make_optimizer(model, params)
    step_fn: nn.Module = torch.compile(model) if t.compile else model  # type: ignore[assignment]

    trainer: dict[str, Any] = {"history": [], "epoch_loss": 0.0, "epoch_samples": 0, "train_seconds": 0.0}
    if resume is not None:
        _load(resume.folder, model, optim)
        loader.load_state_dict(resume.state["loader"])
        trainer = {k: resume.state[k] for k in trainer}
        if d.main:
            console.log(f"resumed from {resume.folder} (epoch {loader.epoch + 1}, step {resume.state['step']})")

    spe = loader.steps_per_epoch
    total = t.epochs * spe
    step = loader.epoch * spe + loader.step_in_epoch
    kill_after = int(os.environ.get(KILL_AFTER_STEP_ENV, "0") or 0)
    last_saved = step if resume is not None else -1

    clock = {"start": time.perf_counter(), "saving": 0.0}  # this session's epoch: training time only

    def training_seconds() -> float:
        return time.perf_counter() - clock["start"] - clock["saving"]

    def state_now() -> dict[str, Any]:
        return {
            "step": step,
            "loader": loader.state_dict(),
            "fingerprint": fingerprint(params, manifest),
            "world_size": world,
            "strategy": t.strategy if world > 1 else "single",
            **trainer,
            "train_seconds": trainer["train_seconds"] + training_seconds(),
        }

    for entry in trainer["history"] if d.main else []:  # a resumed run's MLflow run gets the whole curve
        log({k: v for k, v in entry.items() if k != "epoch"}, int(entry["epoch"]))

    # Logit adjustment (Menon et al., 2021): training on logits + tau * log(class prior) makes the plain
    # logits at inference estimate a class-balanced posterior, so rare classes are not out-voted.
    prior_shift = None
    if t.logit_adjustment > 0:
        counts = torch.bincount(loader.split.labels, minlength=len(manifest.classes)).clamp_(min=1).float()
        prior_shift = (t.logit_adjustment * torch.log(counts / counts.sum())).to(device)

    model.train()
    while loader.epoch < t.epochs:
        epoch = loader.epoch
        remaining = spe - loader.step_in_epoch
        session_samples = 0
        clock.update(start=time.perf_counter(), saving=0.0)
        batches = iter(loader)
        if d.main:
            batches = console.progress(batches, remaining, f"epoch {epoch + 1}/{t.epochs}")
        lr = lr_at(max(step - 1, 0), total, t.lr, t.warmup_fraction)  # the last step's, if none is left
        for batch in batches:
            lr = lr_at(step, total, t.lr, t.warmup_fraction)
            for group in optim.param_groups:
                group["lr"] = lr
            torch.manual_seed(_seed(t.seed, step, rank))  # dropout: reproducible on resume
            images = batch.images.to(device, non_blocking=True)
            labels = batch.labels.to(device, non_blocking=True)
            with _autocast(device, dtype):
                logits = step_fn(images)
            # Mean over the *global* batch: DDP/FSDP average gradients over ranks, hence the * world.
            logits = logits.float() if prior_shift is None else logits.float() + prior_shift
            # A committee's members each add their own loss (see nets.Committee).
            flat_logits, flat_labels = nets.member_loss_inputs(logits, labels)
            loss_sum = F.cross_entropy(flat_logits, flat_labels, reduction="sum", label_smoothing=t.label_smoothing)
            loss = loss_sum * (world / batch.global_size)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
            trainer["epoch_loss"] += float(loss_sum.detach()) * len(labels) / len(flat_labels)  # per member
            trainer["epoch_samples"] += len(labels)
            session_samples += len(labels)
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < total:
                saving_from = time.perf_counter()
                _save(step, model, optim, state_now(), d, t.keep_checkpoints)
                last_saved = step
                clock["saving"] += time.perf_counter() - saving_from  # saving is not training time
            if kill_after and step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        elapsed = training_seconds()
        trainer["train_seconds"] += elapsed

        loss_tensor = torch.tensor(
            [trainer["epoch_loss"], trainer["epoch_samples"], session_samples / max(elapsed, 1e-9)],
            dtype=torch.float64,
        )
        if world > 1:
            dist.all_reduce(loss_tensor)
        val_acc = evaluate_accuracy(model, val_split, t.eval_batch_size, d, dtype)
        entry = {
            "epoch": epoch + 1,
            "train_loss": float(loss_tensor[0] / max(1.0, float(loss_tensor[1]))),
            "val_accuracy": val_acc,
            "lr": lr,
            "images_per_s": float(loss_tensor[2]),
        }
        trainer["epoch_loss"], trainer["epoch_samples"] = 0.0, 0
        if not (trainer["history"] and trainer["history"][-1]["epoch"] == entry["epoch"]):
            trainer["history"].append(entry)
        if d.main:
            console.log(
                f"epoch {epoch + 1}/{t.epochs}: loss {entry['train_loss']:.4f}, val accuracy {val_acc:.4f}, "
                f"lr {lr:.2e}, {entry['images_per_s']:.0f} images/s"
            )
            log({k: v for k, v in entry.items() if k != "epoch"}, epoch + 1)

    if last_saved != step:
        _save(step, model, optim, state_now(), d, t.keep_checkpoints)
    full = _full_state_dict(model)
    summary: dict[str, Any] = {}
    if d.main:
        MODELS_DIR.mkdir(parents=True, exist_ok=True)
        payload = {
            "arch": model_arch(params, manifest),
            "mean": manifest.mean,
            "std": manifest.std,
            "classes": manifest.classes,
            "state_dict": full,
        }
        tmp = MODEL_PATH.with_suffix(".pt.tmp")
        torch.save(payload, tmp)
        tmp.replace(MODEL_PATH)
        history = trainer["history"]
        summary = {
            "val_accuracy": history[-1]["val_accuracy"] if history else float("nan"),
            "train_loss": history[-1]["train_loss"] if history else float("nan"),
            "epochs": t.epochs,
            "steps": step,
            "train_seconds": trainer["train_seconds"],
            "images_per_s": (step * t.batch_size) / max(trainer["train_seconds"], 1e-9),
            "parameters": nets.count_parameters(model),
            "world_size": world,
            "device": str(device),
            "history": history,
        }
    d.barrier()
    return summary


# ------------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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
    device = choose_device(params.train.device)
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        log = metrics_logger(params.tracking, run_id) if rank == 0 else _no_log
        summary = worker(rank, world, params, resume, log)
        if rank == 0:
            Path(result_path).write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def _no_log(metrics: Mapping[str, float], step: int) -> None:
    return None


def _find_resume(params: Params, manifest: Manifest, main: bool) -> ckpt.Resume | None:
    if main:
        for partial in ckpt.partial_folders(CHECKPOINTS_DIR):
            console.log(f"ignoring incomplete checkpoint {partial} (interrupted while saving)")
    resume = ckpt.latest(CHECKPOINTS_DIR)
    if resume is None:
        return None
    if resume.state.get("fingerprint") != fingerprint(params, manifest):
        if main:
            console.log(f"{CHECKPOINTS_DIR} holds a run with other params or data: starting over")
        return None
    return resume


def _check_inputs() -> Manifest:
    manifest = load_manifest(PREPARED_DIR)
    for split in ("train", "val"):
        if not (PREPARED_DIR / f"{split}.npz").exists():
            raise StageError(f"{PREPARED_DIR / f'{split}.npz'} not found: run `pipeline prepare` first")
    return manifest


def _environment(params: Params, world: int) -> dict[str, str]:
    device = choose_device(params.train.device)
    return {
        "torch": torch.__version__,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "backend": _backend(device) if world > 1 else "none",
        "world_size": str(world),
        "strategy": params.train.strategy if world > 1 else "single",
        "compile": str(params.train.compile),
        "amp": str(amp_dtype(params.train.amp, device)),
        "cpu_threads": str(params.train.threads or max(1, (os.cpu_count() or 1) // world)),
        "git_commit": git_commit(),
    }


def run(params: Params) -> None:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        _run_torchrun(params)
        return
    manifest = _check_inputs()
    world = params.train.nproc
    device = choose_device(params.train.device)
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise StageError(f"train.nproc is {world} but only {torch.cuda.device_count()} CUDA devices exist")
    resume = _find_resume(params, manifest, main=True)
    if resume is None and ckpt.complete_folders(CHECKPOINTS_DIR):
        shutil.rmtree(CHECKPOINTS_DIR)
    wall = time.perf_counter()
    with stage_run("train", params.tracking, params.model_dump(mode="json"), system_metrics=True) as mlrun:
        mlrun.set_tags(_environment(params, world))
        if resume is not None:
            mlrun.set_tags({"resumed_from": str(resume.folder)})
        if world == 1:
            summary = worker(0, 1, params, resume, mlrun.log_metrics)
        else:
            summary = _launch(params, world, resume, mlrun.run_id)
        _finish(mlrun, summary, wall)


def _finish(mlrun: Any, summary: dict[str, Any], wall: float) -> None:
    """Reports, final metrics and artifacts of the stage's MLflow run, and the closing log line."""
    summary["wall_seconds"] = time.perf_counter() - wall
    write_reports(summary)
    mlrun.log_metrics({"final_val_accuracy": summary["val_accuracy"], "train_seconds": summary["train_seconds"]})
    for path in (TRAIN_REPORTS / "metrics.json", TRAIN_REPORTS / "history.csv", TRAIN_REPORTS / "curves.png"):
        mlrun.log_artifact(path, "reports")
    mlrun.log_artifact(MODEL_PATH, "model")
    console.log(
        f"trained {summary['epochs']} epochs ({summary['steps']} steps) in {summary['train_seconds']:.0f} s "
        f"on {summary['world_size']} process(es): val accuracy {summary['val_accuracy']:.4f}; model in {MODEL_PATH}"
    )


def _launch(params: Params, world: int, resume: ckpt.Resume | None, run_id: str | None) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "summary.json"
        args = (world, params.model_dump_json(), resume, run_id, _free_port(), str(result))
        try:
            mp.start_processes(_spawned, args=args, nprocs=world, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise StageError(f"a training process failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise StageError(f"a training process died: {exc}") from None
        summary: dict[str, Any] = json.loads(result.read_text())
        return summary


def _run_torchrun(params: Params) -> None:
    """Under torchrun: every process calls run(); rank 0 owns the MLflow run and the reports."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    manifest = _check_inputs()
    device = choose_device(params.train.device)
    dist.init_process_group(_backend(device))
    try:
        resume = _find_resume(params, manifest, main=rank == 0)
        if rank == 0 and resume is None and ckpt.complete_folders(CHECKPOINTS_DIR):
            shutil.rmtree(CHECKPOINTS_DIR)
        dist.barrier()
        if rank != 0:
            worker(rank, world, params, resume, _no_log)
            return
        wall = time.perf_counter()
        with stage_run("train", params.tracking, params.model_dump(mode="json"), system_metrics=True) as mlrun:
            mlrun.set_tags(_environment(params, world))
            if resume is not None:
                mlrun.set_tags({"resumed_from": str(resume.folder)})
            summary = worker(rank, world, params, resume, mlrun.log_metrics)
            _finish(mlrun, summary, wall)
    finally:
        dist.destroy_process_group()


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        epochs = [e["epoch"] for e in history]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax1.plot(epochs, [e["train_loss"] for e in history], marker="o")
        ax1.set(xlabel="epoch", ylabel="train loss", title="Training loss")
        ax2.plot(epochs, [e["val_accuracy"] for e in history], marker="o", color="tab:green")
        ax2.set(xlabel="epoch", ylabel="accuracy", title="Validation accuracy")
        fig.tight_layout()
        fig.savefig(TRAIN_REPORTS / "curves.png", dpi=100)
        plt.close(fig)
