"""Training inside optimize, through training.engine with the `augment` and `regularize` sections the train stage
uses: the short fine-tune after pruning, and the distilled student. Both learn from the trained model's softened
outputs as well as the labels (distillation recovers and transfers accuracy faster than labels alone)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeline import console
from pipeline.architectures import nets
from pipeline.artifacts.prepared import read_manifest
from pipeline.config import Params
from pipeline.data.loader import AugmentConfig, TrainLoader, training_images
from pipeline.machine.memory_budget import Budget
from pipeline.training.distributed import amp_dtype
from pipeline.training.engine import Engine, Loss, make_optimizer, one_cycle_lr, recalibrate_batchnorm


def train_from_teacher(
    model: nn.Module,
    params: Params,
    *,
    epochs: int,
    lr: float,
    distill: float,
    teacher: nn.Module | None,
    warmup_fraction: float = 0.0,
    label: str = "fine-tune",
    log: Callable[[dict[str, float], int], None] | None = None,
) -> nn.Module:
    """`epochs` of AdamW at peak `lr` (warm-up, then cosine to zero) on the images the train stage learnt from
    (the training split, plus validation with `train.train_on_val`); with a teacher and
    `distill` > 0 the loss also pulls the outputs towards the teacher's (temperature 2). bf16 autocast follows
    `train.amp` (by default on CUDA and on x86 CPUs with AMX or AVX512-BF16)."""
    cfg = params.optimize
    if epochs == 0:
        return model
    split = training_images(params.train.train_on_val)
    batch = min(cfg.finetune_batch_size, len(split))
    loader = TrainLoader(split, batch, cfg.seed, augment=AugmentConfig.of(params.augment))
    optim = make_optimizer(model, "adamw", lr, params.regularize.weight_decay)
    budget = Budget.of(params.memory_gb, model, read_manifest().image_size)
    micro_batch = budget.micro_batch(batch, nets.count_parameters(model), "optimize.finetune_batch_size")
    total = epochs * loader.steps_per_epoch
    amp = amp_dtype(params.train.amp, torch.device("cpu"))
    loss = Loss(label_smoothing=params.regularize.label_smoothing, teacher=teacher, distill=distill, teacher_amp=amp)
    schedule = lambda s: one_cycle_lr(s, total, lr, warmup_fraction)  # noqa: E731
    engine = Engine(model, optim, schedule, loss, amp=amp, seed=cfg.seed, micro_batch=micro_batch)
    step = 0
    torch.manual_seed(cfg.seed)
    model.train()
    while loader.epoch < epochs:
        epoch_loss, seen = 0.0, 0
        for b in console.progress(iter(loader), loader.steps_per_epoch, f"{label} {loader.epoch + 1}/{epochs}"):
            epoch_loss += engine.step(step, b.images, b.labels, b.global_size)
            step += 1
            seen += len(b.labels)
        if log is not None:
            log({f"{label.replace('-', '')}_loss": epoch_loss / max(1, seen)}, loader.epoch)
    if any(isinstance(m, nets.Backbone) for m in model.modules()):
        # Library networks' BatchNorm momenta are small (0.01 in MobileNetV3): after a short fine-tune their running
        # statistics lag the pruned network's, so they are re-estimated as train does (our networks: as before).
        spread = torch.linspace(0, len(split) - 1, min(len(split), 2048)).long()
        recalibrate_batchnorm(model, split.images[spread], micro_batch, amp=amp)
    return model.eval()


def finetune(
    model: nn.Module,
    params: Params,
    log: Callable[[dict[str, float], int], None] | None = None,
    teacher: nn.Module | None = None,
) -> nn.Module:
    """The fine-tune after pruning: `optimize.finetune_epochs` at `optimize.finetune_lr`, no warm-up, distilled
    from the unpruned model with weight `optimize.finetune_distill`."""
    cfg = params.optimize
    return train_from_teacher(
        model,
        params,
        epochs=cfg.finetune_epochs,
        lr=cfg.finetune_lr,
        distill=cfg.finetune_distill,
        teacher=teacher,
        log=log,
    )


def distill_student(
    student: nn.Module, teacher: nn.Module, params: Params, log: Callable[[dict[str, float], int], None] | None = None
) -> nn.Module:
    """A freshly initialised student trained from the teacher's soft targets plus labels (`optimize.student_*`),
    with train's warm-up."""
    cfg = params.optimize
    return train_from_teacher(
        student.to(memory_format=torch.channels_last),
        params,
        epochs=cfg.student_epochs,
        lr=cfg.student_lr,
        distill=cfg.student_distill,
        teacher=teacher.eval(),
        warmup_fraction=params.train.warmup_fraction,
        label="student",
        log=log,
    )
