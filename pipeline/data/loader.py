"""The stateful, deterministic batch loader over the prepared uint8 shards (no per-epoch decoding; a batch is
read from the shards by row, so memory does not grow with the data).

Sampling: every epoch has one global permutation of the training split, a pure function of
(seed, epoch). A step takes the next `global_batch_size` positions of that permutation; rank r of W
takes every W-th of them (positions r, r+W, ...). The loader's state is (epoch, global offset), so a run
resumed with another number of processes continues at the same global position: no sample is seen
twice or skipped. The last incomplete global batch of an epoch is dropped (the same one for any W).

Augmentation is batched and per sample: the parameters of every sample of a global batch are drawn from
a generator seeded by (seed, epoch, step) and each rank picks its rows, so the augmented pixels do not
depend on the number of processes either. The transforms follow torchvision v2's `RandomAffine`
(rotation, translation, scale, shear) and `ColorJitter` (brightness, contrast, saturation), but draw one
parameter set per image: v2 transforms draw one set per call, so a whole batch would share a single
transform, and calling them image by image costs about as much as the training step itself.
No horizontal flips: mirroring changes the meaning of many signs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.artifacts.prepared import PREPARED_DIR, Files, SplitArrays, SplitReader
from pipeline.config import AugmentParams
from pipeline.errors import StageError


class StreamedImages:
    """A prepared split's pixels, read from its shards on demand: `images[idx]` is uint8 [b, 3, H, W] (a
    channels-last view of the rows read), so a process holds its batches and never the whole split."""

    def __init__(self, readers: list[SplitReader]) -> None:
        self.readers = readers
        self._starts = np.cumsum([0, *(len(r) for r in readers)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, idx: torch.Tensor | np.ndarray | slice) -> torch.Tensor:
        rows = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64).reshape(-1)
        if len(self.readers) == 1:
            pixels = self.readers[0].take(rows)
        else:
            size = self.readers[0].image_size
            pixels = np.empty((len(rows), size, size, 3), dtype=np.uint8)
            which = np.searchsorted(self._starts, rows, side="right") - 1
            for r, reader in enumerate(self.readers):
                mine = np.flatnonzero(which == r)
                if len(mine):
                    pixels[mine] = reader.take(rows[mine] - self._starts[r])
        return torch.from_numpy(pixels).permute(0, 3, 1, 2)


@dataclass(frozen=True)
class Split:
    images: torch.Tensor | StreamedImages  # uint8 [N, 3, H, W] (channels-last memory), in memory or streamed
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def joined(self, other: Split) -> Split:
        """This split's images followed by another's (the shipped model trains on validation too)."""
        labels = torch.cat([self.labels, other.labels])
        if isinstance(self.images, StreamedImages) and isinstance(other.images, StreamedImages):
            return Split(StreamedImages(self.images.readers + other.images.readers), labels)
        if isinstance(self.images, torch.Tensor) and isinstance(other.images, torch.Tensor):
            images = torch.cat([self.images, other.images]).contiguous(memory_format=torch.channels_last)
            return Split(images, labels)
        raise TypeError("join two streamed splits or two in-memory ones")

    @classmethod
    def of(cls, arrays: SplitArrays) -> Split:
        """In-memory arrays (artifacts.prepared) as tensors, without copying the pixels."""
        return cls(
            images=torch.from_numpy(arrays.images).permute(0, 3, 1, 2),
            labels=torch.from_numpy(arrays.labels.astype(np.int64)),
        )


def load_split(split: str, prepared: Path | Files = PREPARED_DIR) -> Split:
    """One prepared split, streamed from its shards (checked against the manifest's hashes once, here); images
    stay uint8 on disk until a batch is taken."""
    reader = SplitReader(split, prepared)
    reader.verify()
    return Split(StreamedImages([reader]), torch.from_numpy(reader.labels.astype(np.int64)))


def training_images(train_on_val: bool, prepared: Path | Files = PREPARED_DIR) -> Split:
    """What every model that ships learns from: the training split, followed by the validation split's images
    when `train.train_on_val` (the train stage, and optimize's fine-tune and student, so that the gate compares
    models that saw the same images)."""
    split = load_split("train", prepared)
    return split.joined(load_split("val", prepared)) if train_on_val else split


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (stable across runs and processes, unlike hash())."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h ^= (v + 0x9E3779B97F4A7C15 + ((h << 6) & (2**64 - 1)) + (h >> 2)) & (2**64 - 1)
        h = (h * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return h & (2**63 - 1)


@dataclass(frozen=True)
class AugmentConfig:
    degrees: float = 10.0
    translate: float = 0.1
    scale: tuple[float, float] = (0.9, 1.1)
    shear: float = 5.0
    brightness: float = 0.3
    contrast: float = 0.3
    saturation: float = 0.3
    hflip: bool = False
    crop_area: float = 1.0  # random resized crop: the smallest fraction of the area shown (1 = off)

    @classmethod
    def of(cls, params: AugmentParams) -> AugmentConfig:
        """The `augment` params section (shared by train and optimize's fine-tune) as sampling ranges."""
        if not params.enabled:
            return cls(0.0, 0.0, (1.0, 1.0), 0.0, 0.0, 0.0, 0.0)
        return cls(
            degrees=params.rotation,
            translate=params.translate,
            scale=(1 - params.scale, 1 + params.scale),
            shear=params.shear,
            brightness=params.color_jitter,
            contrast=params.color_jitter,
            saturation=params.color_jitter,
            hflip=params.hflip,
            crop_area=params.random_resized_crop or 1.0,
        )

    @property
    def enabled(self) -> bool:
        return any(
            (
                self.degrees,
                self.translate,
                self.scale != (1.0, 1.0),
                self.shear,
                self.brightness,
                self.contrast,
                self.saturation,
                self.hflip,
                self.crop_area < 1.0,
            )
        )

    @property
    def photo(self) -> bool:
        """Flips or random resized crops: drawn after the affine's parameters, so recipes without them draw the
        same numbers as before they existed."""
        return self.hflip or self.crop_area < 1.0


def draw_params(cfg: AugmentConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    """Per-sample parameters [n, 8]: angle, tx, ty, scale, shear, brightness, contrast, saturation."""
    u = torch.rand(n, 8, generator=generator, dtype=torch.float64) * 2 - 1  # uniform in [-1, 1]
    lo, hi = cfg.scale
    params = torch.empty(n, 8, dtype=torch.float64)
    params[:, 0] = u[:, 0] * cfg.degrees
    params[:, 1] = u[:, 1] * cfg.translate
    params[:, 2] = u[:, 2] * cfg.translate
    params[:, 3] = lo + (u[:, 3] + 1) / 2 * (hi - lo)
    params[:, 4] = u[:, 4] * cfg.shear
    params[:, 5] = 1 + u[:, 5] * cfg.brightness
    params[:, 6] = 1 + u[:, 6] * cfg.contrast
    params[:, 7] = 1 + u[:, 7] * cfg.saturation
    if not cfg.photo:
        return params
    v = torch.rand(n, 5, generator=generator, dtype=torch.float64)
    extra = torch.empty(n, 5, dtype=torch.float64)
    extra[:, 0] = (v[:, 0] < 0.5).double() if cfg.hflip else 0.0  # mirrored
    area = cfg.crop_area + v[:, 1] * (1 - cfg.crop_area)
    aspect = torch.exp(math.log(3 / 4) + v[:, 2] * math.log(16 / 9))  # log-uniform in [3/4, 4/3]
    cropping = cfg.crop_area < 1.0
    extra[:, 1] = torch.sqrt(area * aspect).clamp(max=1.0) if cropping else 1.0  # width shown, fraction of the side
    extra[:, 2] = torch.sqrt(area / aspect).clamp(max=1.0) if cropping else 1.0  # height shown
    extra[:, 3] = (v[:, 3] * 2 - 1) * (1 - extra[:, 1])  # centre, normalised coordinates, window inside the image
    extra[:, 4] = (v[:, 4] * 2 - 1) * (1 - extra[:, 2])
    return torch.cat([params, extra], dim=1)


def augment(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Apply per-sample affine + colour jitter to float images in [0, 1] (NCHW), batched."""
    n = x.shape[0]
    if n == 0:
        return x
    p = params.to(torch.float32)
    angle = torch.deg2rad(p[:, 0])
    shear = torch.deg2rad(p[:, 4])
    scale = p[:, 3]
    # Output -> input sampling matrix (affine_grid maps output coordinates to input coordinates):
    # the inverse of rotate(angle) @ shear_x(shear) @ scale(scale), then a shift (normalised coords).
    cos, sin, tan = torch.cos(angle), torch.sin(angle), torch.tan(shear)
    fwd = torch.zeros(n, 2, 2)
    fwd[:, 0, 0] = cos * scale
    fwd[:, 0, 1] = (cos * tan - sin) * scale
    fwd[:, 1, 0] = sin * scale
    fwd[:, 1, 1] = (sin * tan + cos) * scale
    inv = torch.linalg.inv(fwd)
    shift = torch.stack([p[:, 1], p[:, 2]], dim=1) * 2  # fraction of the side -> normalised [-1, 1]
    theta = torch.cat([inv, -(inv @ shift.unsqueeze(2))], dim=2)
    if p.shape[1] > 8:  # photos: a mirror on the output side, a crop window on the input side
        mirror = 1 - 2 * p[:, 8]
        theta[:, :, 0] = theta[:, :, 0] * mirror.view(n, 1)
        window = torch.stack([p[:, 9], p[:, 10]], dim=1).view(n, 2, 1)
        theta = theta * window
        theta[:, :, 2] += torch.stack([p[:, 11], p[:, 12]], dim=1)
    theta = theta.to(x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    # ColorJitter, in v2's order: brightness, contrast, saturation (blends as in v2's kernels).
    b = p[:, 5].view(n, 1, 1, 1).to(x.dtype)
    c = p[:, 6].view(n, 1, 1, 1).to(x.dtype)
    s = p[:, 7].view(n, 1, 1, 1).to(x.dtype)
    x = (x * b).clamp_(0, 1)
    gray = 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]
    x = (c * x + (1 - c) * gray.mean(dim=(2, 3), keepdim=True)).clamp_(0, 1)
    gray = 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]
    x = (s * x + (1 - s) * gray).clamp_(0, 1)
    return x


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW -> float32 in [0, 1], channels-last memory (the layout the CPU convolutions like)."""
    return images.to(torch.float32).div_(255).contiguous(memory_format=torch.channels_last)


@dataclass
class Batch:
    images: torch.Tensor  # float32 [b, 3, H, W] in [0, 1]
    labels: torch.Tensor  # int64 [b]
    indices: torch.Tensor  # int64 [b]: positions in the split (what was read, for tests and audits)
    global_size: int  # samples in this step over all ranks (for the loss of the global mean)


class TrainLoader:
    """Deterministic, resumable, rank-aware batches of the training split. Iterate for one epoch's
    remaining steps; `state_dict()` after any step gives the position to resume from."""

    def __init__(
        self,
        split: Split,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        augment: AugmentConfig | None = None,
    ) -> None:
        if global_batch_size < world_size:
            raise StageError(f"batch size {global_batch_size} is smaller than the {world_size} processes")
        if len(split) < global_batch_size:
            raise StageError(f"the training split has {len(split)} images, fewer than one batch")
        self.split = split
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.augment_config = augment or AugmentConfig()
        self.epoch = 0
        self.offset = 0  # global samples consumed in the current epoch

    @property
    def steps_per_epoch(self) -> int:
        return len(self.split) // self.global_batch_size

    @property
    def step_in_epoch(self) -> int:
        return self.offset // self.global_batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, epoch, 1))
        return torch.randperm(len(self.split), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": len(self.split),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "global_batch_size", "num_samples"):
            mine = self.state_dict()[key]
            if int(state[key]) != mine:
                raise StageError(
                    f"cannot resume: the checkpoint's loader has {key}={state[key]}, this run has {mine} "
                    "(the data or train params changed; delete models/checkpoints to start over)"
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])

    def _take(self, perm: torch.Tensor, step: int) -> Batch:
        start = step * self.global_batch_size
        global_idx = perm[start : start + self.global_batch_size]
        mine = slice(self.rank, None, self.world_size)
        idx = global_idx[mine]
        images = to_float(self.split.images[idx])
        if self.augment_config.enabled:
            g = torch.Generator().manual_seed(_mix(self.seed, self.epoch, step, 2))
            params = draw_params(self.augment_config, len(global_idx), g)[mine]
            images = augment(images, params).contiguous(memory_format=torch.channels_last)
        return Batch(images, self.split.labels[idx], idx, len(global_idx))

    def __iter__(self) -> Iterator[Batch]:
        """The remaining steps of the current epoch; the state advances as each batch is handed out,
        and moves to the next epoch after the last one."""
        perm = self.permutation(self.epoch)
        while self.step_in_epoch < self.steps_per_epoch:
            batch = self._take(perm, self.step_in_epoch)
            self.offset += self.global_batch_size
            yield batch
        self.epoch += 1
        self.offset = 0


def eval_batches(
    split: Split, batch_size: int, rank: int = 0, world_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Sequential (images, labels, valid) batches of this rank's contiguous shard of a split, without
    augmentation. Every rank gets the same number of equally sized batches (sharded models need every
    rank in every forward): short shards are padded by repeating their first image; `valid` says how
    many leading rows are real."""
    n = len(split)
    per_rank = math.ceil(n / world_size)
    lo, hi = min(n, rank * per_rank), min(n, (rank + 1) * per_rank)
    for start in range(rank * per_rank, (rank + 1) * per_rank, batch_size):
        size = min(batch_size, (rank + 1) * per_rank - start)
        idx = torch.arange(start, start + size)
        valid = int(((idx >= lo) & (idx < hi)).sum())
        idx = torch.where(idx < hi, idx, min(lo, n - 1))
        yield to_float(split.images[idx]), split.labels[idx], valid
