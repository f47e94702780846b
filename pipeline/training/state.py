"""What a training run carries from epoch to epoch and through a checkpoint, typed: the finished epochs, the epoch in
progress, the time budget (budget.py) and early stopping (stopping.py).

A checkpoint's `trainer.json` (checkpoint.py) is `TrainState.checkpoint(...)`: format 2, with the budget and early
stopping each in a section of its own. A format-1 file (no `format` key, written before the sections: flat
`planned_epochs`, `budget_seconds`, `stopped_early`) still resumes, as it did then: the budget where it was, early
stopping from nothing since the resume (format 1 kept no best epoch). A newer format is refused with a message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import StageError
from pipeline.training.budget import TimeBudget
from pipeline.training.stopping import EarlyStopping

if TYPE_CHECKING:
    from pipeline.config import TrainConfig

FORMAT = 2


@dataclass(frozen=True)
class EpochRecord:
    """One finished epoch, as the history, reports/train/history.csv and MLflow have it."""

    epoch: int
    """Counted from 1."""
    train_loss: float
    """The mean training loss over every process's samples of the epoch."""
    val_accuracy: float | None
    """Validation accuracy after the epoch; None: validation was trained on."""
    lr: float
    """The learning rate of the epoch's last step."""
    images_per_s: float
    """Training images a second over all processes (this session's part of the epoch)."""

    def row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> EpochRecord:
        accuracy = row["val_accuracy"]
        return cls(
            int(row["epoch"]),
            float(row["train_loss"]),
            None if accuracy is None else float(accuracy),
            float(row["lr"]),
            float(row["images_per_s"]),
        )


@dataclass(frozen=True)
class MadeWith:
    """What a checkpoint records it was made with, beside where training is."""

    fingerprint: str
    """The params + data fingerprint (checkpoint.fingerprint): resuming checks it."""
    world_size: int
    """Processes that trained (a resume may use another number)."""
    strategy: str
    """ddp or fsdp with several processes, single with one."""


@dataclass
class TrainState:
    """Where the run is, beside the weights, optimizer and loader position."""

    budget: TimeBudget
    """`train.max_minutes`: the epochs planned so far."""
    stopping: EarlyStopping
    """`train.early_stopping_patience`: the best epoch so far."""
    history: list[EpochRecord] = field(default_factory=list)
    """The finished epochs, in order (those before a resume included)."""
    epoch_loss: float = 0.0
    """The epoch in progress: this process's summed loss so far."""
    epoch_samples: int = 0
    """The epoch in progress: this process's samples so far."""
    train_seconds: float = 0.0
    """Seconds spent training (saves and validation not counted), up to the last finished epoch or checkpoint."""

    @classmethod
    def new(cls, t: TrainConfig, held_out: bool) -> TrainState:
        """A run from its first step: early stopping only with validation held out."""
        return cls(TimeBudget(t.max_minutes, t.epochs), EarlyStopping(t.early_stopping_patience if held_out else 0))

    @property
    def epochs(self) -> int:
        """The run's epochs now (the time budget's plan, else `train.epochs`)."""
        return self.budget.epochs

    @property
    def done(self) -> bool:
        """Early stopping ended the run."""
        return self.stopping.stopped

    def add(self, loss: float, samples: int) -> None:
        """A step of the epoch in progress: its summed loss and samples, this process's."""
        self.epoch_loss += loss
        self.epoch_samples += samples

    def close_epoch(self, record: EpochRecord) -> None:
        """The epoch joins the history, once (a rerun of a finished epoch's end does not add it twice); the sums
        restart."""
        self.epoch_loss, self.epoch_samples = 0.0, 0
        if not (self.history and self.history[-1].epoch == record.epoch):
            self.history.append(record)

    def checkpoint(
        self, made: MadeWith, step: int, loader: dict[str, Any], session_seconds: float
    ) -> dict[str, Any]:  # fmt: skip
        """trainer.json: where training is (`session_seconds`: this session's part of the epoch in progress)."""
        return {
            "format": FORMAT,
            "step": step,
            "loader": loader,
            **asdict(made),
            "history": [entry.row() for entry in self.history],
            "epoch_loss": self.epoch_loss,
            "epoch_samples": self.epoch_samples,
            "train_seconds": self.train_seconds + session_seconds,
            "budget": self.budget.state_dict(),
            "early_stopping": self.stopping.state_dict(),
        }

    def restore(self, saved: Mapping[str, Any], folder: Path) -> None:
        """This state as checkpoint `folder` saved it (`saved`: its trainer.json); StageError where it cannot be
        read. Early stopping's best weights are loaded apart (checkpoint.best_weights)."""
        version = saved.get("format", 1)
        if not isinstance(version, int) or not 1 <= version <= FORMAT:
            raise StageError(
                f"checkpoint {folder} is in trainer-state format {version!r}, which this train stage cannot read "
                f"(it reads 1 to {FORMAT}: the checkpoint was made by another version of the pipeline); run that "
                f"version to finish it, or delete {folder} to resume from an older checkpoint"
            )
        try:
            self._restore(saved, version)
        except (KeyError, TypeError, ValueError) as exc:
            raise StageError(
                f"checkpoint {folder} is corrupt: its trainer.json (format {version}) cannot be read "
                f"({type(exc).__name__}: {exc}); delete {folder} to resume from an older checkpoint"
            ) from None

    def _restore(self, saved: Mapping[str, Any], version: int) -> None:
        if version == 1:  # every key was optional then
            self.history = [EpochRecord.of(row) for row in saved.get("history", [])]
            self.epoch_loss = float(saved.get("epoch_loss", 0.0))
            self.epoch_samples = int(saved.get("epoch_samples", 0))
            self.train_seconds = float(saved.get("train_seconds", 0.0))
            planned = saved.get("planned_epochs")
            self.budget.load_state_dict({"seconds": saved.get("budget_seconds", 0.0), "planned": planned})
            self.stopping.stopped = bool(saved.get("stopped_early", False))
            return
        self.history = [EpochRecord.of(row) for row in saved["history"]]
        self.epoch_loss = float(saved["epoch_loss"])
        self.epoch_samples = int(saved["epoch_samples"])
        self.train_seconds = float(saved["train_seconds"])
        self.budget.load_state_dict(saved["budget"])
        self.stopping.load_state_dict(saved["early_stopping"])
