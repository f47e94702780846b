"""One training engine: optimizer parameter groups, the LR schedule, the loss and the step.

The train stage, optimize's fine-tune (with distillation from the unpruned model) and `python -m benchmarks train`
all step through `Engine.step`, so a change to the recipe's mechanics happens in one place.

The loss of a step is the sum over the *global* batch times world / global batch size: DDP and FSDP average
gradients over the processes, so every process's gradient is that of the global mean. A committee's members
(nets.Committee) each add their own mean loss, so each learns at the rate it would alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.architectures import nets
from pipeline.training.distributed import SINGLE, Dist, autocast

DISTILL_TEMPERATURE = 2.0


def param_groups(
    model: nn.Module, weight_decay: float, backbone_lr_factor: float = 1.0, frozen_steps: int = 0
) -> list[dict[str, object]]:
    """Weights decay; biases and BatchNorm parameters (1-D) do not. A torchvision/timm network's backbone gets
    groups of its own that learn at `lr x backbone_lr_factor`, and not at all for the first `frozen_steps`
    (Engine.step reads `lr_scale` and `frozen_steps`); its classifier, and our own networks, at `lr`."""
    backbone, head = nets.backbone_parts(getattr(model, "module", model))  # DDP wraps the network in .module
    groups: list[dict[str, object]] = []
    parts = ((backbone, backbone_lr_factor, frozen_steps), (head, 1.0, 0)) if backbone else ((head, 1.0, 0),)
    for part, scale, frozen in parts:
        for params, decay in (([p for p in part if p.ndim > 1], weight_decay), ([p for p in part if p.ndim <= 1], 0.0)):
            groups.append({"params": params, "weight_decay": decay, "lr_scale": scale, "frozen_steps": frozen})
    return groups


def make_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    backbone_lr_factor: float = 1.0,
    frozen_steps: int = 0,
) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay, backbone_lr_factor, frozen_steps)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.AdamW(groups, lr=lr)


def one_cycle_lr(step: int, total: int, peak: float, warmup_fraction: float) -> float:
    """Linear warm-up from peak/25 to peak, then cosine decay to zero. `step` counts from 0; with no warm-up
    it is a plain cosine decay from the peak."""
    warm = int(total * warmup_fraction)
    if step < warm:
        return peak / 25 + (peak - peak / 25) * step / warm
    span = max(1, total - warm)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / span)))


def step_seed(*values: int) -> int:
    """A seed from several integers (stable across runs and processes)."""
    digest = hashlib.sha256(",".join(map(str, values)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Loss:
    """Cross-entropy with label smoothing, optionally logit-adjusted and distilled from a teacher."""

    label_smoothing: float = 0.0
    prior_shift: torch.Tensor | None = None
    """tau * log(class prior), added to the logits in training (logit adjustment, Menon et al. 2021)."""
    teacher: nn.Module | None = None
    distill: float = 0.0
    """Weight of the KL term to the teacher's softened outputs (temperature DISTILL_TEMPERATURE)."""
    teacher_amp: torch.dtype | None = None
    """Autocast dtype of the teacher's forward (its outputs are only targets: bf16 halves their cost)."""

    def sums(self, logits: torch.Tensor, labels: torch.Tensor, images: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(the loss summed over the batch and the members, the label loss per member as a float)."""
        logits = logits.float() if self.prior_shift is None else logits.float() + self.prior_shift
        flat_logits, flat_labels = nets.member_loss_inputs(logits, labels)
        label_sum = F.cross_entropy(flat_logits, flat_labels, reduction="sum", label_smoothing=self.label_smoothing)
        per_member = float(label_sum.detach()) * len(labels) / len(flat_labels)
        if self.teacher is None or self.distill <= 0:
            return label_sum, per_member
        members = len(flat_labels) // len(labels)
        t = DISTILL_TEMPERATURE
        with torch.no_grad(), autocast(images.device, self.teacher_amp):
            teacher_logits = self.teacher(images)
        target = F.log_softmax(teacher_logits.float() / t, dim=1).repeat(members, 1)
        kl_sum = F.kl_div(F.log_softmax(flat_logits / t, dim=1), target, log_target=True, reduction="sum") * (t * t)
        return (1 - self.distill) * label_sum + self.distill * kl_sum, per_member


class Engine:
    """Steps a model: set the learning rate, seed dropout, forward (autocast), loss, backward, update."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_at: Callable[[int], float],
        loss: Loss,
        *,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        d: Dist = SINGLE,
        amp: torch.dtype | None = None,
        seed: int = 0,
        micro_batch: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.loss = loss
        self.forward = forward if forward is not None else model  # not `or`: a compiled Committee raises on len()
        self.d = d
        self.amp = amp
        self.seed = seed
        self.micro_batch = micro_batch
        """Step each batch as parts of at most this many images, gradients added up (0: whole); memory_budget."""

    def step(self, step: int, images: torch.Tensor, labels: torch.Tensor, global_size: int) -> float:
        """One update at global step `step` on this process's share of a global batch of `global_size`;
        returns the label loss summed over this share (per member)."""
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            frozen = step < int(group.get("frozen_steps", 0))
            group["lr"] = 0.0 if frozen else lr * float(group.get("lr_scale", 1.0))
        torch.manual_seed(step_seed(self.seed, step, self.d.rank))  # dropout: reproducible on resume
        self.optimizer.zero_grad(set_to_none=True)
        size = self.micro_batch or len(images)
        per_member = 0.0
        for start in range(0, len(images), size):
            part = images[start : start + size].to(self.d.device, non_blocking=True)
            part_labels = labels[start : start + size].to(self.d.device, non_blocking=True)
            last = start + size >= len(images)
            # DDP all-reduces gradients once, on the last micro-batch (FSDP2 reduces on each: the same sum).
            no_sync = getattr(self.model, "no_sync", None)
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                with autocast(self.d.device, self.amp):
                    logits = self.forward(part)
                total, part_per_member = self.loss.sums(logits, part_labels, part)
                (total * (self.d.world / global_size)).backward()  # sums: micro-batches add up to the batch's
            per_member += part_per_member
        self.optimizer.step()
        return per_member


def accuracy(model: nn.Module, batches: object, d: Dist = SINGLE, amp: torch.dtype | None = None) -> float:
    """Top-1 over (images, labels, valid) batches (data.loader.eval_batches); summed over the processes."""
    import torch.distributed as dist

    was_training = model.training
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), autocast(d.device, amp):
        for images, labels, valid in batches:  # type: ignore[attr-defined]
            logits = model(images.to(d.device, non_blocking=True))
            pred = logits[:valid].argmax(1).cpu()
            correct[0] += float((pred == labels[:valid]).sum())
            correct[1] += valid
    if d.world > 1:
        dist.all_reduce(correct)
    model.train(was_training)
    return float(correct[0] / max(1.0, float(correct[1])))


@torch.no_grad()
def recalibrate_batchnorm(
    model: nn.Module, images: torch.Tensor, batch_size: int, d: Dist = SINGLE, amp: torch.dtype | None = None
) -> int:
    """Re-estimate every BatchNorm's running mean/variance as the plain average over `images` (uint8 NCHW, no
    augmentation), in train mode without gradients ("precise BN"). torchvision's MobileNetV3 and EfficientNet keep
    their running statistics with momentum 0.01: after a short training from scratch they are still mostly their
    initial values, and eval mode then predicts one class for every image. Every rank sees the same images, so the
    statistics agree. Returns the BatchNorm layers recalibrated."""
    from pipeline.data.loader import to_float

    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms or len(images) == 0:
        return 0
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over every batch below
    was_training = model.training
    model.train()
    for start in range(0, len(images), batch_size):
        with autocast(d.device, amp):
            model(to_float(images[start : start + batch_size]).to(d.device))
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    model.train(was_training)
    return len(norms)
