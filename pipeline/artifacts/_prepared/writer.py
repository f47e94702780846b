"""data/prepared/'s writer: the three splits streamed shard by shard into a staging folder, swapped in whole."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.artifacts._files import fsync_dir, write_model
from pipeline.artifacts._prepared.schema import (
    LABELS_FILE,
    MANIFEST_FILE,
    PREPARED_DIR,
    SHARD_MB,
    SPLITS,
    TEST_FILES,
    TRACKS_FILE,
    PreparedManifest,
    ShardInfo,
    SplitArrays,
    SplitInfo,
)


@dataclass
class SplitStats:
    """What the writer learnt of one split while streaming it (the manifest's counts, mean/std)."""

    info: SplitInfo
    labels: np.ndarray
    tracks: np.ndarray
    channel_sum: np.ndarray  # float64 [3], of pixel values 0-255
    channel_squares: np.ndarray
    pixels: int  # per channel

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and std of the pixels / 255."""
        n = max(1, self.pixels)
        mean = self.channel_sum / n
        std = np.sqrt(np.maximum(self.channel_squares / n - mean**2, 0.0))
        return [round(float(v) / 255, 6) for v in mean], [round(float(v) / 255, 6) for v in std]


def _channel_sums(images: np.ndarray, square: bool, rows: int = 4096) -> np.ndarray:
    """Per-channel sum of the uint8 pixels (or of their squares), exact, as float64 [3]. Whole image rows are
    summed as vectors (no float64 copy of every pixel; numpy sums contiguous rows far faster than it strides
    over the channel axis), in blocks of `rows` so the uint32 squares stay small."""
    flat = images.reshape(-1, images.shape[-2] * 3)  # [N * H, W * 3]
    total = np.zeros(flat.shape[1], dtype=np.uint64)
    for start in range(0, len(flat), rows):
        block = flat[start : start + rows]
        if square:
            block = block.astype(np.uint32)
            block *= block
        total += block.sum(axis=0, dtype=np.uint64)
    return total.reshape(-1, 3).sum(axis=0).astype(np.float64)


class Writer:
    """Streams the three splits into a staging folder, in SPLITS order, shard by shard; `finish()` adds the
    manifest and the test originals and swaps the folder in for `out_dir`. A failure (or leaving the `with`
    block without `finish()`) removes the staging folder: the previous data/prepared/ is left as it was."""

    def __init__(self, out_dir: Path = PREPARED_DIR, image_size: int = 32, shard_mb: float = SHARD_MB) -> None:
        self.out_dir = Path(out_dir)
        self.image_size = image_size
        self.row_bytes = image_size * image_size * 3
        self.shard_rows = max(1, int(shard_mb * 2**20) // self.row_bytes)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.out_dir.parent.glob(f".{self.out_dir.name}-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}-", dir=self.out_dir.parent))
        self.staging.chmod(0o755)  # mkdtemp makes it private; the outputs are ordinary files
        self._digest = hashlib.sha256()
        self._stats: dict[str, SplitStats] = {}
        self._split: str | None = None
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._shards: list[ShardInfo] = []
        self._labels: list[np.ndarray] = []
        self._tracks: list[np.ndarray] = []
        self._sum, self._squares = np.zeros(3), np.zeros(3)
        self._done = False

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            shutil.rmtree(self.staging, ignore_errors=True)

    def begin(self, split: str) -> None:
        expected = SPLITS[len(self._stats)] if len(self._stats) < len(SPLITS) else None
        if self._split is not None or split != expected:
            raise ValueError(f"splits are written one at a time in {SPLITS} order; got {split!r}")
        self._split = split
        (self.staging / split).mkdir()
        self._shards, self._labels, self._tracks = [], [], []
        self._sum, self._squares = np.zeros(3), np.zeros(3)

    def add(self, images: np.ndarray, labels: np.ndarray, tracks: np.ndarray) -> None:
        """Append rows to the current split; full shards are written at once (a shard's rows stay in memory
        until then: data.shard_mb bounds it)."""
        if self._split is None:
            raise ValueError("begin(split) first")
        s = self.image_size
        if images.dtype != np.uint8 or images.shape[1:] != (s, s, 3) or not len(images) == len(labels) == len(tracks):
            raise ValueError(f"rows must be uint8 [n, {s}, {s}, 3] with n labels and tracks, got {images.shape}")
        labels, tracks = labels.astype(np.uint8), tracks.astype(np.int32)
        if not self._pending:  # whole shards straight from the caller's rows
            while len(images) >= self.shard_rows:
                n = self.shard_rows
                self._write_shard(images[:n], labels[:n], tracks[:n])
                images, labels, tracks = images[n:], labels[n:], tracks[n:]
        if len(images):  # copied: the caller may refill its buffer before the shard is full
            self._pending.append((images.copy(), labels, tracks))
            self._pending_rows += len(images)
        while self._pending_rows >= self.shard_rows:
            self._flush(self.shard_rows)

    def _flush(self, rows: int) -> None:
        images = np.concatenate([p[0] for p in self._pending]) if len(self._pending) > 1 else self._pending[0][0]
        labels = np.concatenate([p[1] for p in self._pending])
        tracks = np.concatenate([p[2] for p in self._pending])
        rest = (images[rows:], labels[rows:], tracks[rows:])
        self._pending = [rest] if len(rest[0]) else []
        self._pending_rows = len(rest[0])
        self._write_shard(images[:rows], labels[:rows], tracks[:rows])

    def _write_shard(self, images: np.ndarray, labels: np.ndarray, tracks: np.ndarray) -> None:
        images = np.ascontiguousarray(images)
        name = f"{self._split}/images-{len(self._shards):05d}.npy"
        np.save(self.staging / name, images, allow_pickle=False)
        self._digest.update(images.data)
        self._shards.append(ShardInfo(file=name, count=len(images), sha256=hashlib.sha256(images.data).hexdigest()))
        self._labels.append(labels.copy())
        self._tracks.append(tracks.copy())
        self._sum += _channel_sums(images, square=False)
        self._squares += _channel_sums(images, square=True)

    def end(self, num_classes: int) -> SplitStats:
        """Write the split's last shard, labels and tracks; its counts for the manifest."""
        split = self._split
        if split is None:
            raise ValueError("begin(split) first")
        if self._pending_rows:
            self._flush(self._pending_rows)
        labels = np.concatenate(self._labels) if self._labels else np.zeros(0, np.uint8)
        tracks = np.concatenate(self._tracks) if self._tracks else np.zeros(0, np.int32)
        np.save(self.staging / split / LABELS_FILE, labels, allow_pickle=False)
        np.save(self.staging / split / TRACKS_FILE, tracks, allow_pickle=False)
        self._digest.update(np.ascontiguousarray(labels).data)
        info = SplitInfo(
            file=split,
            count=len(labels),
            per_class=np.bincount(labels, minlength=num_classes).tolist(),
            # groups only where the data has them (the demo's tracks, a CSV's group); files alone count none
            tracks=len(np.unique(tracks)) if split != "test" and (tracks >= 0).any() else None,
            shards=self._shards,
        )
        pixels = len(labels) * self.image_size * self.image_size
        self._stats[split] = SplitStats(info, labels, tracks, self._sum, self._squares, pixels)
        self._split = None
        return self._stats[split]

    @property
    def content_sha256(self) -> str:
        if len(self._stats) != len(SPLITS):
            raise ValueError("every split must be written first")
        return self._digest.hexdigest()

    def finish(self, manifest: PreparedManifest, test_originals: Sequence[Path] = ()) -> Path:
        """Copy the test originals (byte for byte, named as in the manifest's `test_files`), write the manifest
        (its splits and content hash are the ones written here) and swap the folder in."""
        try:
            manifest = manifest.model_copy(
                update={
                    "splits": {split: self._stats[split].info for split in SPLITS},
                    "content_sha256": self.content_sha256,
                }
            )
            if len(test_originals) != len(manifest.test_files) or (
                test_originals and len(test_originals) != manifest.splits["test"].count
            ):
                raise ValueError("one original file per test image, named in the manifest's test_files")
            if test_originals:
                (self.staging / TEST_FILES).mkdir()
            for source, name in zip(test_originals, manifest.test_files, strict=True):
                shutil.copyfile(source, self.staging / name)
            write_model(self.staging / MANIFEST_FILE, manifest)
            _replace_dir(self.staging, self.out_dir)
        except BaseException:
            shutil.rmtree(self.staging, ignore_errors=True)
            raise
        self._done = True
        return self.out_dir


def write(
    arrays: dict[str, SplitArrays],
    manifest: PreparedManifest,
    out_dir: Path = PREPARED_DIR,
    test_originals: list[Path] | None = None,
    shard_mb: float = SHARD_MB,
) -> Path:
    """Write in-memory splits (small data, tests) through the streaming Writer."""
    with Writer(out_dir, manifest.image_size, shard_mb) as writer:
        for split in SPLITS:
            writer.begin(split)
            writer.add(arrays[split].images, arrays[split].labels, arrays[split].tracks)
            writer.end(manifest.num_classes)
        return writer.finish(manifest, test_originals or [])


def _replace_dir(new: Path, target: Path) -> None:
    """Swap `new` into `target` so readers never see a half-written folder. A kill between the two renames
    leaves `target.old` and no `target`: the next call (or a reader's error) starts from there, nothing mixes."""
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        target.rename(old)
    new.rename(target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)
