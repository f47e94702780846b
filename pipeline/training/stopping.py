"""Early stopping (`train.early_stopping_patience`, with validation held out): stop after `patience` epochs without a
better validation accuracy and keep the best epoch's weights.

Validation accuracy is the same on every process, so every process stops together. The counters and (from rank 0)
the best weights are saved in every checkpoint, so a run killed and resumed stops where, and keeps what, an
uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline import console


@dataclass
class EarlyStopping:
    """The best epoch so far, and how many epochs since brought no better one."""

    patience: int
    """Epochs without a better validation accuracy before stopping; 0: off (validation trained on, or
    `train.early_stopping_patience` 0)."""
    best_accuracy: float = -1.0
    """The best epoch's validation accuracy (-1: none yet)."""
    best_epoch: int = 0
    """The best epoch, counted from 1 (0: none yet)."""
    stale: int = 0
    """Epochs since the best one."""
    stopped: bool = False
    """Patience ran out: a rerun resumes to the end, not to more epochs."""
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """The best epoch's whole weights on CPU (rank 0's: other ranks of a sharded or resumed run may hold none)."""

    @property
    def kept(self) -> bool:
        """A best epoch is kept: its weights, not the last epoch's, are the model."""
        return self.best_epoch > 0

    def after_epoch(
        self, epoch: int, val_accuracy: float | None, snapshot: Callable[[], dict[str, torch.Tensor]], main: bool
    ) -> bool:
        """Epoch `epoch` scored `val_accuracy`: keep its weights (`snapshot()`, on every rank) when it is the best so
        far; True once `patience` epochs brought no better one (said on the main process)."""
        if not self.patience or val_accuracy is None:
            return False
        if val_accuracy > self.best_accuracy:
            self.best_accuracy, self.best_epoch, self.stale = val_accuracy, epoch, 0
            self.weights = snapshot()
        else:
            self.stale += 1
        if self.stale < self.patience:
            return False
        if main:
            console.log(
                f"early stopping after epoch {epoch}: no better validation accuracy for {self.patience} "
                f"epoch(s); keeping epoch {self.best_epoch}'s weights ({self.best_accuracy:.4f})"
            )
        self.stopped = True
        return True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the weights (saved on their own: checkpoint.BEST_WEIGHTS)."""
        return {
            "best_accuracy": self.best_accuracy,
            "best_epoch": self.best_epoch,
            "stale": self.stale,
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_accuracy = float(state["best_accuracy"])
        self.best_epoch = int(state["best_epoch"])
        self.stale = int(state["stale"])
        self.stopped = bool(state["stopped"])
