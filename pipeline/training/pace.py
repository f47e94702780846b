"""The input size this machine can afford to train: `data.min_image_size` with `train.max_minutes`.

A budget of minutes buys fewer epochs on a slower CPU; below some number of epochs a network from random weights has
not learned yet, and a smaller input that trains all of `train.epochs` does better. So prepare, before it writes a
pixel, times a few training steps of the run's network at sizes from `data.image_size` down to `data.min_image_size`
(the smallest first: where even it does not fit, that is the answer; else largest first, stopping at the first that
fits) and prepares the largest whose epochs fit in the budget. A step's cost is not the square of the side (kernels
and caches favour some sizes), so it is timed, not computed; the train stage's own budget then plans the epochs from
the real epochs' pace, as without this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.architectures.nets import member_loss_inputs
from pipeline.training.distributed import autocast

SIZE_STEP = 16  # candidate sides go down in steps of this (kernels like multiples of 8)
TIMED_STEPS = 3  # after one untimed warm-up step
MAX_TIMED_BATCH = 32  # per step: enough for a steady rate, few seconds at the largest sizes
EVAL_SPEEDUP = 3.0  # a validation image costs about a third of a training image (forward only)


@dataclass(frozen=True)
class Pace:
    """One candidate size, timed."""

    image_size: int
    """The square side, in pixels."""
    images_per_second: float
    """Training images a second at that side (forward, loss, backward, update), on this machine."""

    def epoch_seconds(self, train_images: int, val_images: int) -> float:
        """One epoch: the training split stepped once, the validation split scored once."""
        rate = max(self.images_per_second, 1e-9)
        return train_images / rate + val_images / (EVAL_SPEEDUP * rate)

    def minutes(self, epochs: int, train_images: int, val_images: int) -> float:
        """`epochs` such epochs, in minutes: what `train.max_minutes` is compared with."""
        return epochs * self.epoch_seconds(train_images, val_images) / 60


def candidate_sizes(largest: int, smallest: int) -> list[int]:
    """`largest`, then down in steps of SIZE_STEP to no less than `smallest` (just `largest` when it is the smaller)."""
    sizes = [largest]
    while sizes[-1] - SIZE_STEP >= smallest:
        sizes.append(sizes[-1] - SIZE_STEP)
    return sizes


def images_per_second(
    model: nn.Module, image_size: int, batch: int, classes: int, device: torch.device, amp: torch.dtype | None
) -> float:
    """Training images a second through `model` at `image_size` (random pixels and labels; AdamW, as train)."""
    model = model.to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    # Channels-last, as the training loader hands batches over: CPU convolutions run faster in it.
    images = torch.rand(batch, 3, image_size, image_size, generator=generator).to(device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, classes, (batch,), generator=generator).to(device)

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        with autocast(device, amp):
            logits = model(images)
        loss = nn.functional.cross_entropy(*member_loss_inputs(logits.float(), labels))
        loss.backward()
        optim.step()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TIMED_STEPS * batch / max(time.perf_counter() - start, 1e-9)


def affordable_size(
    sizes: Sequence[int],
    build: Callable[[int], nn.Module],
    *,
    batch: int,
    classes: int,
    train_images: int,
    val_images: int,
    epochs: int,
    minutes: float,
    device: torch.device,
    amp: torch.dtype | None,
) -> tuple[int, list[Pace]]:
    """The largest of `sizes` (largest first) at which `epochs` epochs fit in `minutes`, else the smallest; and
    the paces timed on the way, largest first. The smallest is timed first: where even it does not fit, no larger
    side can, and the slow machine is spared timing them."""
    timed: dict[int, Pace] = {}

    def fits(size: int) -> bool:
        if size not in timed:
            torch.manual_seed(0)
            rate = images_per_second(build(size), size, min(batch, MAX_TIMED_BATCH), classes, device, amp)
            timed[size] = Pace(size, rate)
        return timed[size].minutes(epochs, train_images, val_images) <= minutes

    chosen = sizes[-1]
    if fits(sizes[-1]):
        chosen = next(size for size in sizes if fits(size))
    return chosen, sorted(timed.values(), key=lambda p: -p.image_size)
