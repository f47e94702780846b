"""The time budget (`train.max_minutes`, as Ultralytics' `time`): after every epoch the run plans as many epochs as fit
at the mean pace of its epochs so far, at most `train.epochs`, and the learning rate anneals over those.

One slow first epoch (warm-up, another program busy for a while) does not decide the whole run: the plan is made
again after every epoch. What the plan rests on (the finished epochs' seconds and the last plan) is saved in every
checkpoint, so a run killed and resumed plans the epochs an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline import console


@dataclass
class TimeBudget:
    """The epochs `max_minutes` allows, planned again after every epoch."""

    max_minutes: float
    """`train.max_minutes`; 0: no budget (every one of `most` epochs)."""
    most: int
    """`train.epochs`: never more are planned."""
    seconds: float = 0.0
    """The finished epochs' seconds, validation included (an epoch a resume began part-way counts this session's
    pace over the whole epoch): their mean is the pace the plan uses."""
    planned: int | None = None
    """The epochs planned after the last finished epoch; None: no budget, or no epoch finished yet."""

    @property
    def epochs(self) -> int:
        """The run's epochs now: `most`, or fewer where the budget planned them (the schedule anneals over these)."""
        return min(self.most, self.planned or self.most)

    def after_epoch(self, done: int, seconds: float, world: int = 1, main: bool = True) -> int:
        """Epoch `done` (counted from 1) took `seconds`: plan again at the mean pace so far; the run's epochs."""
        if not self.max_minutes:
            return self.epochs
        self.seconds += seconds
        self.planned = self.fits(self.seconds / done, done, world, main)
        return self.planned

    def fits(self, epoch_seconds: float, done: int = 1, world: int = 1, main: bool = False) -> int:
        """The epochs that fit in `max_minutes` at `epoch_seconds` an epoch (the mean of the `done` epochs so far,
        validation included), between `done` and `most`; every process plans with the slowest one's pace, so all
        stop together. Logged the first time and whenever the plan changes."""
        pace = torch.tensor([epoch_seconds], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(pace, op=dist.ReduceOp.MAX)
        planned = max(1, done, min(self.most, int(self.max_minutes * 60 / max(float(pace[0]), 1e-9))))
        if main and planned != self.planned:
            console.log(
                f"time budget: an epoch takes {float(pace[0]):.0f} s here"
                f"{'' if self.planned is None else f' (the mean of {done})'}, so {planned} of train.epochs' "
                f"{self.most} fit in train.max_minutes={self.max_minutes:g}; the learning rate anneals over {planned}"
            )
        return planned

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (the settings are in its fingerprint)."""
        return {"seconds": self.seconds, "planned": self.planned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds = float(state["seconds"])
        self.planned = None if state["planned"] is None else int(state["planned"])
