"""The training state a checkpoint keeps: the time budget's plan, early stopping's best epoch, the history, through
trainer.json and back; the format before sections still read, a newer or broken one refused with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import StageError
from pipeline.training.budget import TimeBudget
from pipeline.training.state import FORMAT, EpochRecord, MadeWith, TrainState
from pipeline.training.stopping import EarlyStopping
from tests.helpers.params import train_params

MADE = MadeWith("0123456789abcdef", 2, "ddp")
FOLDER = Path("models/checkpoints/0123456789abcdef/step_00000012")


def test_the_budget_plans_at_the_mean_pace_within_its_bounds() -> None:
    budget = TimeBudget(max_minutes=1, most=6)
    assert budget.epochs == 6  # nothing planned before the first epoch: the schedule spans train.epochs
    assert budget.after_epoch(1, 30.0) == 2 and budget.epochs == 2
    assert budget.after_epoch(2, 10.0) == 3 and (budget.seconds, budget.planned) == (40.0, 3)
    assert budget.after_epoch(3, 600.0) == 3  # never fewer than the epochs done
    unlimited = TimeBudget(max_minutes=0, most=4)
    assert unlimited.after_epoch(1, 1e6) == 4 and unlimited.state_dict() == {"seconds": 0.0, "planned": None}


def test_early_stopping_keeps_the_best_epoch_and_stops_after_its_patience() -> None:
    stopping = EarlyStopping(patience=2)
    snapshots = iter(range(10))

    def snapshot() -> dict[str, torch.Tensor]:
        return {"w": torch.tensor([float(next(snapshots))])}

    results = [
        stopping.after_epoch(epoch, acc, snapshot, main=False) for epoch, acc in enumerate((0.5, 0.7, 0.6, 0.7), 1)
    ]
    assert results == [False, False, False, True] and stopping.stopped
    assert (stopping.best_epoch, stopping.best_accuracy, stopping.stale) == (2, 0.7, 2)
    assert stopping.weights is not None and float(stopping.weights["w"]) == 1.0  # epoch 2's snapshot
    off = EarlyStopping(patience=0)
    assert not off.after_epoch(1, 0.9, snapshot, main=False) and not off.kept


def test_the_state_goes_through_trainer_json_and_back() -> None:
    t = train_params(epochs=6, max_minutes=1, early_stopping_patience=3).train
    state = TrainState.new(t, held_out=True)
    state.budget.after_epoch(1, 30.0)
    state.stopping.after_epoch(1, 0.25, dict, main=False)
    state.close_epoch(EpochRecord(1, 3.5, 0.25, 0.003, 100.0))
    state.add(7.0, 32)
    saved = json.loads(json.dumps(state.checkpoint(MADE, 12, {"epoch": 1, "offset": 128}, session_seconds=2.0)))
    assert saved["format"] == FORMAT and saved["step"] == 12 and saved["fingerprint"] == MADE.fingerprint
    assert saved["budget"] == {"seconds": 30.0, "planned": 2}
    assert saved["early_stopping"] == {"best_accuracy": 0.25, "best_epoch": 1, "stale": 0, "stopped": False}
    assert saved["history"] == [
        {"epoch": 1, "train_loss": 3.5, "val_accuracy": 0.25, "lr": 0.003, "images_per_s": 100.0}
    ]

    again = TrainState.new(t, held_out=True)
    again.restore(saved, FOLDER)
    assert again.history == state.history and again.budget == state.budget
    assert (again.epoch_loss, again.epoch_samples, again.train_seconds) == (7.0, 32, 2.0)
    assert again.stopping.state_dict() == state.stopping.state_dict() and again.epochs == 2


def test_a_format_1_trainer_json_resumes_as_it_did() -> None:
    """Before the sections: flat keys, each optional; early stopping started afresh on a resume (only whether it had
    stopped was kept)."""
    t = train_params(epochs=6, max_minutes=1, early_stopping_patience=3).train
    old = {"step": 12, "loader": {}, "fingerprint": MADE.fingerprint, "world_size": 1, "strategy": "single",
           "history": [{"epoch": 1, "train_loss": 3.5, "val_accuracy": None, "lr": 0.003, "images_per_s": 100.0}],
           "epoch_loss": 7.0, "epoch_samples": 32, "train_seconds": 2.0, "stopped_early": True,
           "planned_epochs": 2, "budget_seconds": 30.0}  # fmt: skip
    state = TrainState.new(t, held_out=True)
    state.restore(old, FOLDER)
    assert (state.budget.seconds, state.budget.planned, state.epochs) == (30.0, 2, 2)
    assert state.done and not state.stopping.kept and state.history[0].val_accuracy is None
    oldest = TrainState.new(t, held_out=True)
    oldest.restore({"step": 3, "loader": {}}, FOLDER)  # before the budget was kept
    assert oldest.budget.planned is None and oldest.history == [] and not oldest.done


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        ({"format": 3}, r"step_00000012 is in trainer-state format 3, which this train stage cannot read"),
        ({"format": "2"}, r"format '2', which this train stage cannot read"),
        ({"format": 2, "history": []}, r"step_00000012 is corrupt: its trainer.json \(format 2\) cannot be read"),
        ({"history": [{"epoch": 1}]}, r"is corrupt: its trainer.json \(format 1\) cannot be read \(KeyError"),
    ],
)
def test_a_trainer_json_this_version_cannot_read_is_refused_by_name(saved: dict[str, object], message: str) -> None:
    state = TrainState.new(train_params().train, held_out=True)
    with pytest.raises(StageError, match=message):
        state.restore(saved, FOLDER)
