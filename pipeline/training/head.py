"""The head on a frozen backbone's pooled features, and the test a fine-tune must pass to replace it.

A multinomial logistic regression fitted by L-BFGS in seconds; its weight decay and whether the mirror images join
are chosen over folds of training + validation (`choose_head`). A fine-tune of the last blocks is kept only when,
image by image on validation, it beats the head beyond chance (`Versus`: McNemar's exact test, Bonferroni over the
epochs its best was picked from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HEAD_WEIGHT_DECAYS = (1e-4, 1e-3, 1e-2)
HEAD_FOLDS = 4  # the head's settings are chosen over folds of training + validation: a few hundred pick noise
KEEP_TAIL_P = 0.05  # the fine-tune's gain on validation must be beyond chance, its best epoch picked among many


@dataclass(frozen=True)
class HeadChoice:
    """The head's settings, chosen over folds of training + validation, and its accuracy."""

    weight_decay: float
    mirrored: bool
    """Whether the mirror images joined the training features."""
    val_accuracy: float
    """The head fitted on the training images with these settings, on validation (what a fine-tune must beat)."""
    folds_accuracy: float
    """These settings' accuracy over HEAD_FOLDS folds of training + validation, each image scored once."""


@dataclass(frozen=True)
class Versus:
    """The fine-tune against the head on the same validation images: McNemar's exact test, one-sided."""

    gained: int
    """Images the fine-tune gets right and the head wrong."""
    lost: int
    """Images the head gets right and the fine-tune wrong."""
    epochs: int
    """Epochs the best was picked from (the test's threshold is divided by them: Bonferroni)."""

    @classmethod
    def of(cls, head_right: torch.Tensor, tail_right: torch.Tensor, epochs: int) -> Versus:
        return cls(int((tail_right & ~head_right).sum()), int((head_right & ~tail_right).sum()), epochs)

    @property
    def p_value(self) -> float:
        """The chance of at least `gained` of the disagreements going the fine-tune's way were both as good."""
        n = self.gained + self.lost
        return sum(math.comb(n, k) for k in range(self.gained, n + 1)) / 2**n

    @property
    def tail_wins(self) -> bool:
        return self.gained > self.lost and self.p_value < KEEP_TAIL_P / max(self.epochs, 1)

    def describe(self) -> str:
        return (f"{self.gained} validation images gained, {self.lost} lost: p {self.p_value:.3g}, "
                f"keeping it needs p below {KEEP_TAIL_P:g} / {self.epochs} epochs")  # fmt: skip


def fit_linear(features: torch.Tensor, labels: torch.Tensor, classes: int, weight_decay: float) -> nn.Linear:
    """Multinomial logistic regression, L2-penalised, by full-batch L-BFGS (seconds for thousands of images)."""
    torch.manual_seed(0)
    head = nn.Linear(features.shape[1], classes)
    optim = torch.optim.LBFGS(head.parameters(), max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optim.zero_grad()
        loss = F.cross_entropy(head(features), labels) + weight_decay * head.weight.pow(2).sum()
        loss.backward()
        return loss

    optim.step(closure)
    return head


def top1(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(1) == labels).float().mean()) if len(labels) else 0.0


def folds_accuracy(
    feats: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor, classes: int, decay: float, mirrored: bool
) -> float:
    """A head's accuracy over HEAD_FOLDS folds of (features, their mirror images), each image held out once."""
    fold = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)) % HEAD_FOLDS
    right = 0
    for k in range(HEAD_FOLDS):
        held, kept = fold == k, fold != k
        x = torch.cat([feats[0][kept], feats[1][kept]]) if mirrored else feats[0][kept]
        y = torch.cat([labels[kept], labels[kept]]) if mirrored else labels[kept]
        with torch.no_grad():
            right += int((fit_linear(x, y, classes, decay)(feats[0][held]).argmax(1) == labels[held]).sum())
    return right / max(len(labels), 1)


def choose_head(
    feats: dict[str, torch.Tensor], train_labels: torch.Tensor, val_labels: torch.Tensor, classes: int
) -> tuple[HeadChoice, nn.Linear]:
    """The weight decay and mirror images that score best over folds of training + validation (ties: the first
    tried, fewer images), and that head fitted on the training images."""
    pooled = (torch.cat([feats["train"], feats["val"]]), torch.cat([feats["train_mirrored"], feats["val_mirrored"]]))
    labels = torch.cat([train_labels, val_labels])
    scored = {(m, d): folds_accuracy(pooled, labels, classes, d, m) for m in (False, True) for d in HEAD_WEIGHT_DECAYS}
    mirrored, decay = max(scored, key=lambda setting: scored[setting])  # the first of equals: dicts keep order
    x = torch.cat([feats["train"], feats["train_mirrored"]]) if mirrored else feats["train"]
    head = fit_linear(x, torch.cat([train_labels, train_labels]) if mirrored else train_labels, classes, decay)
    with torch.no_grad():
        val = top1(head(feats["val"]), val_labels)
    return HeadChoice(decay, mirrored, val, scored[(mirrored, decay)]), head
