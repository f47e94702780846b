"""`signnet`: the demo's compact VGG-style CNN (conv-BN-ReLU pairs, widths w-2w-4w, global pooling), sized to
train to high accuracy on two CPU cores."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.architectures import NetSpec
from pipeline.architectures.nets import NUM_CLASSES, Normalize


def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SignNet(nn.Module):
    """Three stages of two conv-BN-ReLU layers (widths w, 2w, 4w) with max pooling, then global average
    pooling, dropout and one linear layer. Works at any input size >= 8."""

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        width: int = 32,
        dropout: float = 0.2,
        num_classes: int = NUM_CLASSES,
        input_norm: str = "dataset",
    ) -> None:
        super().__init__()
        self.normalize = Normalize(mean, std, input_norm)
        w1, w2, w3 = width, 2 * width, 4 * width
        self.features = nn.Sequential(
            *_conv_bn_relu(3, w1),
            *_conv_bn_relu(w1, w1),
            nn.MaxPool2d(2),
            *_conv_bn_relu(w1, w2),
            *_conv_bn_relu(w2, w2),
            nn.MaxPool2d(2),
            *_conv_bn_relu(w2, w3),
            *_conv_bn_relu(w3, w3),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(w3, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.normalize(x)))


def build(spec: NetSpec) -> nn.Module:
    return SignNet(
        spec.mean, spec.std, width=spec.width, dropout=spec.dropout, num_classes=spec.num_classes,
        input_norm=spec.input_norm,
    )  # fmt: skip
