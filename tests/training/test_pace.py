import time

import pytest
import torch
from torch import nn

from pipeline.training import pace


class SlowAtSize(nn.Module):
    """A real (tiny) network whose every forward also waits in proportion to the input's area: a machine on which
    training costs side² x `seconds_per_pixel` per batch, whatever the CPU."""

    def __init__(self, seconds_per_pixel: float) -> None:
        super().__init__()
        self.seconds_per_pixel = seconds_per_pixel
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds_per_pixel * x.shape[-1] * x.shape[-2])
        return self.linear(x.mean(dim=(2, 3)))


def test_candidate_sides_go_down_in_steps_of_16_from_the_largest() -> None:
    assert pace.candidate_sizes(128, 64) == [128, 112, 96, 80, 64]
    assert pace.candidate_sizes(100, 64) == [100, 84, 68]
    assert pace.candidate_sizes(128, 128) == [128] and pace.candidate_sizes(32, 64) == [32]


def test_a_real_step_is_timed_and_a_larger_side_is_slower() -> None:
    torch.manual_seed(0)
    # Two 32-channel convolutions: at 160 px the step is compute-bound (about 100x the pixels of 16 px), so the
    # machine's noise cannot turn the order around; the best of interleaved rounds drops a round a neighbour slowed.
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 5),
    )
    rounds = [(pace.images_per_second(net, 16, 8, 5, torch.device("cpu"), None),
               pace.images_per_second(net, 160, 8, 5, torch.device("cpu"), None)) for _ in range(3)]  # fmt: skip
    small, large = max(r[0] for r in rounds), max(r[1] for r in rounds)
    assert small > 2 * large > 0, rounds
    assert net.training and net[0].weight.grad is not None  # the timing trained: forward, backward, update


def test_the_timed_batch_is_channels_last_as_the_training_loader_gives_it() -> None:
    seen: list[bool] = []

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.is_contiguous(memory_format=torch.channels_last))
            return self.conv(x).mean(dim=(2, 3))

    pace.images_per_second(Recording(), 16, 4, 4, torch.device("cpu"), None)
    assert seen and all(seen)


@pytest.mark.parametrize(
    ("minutes", "chosen", "timed"),
    [
        (10.0, 48, [48, 16]),  # everything fits: the largest (and the smallest, timed first)
        (0.9, 32, [48, 32, 16]),  # 48 px would take about 1.3 minutes, 32 px about 0.6: the largest that fits
        (0.01, 16, [16]),  # nothing fits, the smallest alone timed: the train stage's budget then cuts epochs
    ],
)
def test_the_largest_side_whose_epochs_fit_the_budget_is_chosen(minutes: float, chosen: int, timed: list[int]) -> None:
    # A batch of 4 waits side² x 2e-5 s: 46 ms at 48 px (87 img/s), 20 ms at 32 (196), 5 ms at 16 (780); an epoch of
    # 1,000 training images and 300 validation images then takes 12.7, 5.6 and 1.4 s; 6 epochs 1.3, 0.6, 0.14 min.
    side, paces = pace.affordable_size(
        [48, 32, 16], lambda _side: SlowAtSize(2e-5), batch=4, classes=4, train_images=1000, val_images=300,
        epochs=6, minutes=minutes, device=torch.device("cpu"), amp=None,
    )  # fmt: skip
    assert side == chosen and [p.image_size for p in paces] == timed
    rates = [p.images_per_second for p in paces]
    assert rates == sorted(rates)  # smaller sides step faster
    assert paces[0].epoch_seconds(1000, 300) == pytest.approx(1000 / rates[0] + 300 / (3 * rates[0]))
