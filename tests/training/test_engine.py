"""The one training engine: its schedule, its loss (committee members, distillation) and its step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.architectures import nets
from pipeline.training.engine import DISTILL_TEMPERATURE, Engine, Loss, make_optimizer, one_cycle_lr, param_groups


def test_one_cycle_warms_up_then_decays_to_zero() -> None:
    assert one_cycle_lr(0, 100, 0.1, 0.2) == pytest.approx(0.004)
    assert one_cycle_lr(20, 100, 0.1, 0.2) == pytest.approx(0.1)
    assert one_cycle_lr(100, 100, 0.1, 0.2) == pytest.approx(0.0)
    # Without warm-up it is the fine-tune's cosine decay from the peak.
    assert one_cycle_lr(25, 100, 0.1, 0.0) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_weight_decay_only_on_weights() -> None:
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=4)
    decay, no_decay = param_groups(model, 0.01)
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim <= 1 for p in no_decay["params"])  # type: ignore[attr-defined]
    assert no_decay["weight_decay"] == 0.0


def test_committee_members_each_add_their_own_loss() -> None:
    logits = torch.randn(2, 4, 43)  # training mode: [members, batch, classes]
    labels = torch.randint(0, 43, (4,))
    total, per_member = Loss().sums(logits, labels, torch.zeros(4, 3, 8, 8))
    expected = sum(F.cross_entropy(logits[m], labels, reduction="sum") for m in range(2))
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    assert per_member == pytest.approx(float(expected) / 2, rel=1e-6)


def test_full_distillation_is_the_kl_to_the_teacher() -> None:
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 43))
    images = torch.rand(4, 3, 8, 8)
    logits = torch.randn(4, 43)
    total, _ = Loss(teacher=teacher, distill=1.0).sums(logits, torch.zeros(4, dtype=torch.long), images)
    t = DISTILL_TEMPERATURE
    target = F.softmax(teacher(images) / t, dim=1)
    kl = F.kl_div(F.log_softmax(logits / t, dim=1), target, reduction="sum") * t * t
    assert float(total) == pytest.approx(float(kl), rel=1e-5)


def test_a_step_sets_the_scheduled_rate_and_learns() -> None:
    torch.manual_seed(0)
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=4, dropout=0.0)
    optim = make_optimizer(model, "adamw", 0.01, 0.0)
    engine = Engine(model, optim, lambda step: 0.01 / (step + 1), Loss())
    images, labels = torch.rand(16, 3, 16, 16), torch.randint(0, 43, (16,))
    first = engine.step(0, images, labels, 16)
    for step in range(1, 30):
        engine.step(step, images, labels, 16)
    assert optim.param_groups[0]["lr"] == pytest.approx(0.01 / 30)
    assert engine.step(30, images, labels, 16) < first


def test_the_engine_takes_a_forward_that_cannot_be_truth_tested() -> None:
    """torch 2.11's compiled module raises on len() of a wrapped Committee, so `forward or model` failed the train
    stage with `train.compile: true` on CUDA (seen on an H200); the engine must use the forward it is given."""
    torch.manual_seed(0)
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=4, dropout=0.0)
    calls: list[int] = []

    class Forward:
        def __len__(self) -> int:
            raise TypeError("Committee does not support len()")

        def __call__(self, images: torch.Tensor) -> torch.Tensor:
            calls.append(len(images))
            return model(images)

    forward = Forward()
    engine = Engine(model, make_optimizer(model, "adamw", 0.01, 0.0), lambda step: 0.01, Loss(), forward=forward)
    assert engine.forward is forward
    engine.step(0, torch.rand(8, 3, 16, 16), torch.randint(0, 43, (8,)), 8)
    assert calls == [8]


def test_micro_batches_make_the_same_update_as_the_whole_batch() -> None:
    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)  # no BatchNorm: a batch's statistics would differ between its parts
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 5)
        )

    images, labels = torch.randn(12, 3, 8, 8), torch.randint(0, 5, (12,))
    updated = []
    for micro_batch in (0, 5):  # 5: parts of 5, 5 and 2
        model = fresh()
        engine = Engine(
            model, make_optimizer(model, "adamw", 0.01, 0.0), lambda s: 0.01, Loss(), micro_batch=micro_batch
        )
        loss = engine.step(0, images, labels, 12)
        updated.append((loss, [p.detach().clone() for p in model.parameters()]))
    (whole_loss, whole), (parts_loss, parts) = updated
    assert parts_loss == pytest.approx(whole_loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, parts, strict=True))
    assert not torch.equal(whole[0], fresh()[0].weight)  # the step moved the weights
