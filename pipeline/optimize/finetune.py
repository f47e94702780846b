"""The short fine-tune after pruning: training.engine on the training split, with the `augment` and `regularize`
sections the train stage uses, and distillation from the unpruned model (which recovers accuracy faster than
labels alone)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeline import console
from pipeline.config import Params
from pipeline.data.loader import AugmentConfig, TrainLoader, load_split
from pipeline.training.engine import Engine, Loss, make_optimizer, one_cycle_lr


def finetune(
    model: nn.Module,
    params: Params,
    log: Callable[[dict[str, float], int], None] | None = None,
    teacher: nn.Module | None = None,
) -> nn.Module:
    """`optimize.finetune_epochs` of AdamW at `optimize.finetune_lr`, cosine-decayed to zero; with a teacher and
    `optimize.finetune_distill` > 0 the loss also pulls the outputs towards the teacher's (temperature 2)."""
    cfg = params.optimize
    if cfg.finetune_epochs == 0:
        return model
    split = load_split("train")
    batch = min(cfg.finetune_batch_size, len(split))
    loader = TrainLoader(split, batch, cfg.seed, augment=AugmentConfig.of(params.augment))
    optim = make_optimizer(model, "adamw", cfg.finetune_lr, params.regularize.weight_decay)
    total = cfg.finetune_epochs * loader.steps_per_epoch
    loss = Loss(label_smoothing=params.regularize.label_smoothing, teacher=teacher, distill=cfg.finetune_distill)
    engine = Engine(model, optim, lambda s: one_cycle_lr(s, total, cfg.finetune_lr, 0.0), loss, seed=cfg.seed)
    step = 0
    torch.manual_seed(cfg.seed)
    model.train()
    while loader.epoch < cfg.finetune_epochs:
        epoch_loss, seen = 0.0, 0
        label = f"fine-tune {loader.epoch + 1}/{cfg.finetune_epochs}"
        for b in console.progress(iter(loader), loader.steps_per_epoch, label):
            epoch_loss += engine.step(step, b.images, b.labels, b.global_size)
            step += 1
            seen += len(b.labels)
        if log is not None:
            log({"finetune_loss": epoch_loss / max(1, seen)}, loader.epoch)
    return model.eval()
