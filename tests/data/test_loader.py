"""The stateful loader: deterministic, rank-aware, resumable at the same global sample for any world size."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import pytest
import torch

from pipeline.data.loader import (
    AugmentConfig,
    Split,
    TrainLoader,
    augment,
    draw_params,
    eval_batches,
    load_split,
    training_images,
)
from pipeline.errors import StageError


def make_split(n: int = 100, size: int = 8) -> Split:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
    return Split(images=images, labels=torch.arange(n) % 43)


def indices(loader: TrainLoader, steps: int | None = None) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.indices.tolist())
        if steps is not None and len(out) == steps:
            break
    return out


def test_same_seed_same_batches_and_pixels() -> None:
    split = make_split()
    a = [(b.indices, b.images) for b in TrainLoader(split, 16, seed=3)]
    b = [(b.indices, b.images) for b in TrainLoader(split, 16, seed=3)]
    assert len(a) == 100 // 16
    for (ia, xa), (ib, xb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)
    other = [b.indices for b in TrainLoader(split, 16, seed=4)]
    assert not all(torch.equal(x[0], y) for x, y in zip(a, other, strict=True))


def test_epochs_reshuffle_and_never_repeat_within_an_epoch() -> None:
    loader = TrainLoader(make_split(), 16, seed=0)
    first = list(chain.from_iterable(indices(loader)))
    second = list(chain.from_iterable(indices(loader)))
    assert loader.epoch == 2
    assert len(set(first)) == len(first) == 96
    assert first != second


def test_ranks_split_the_global_batch_with_identical_augmentation() -> None:
    split = make_split()
    single = list(TrainLoader(split, 16, seed=1))
    ranks = [list(TrainLoader(split, 16, seed=1, rank=r, world_size=2)) for r in range(2)]
    for step, whole in enumerate(single):
        parts = [ranks[r][step] for r in range(2)]
        assert sorted(chain.from_iterable(p.indices.tolist() for p in parts)) == sorted(whole.indices.tolist())
        for part in parts:
            assert part.global_size == 16
            for row, index in enumerate(part.indices.tolist()):
                where = whole.indices.tolist().index(index)
                assert torch.equal(part.images[row], whole.images[where])  # same pixels on any world size


@pytest.mark.parametrize(("world_before", "world_after"), [(1, 2), (2, 1), (2, 3), (1, 1)])
def test_resume_with_another_world_size_neither_revisits_nor_skips(world_before: int, world_after: int) -> None:
    split = make_split(100)
    reference = TrainLoader(split, 12, seed=7)
    expected = [sorted(step) for step in indices(reference)] + [sorted(step) for step in indices(reference)]

    before = [TrainLoader(split, 12, seed=7, rank=r, world_size=world_before) for r in range(world_before)]
    seen: list[list[int]] = []
    for step_batches in zip(*(indices(loader, steps=3) for loader in before), strict=True):
        seen.append(sorted(chain.from_iterable(step_batches)))
    state = before[0].state_dict()
    assert state["offset"] == 36 and state["epoch"] == 0

    after = [TrainLoader(split, 12, seed=7, rank=r, world_size=world_after) for r in range(world_after)]
    for loader in after:
        loader.load_state_dict(state)
    for _ in range(2):  # the rest of epoch 0, then all of epoch 1
        for step_batches in zip(*(indices(loader) for loader in after), strict=True):
            seen.append(sorted(chain.from_iterable(step_batches)))
    assert seen == expected


@pytest.mark.parametrize(("world_before", "world_after"), [(1, 2), (2, 1)])
def test_streamed_shards_resume_at_a_random_step_on_another_process_count(
    tmp_path: Path, world_before: int, world_after: int
) -> None:
    """The training split streamed from several shards: stopped at a random step of an epoch and resumed on
    another number of processes, every sample of the epoch is seen once, as in an uninterrupted run, with the
    pixels the in-memory arrays give."""
    import random

    from pipeline.artifacts.prepared import read_split
    from tests.helpers.prepared import write_prepared

    folder = write_prepared(tmp_path, sizes=(300, 43, 43), image_size=8, shard_mb=64 * 192 / 2**20)  # 64 a shard
    streamed = load_split("train", folder)
    assert len(streamed.images.readers[0]._shards) == 5  # type: ignore[union-attr]
    in_memory = Split.of(read_split("train", folder))
    reference = [(b.indices.tolist(), b.images) for b in TrainLoader(in_memory, 16, seed=5)]
    stop = random.Random(f"{world_before}{world_after}").randrange(1, len(reference) - 1)

    before = [TrainLoader(streamed, 16, seed=5, rank=r, world_size=world_before) for r in range(world_before)]
    seen: list[list[int]] = []
    for step_batches in zip(*(indices(loader, steps=stop) for loader in before), strict=True):
        seen.append(sorted(chain.from_iterable(step_batches)))
    state = before[0].state_dict()  # what a checkpoint keeps; the processes are gone (kill -9)
    after = [TrainLoader(streamed, 16, seed=5, rank=r, world_size=world_after) for r in range(world_after)]
    for loader in after:
        loader.load_state_dict(state)
    for step, step_batches in enumerate(zip(*after, strict=True), start=stop):
        seen.append(sorted(chain.from_iterable(b.indices.tolist() for b in step_batches)))
        whole_indices, whole_images = reference[step]
        for part in step_batches:
            for row, index in enumerate(part.indices.tolist()):
                assert torch.equal(part.images[row], whole_images[whole_indices.index(index)])
    assert seen == [sorted(step) for step, _ in reference]
    assert len(set(chain.from_iterable(seen))) == 300 // 16 * 16  # each sample once (the last partial batch dropped)


def test_loader_refuses_a_state_from_other_data() -> None:
    loader = TrainLoader(make_split(100), 10, seed=0)
    state = loader.state_dict()
    with pytest.raises(StageError, match="num_samples"):
        TrainLoader(make_split(90), 10, seed=0).load_state_dict(state)


def test_identity_augmentation_keeps_pixels() -> None:
    x = torch.rand(4, 3, 8, 8)
    params = draw_params(AugmentConfig(0.0, 0.0, (1.0, 1.0), 0.0, 0.0, 0.0, 0.0), 4, torch.Generator())
    assert torch.allclose(augment(x, params), x, atol=1e-5)


def test_augmentation_varies_per_image() -> None:
    x = torch.rand(1, 3, 16, 16).expand(8, 3, 16, 16).contiguous()
    out = augment(x, draw_params(AugmentConfig(), 8, torch.Generator().manual_seed(0)))
    assert out.min() >= 0 and out.max() <= 1
    assert not torch.allclose(out[0], out[1])


def test_eval_batches_cover_the_split_once_with_equal_batches_per_rank() -> None:
    split = make_split(37)
    counts = []
    seen: list[int] = []
    for rank in range(3):
        batches = list(eval_batches(split, 5, rank, 3))
        counts.append(len(batches))
        for images, labels, valid in batches:
            assert images.dtype == torch.float32 and images.shape[0] == labels.shape[0]
            seen.extend(labels[:valid].tolist())
    assert len(set(counts)) == 1
    assert sorted(seen) == sorted(split.labels.tolist())


def test_missing_prepared_data_is_a_stage_error(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="run `pipeline prepare` first"):
        load_split("train", tmp_path)


def test_training_images_are_the_training_split_then_validation_when_asked(tmp_path: Path) -> None:
    """One definition of what a shipped model learns from (train stage, optimize's fine-tune and student)."""
    from tests.helpers.prepared import write_prepared

    prepared = write_prepared(tmp_path)
    train, val = load_split("train", prepared), load_split("val", prepared)
    held_out = training_images(False, prepared)
    assert torch.equal(held_out.images[:], train.images[:]) and torch.equal(held_out.labels, train.labels)
    both = training_images(True, prepared)
    assert len(both) == len(train) + len(val) == 256 + 86
    assert torch.equal(both.images[: len(train)], train.images[:])
    assert torch.equal(both.images[len(train) :], val.images[:])
    rows = torch.tensor([len(train) + 3, 5, len(train), 0])  # one batch across the two splits' shards
    assert torch.equal(
        both.images[rows], torch.cat([val.images[[3]], train.images[[5]], val.images[[0]], train.images[[0]]])
    )
    assert torch.equal(both.labels, torch.cat([train.labels, val.labels]))
    assert both.images[rows].is_contiguous(memory_format=torch.channels_last)  # the layout the loader hands on
