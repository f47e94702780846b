"""`trafficsignnet`: the reference network of Arm's learning path (Conv 3->32 k3, pool, Conv 32->64 k3, pool,
FC -> 128, FC -> classes; 2304 features at 32x32), kept to compare against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.architectures import NetSpec
from pipeline.architectures.nets import NUM_CLASSES, Normalize


class TrafficSignNet(nn.Module):
    """The reference network of Arm's learning path (32x32 input; other sizes adapt the FC input)."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        image_size: int = 32,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = ((image_size - 2) // 2 - 2) // 2  # 32 -> 6: 64 * 6 * 6 = 2304 features
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * side * side, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.normalize(x)))


SETTINGS: tuple[str, ...] = ()  # fixed widths, no dropout, the data's mean/std: no model.* key but members


def build(spec: NetSpec) -> nn.Module:
    return TrafficSignNet(spec.mean, spec.std, image_size=spec.image_size, num_classes=spec.num_classes)
