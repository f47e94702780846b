"""data/prepared/'s reader: a split's rows on demand (SplitReader), whole in memory (read_split), a batch at a time
as the model takes them (ModelInput); the manifest and the original test files."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.artifacts._prepared.schema import (
    LABELS_FILE,
    MANIFEST_FILE,
    PREPARED_DIR,
    RERUN,
    SPLITS,
    TRACKS_FILE,
    PreparedManifest,
    ShardInfo,
    SplitArrays,
    to_model_input,
)
from pipeline.artifacts._prepared.storage import Files, files_of
from pipeline.errors import StageError


def read_manifest(prepared: Path | Files = PREPARED_DIR) -> PreparedManifest:
    return files_of(prepared).read_record(MANIFEST_FILE, PreparedManifest)


@dataclass(frozen=True)
class _Shard:
    name: str
    count: int
    offset: int  # of the first row: the .npy header's length
    sha256: str


class SplitReader:
    """One prepared split, read by row: labels and tracks in memory, pixels from the shards on demand
    (`take`), so a reader holds only what it asked for. Opening checks the manifest, the labels and every
    shard's header and length; `verify()` also checks the shards' SHA-256 (a file changed in place). The files
    are on this disk (a path) or read straight from the DVC remote (DvcRemoteFiles): any `Files`."""

    def __init__(self, split: str, prepared: Path | Files = PREPARED_DIR, *, image_size: int | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        self.files = files_of(prepared)
        self.split = split
        self.folder = self.files.where(split)
        manifest = read_manifest(self.files)
        info = manifest.splits.get(split)
        if info is None or (not info.shards and info.count):
            raise StageError(f"{self.files.where(MANIFEST_FILE)} lists no shards of the {split} split: {RERUN}")
        self.image_size = manifest.image_size
        if image_size is not None and image_size != manifest.image_size:
            raise StageError(
                f"{self.folder}: images are {manifest.image_size} px, expected {image_size} px "
                "(rerun `pipeline prepare` with the model's data.image_size)"
            )
        s = self.image_size
        self.row_bytes = s * s * 3
        self.labels = self._small(f"{split}/{LABELS_FILE}", np.uint8, info.count)
        self.tracks = self._small(f"{split}/{TRACKS_FILE}", np.int32, info.count, missing_ok=True)
        self._shards = [self._open_shard(shard) for shard in info.shards]
        counts = [shard.count for shard in self._shards]
        if sum(counts) != info.count:
            raise StageError(f"{self.folder}: shards hold {sum(counts)} images, the manifest {info.count}: {RERUN}")
        self._starts = np.cumsum([0, *counts])

    def _small(self, name: str, dtype: type, count: int, missing_ok: bool = False) -> np.ndarray:
        where = self.files.where(name)
        try:
            array = np.load(io.BytesIO(self.files.read_bytes(name)), allow_pickle=False)
        except FileNotFoundError:
            if missing_ok:
                return np.full(count, -1, dtype)
            raise StageError(f"{where} not found: {RERUN}") from None
        except (OSError, ValueError, EOFError) as exc:
            raise StageError(
                f"{where} cannot be read ({type(exc).__name__}: {exc}); rerun `pipeline prepare`"
            ) from None
        if array.dtype != dtype or array.shape != (count,):
            raise StageError(
                f"{where}: {array.dtype} {list(array.shape)}, expected {np.dtype(dtype)} [{count}]; rerun `pipeline prepare`"
            )
        return array

    def _open_shard(self, shard: ShardInfo) -> _Shard:
        s = self.image_size
        where = self.files.where(shard.file)
        try:
            head = np.zeros(4096, dtype=np.uint8)
            got = self.files.read_into(shard.file, 0, head)
            f = io.BytesIO(head[:got].tobytes())
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
            size = self.files.size(shard.file)
        except FileNotFoundError:
            raise StageError(f"shard {where} is missing: {RERUN}") from None
        except (OSError, ValueError) as exc:
            raise StageError(f"shard {where} cannot be read ({type(exc).__name__}: {exc}); {RERUN}") from None
        if dtype != np.uint8 or fortran or shape != (shard.count, s, s, 3):
            raise StageError(
                f"shard {where}: images are {dtype} {list(shape)}, expected uint8 [{shard.count}, {s}, {s}, 3]; {RERUN}"
            )
        if size != offset + shard.count * self.row_bytes:
            raise StageError(
                f"shard {where} is {size} bytes, expected {offset + shard.count * self.row_bytes} (truncated?); {RERUN}"
            )
        return _Shard(shard.file, shard.count, offset, shard.sha256)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """uint8 [len(indices), S, S, 3]: the rows at `indices` (any order, repeats allowed), one read each."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"rows {idx.min()}..{idx.max()} of a {len(self)}-image split")
        s = self.image_size
        out = np.empty((len(idx), s, s, 3), dtype=np.uint8)
        flat = out.reshape(len(idx), self.row_bytes)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        for shard in np.unique(shard_of).tolist():  # one call a shard: a remote fetches its rows concurrently
            rows = np.flatnonzero(shard_of == shard)
            info = self._shards[shard]
            offsets = (info.offset + (idx[rows] - int(self._starts[shard])) * self.row_bytes).tolist()
            got = self.files.read_rows(info.name, offsets, [flat[r] for r in rows.tolist()])
            if min(got) != self.row_bytes:
                raise StageError(f"shard {self.files.where(info.name)} ended early; {RERUN}")
        return out

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop in order."""
        return self.take(np.arange(start, len(self) if stop is None else min(stop, len(self))))

    def verify(self) -> None:
        """Hash every shard (reading it in 8 MiB blocks) against the manifest: one line naming a changed one."""
        for shard in self._shards:
            digest = hashlib.sha256()
            block = np.empty(8 << 20, dtype=np.uint8)
            offset, end = shard.offset, shard.offset + shard.count * self.row_bytes
            while offset < end:
                got = self.files.read_into(shard.name, offset, block[: min(len(block), end - offset)])
                if got <= 0:
                    break
                digest.update(block[:got].data)
                offset += got
            if digest.hexdigest() != shard.sha256:
                raise StageError(
                    f"shard {self.files.where(shard.name)} does not match the manifest's SHA-256 (corrupt?); {RERUN}"
                )

    def close(self) -> None:
        self.files.close()


def read_split(
    split: str,
    prepared: Path | Files = PREPARED_DIR,
    *,
    image_size: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    head: int | None = None,
) -> SplitArrays:
    """One split's arrays in memory, checked (uint8 [N, S, S, 3], N labels; S = `image_size` when given). With
    `limit`, a seeded random subset of that many images (in their original order), read alone; with `head`, the
    first that many. For the small splits and subsets; the training loader streams the training split through
    SplitReader, evaluate, optimize and benchmark read theirs a batch at a time (ModelInput)."""
    reader = SplitReader(split, prepared, image_size=image_size)
    try:
        if head is not None and head < len(reader):
            return SplitArrays(reader.read(0, head), reader.labels[:head], reader.tracks[:head])
        if limit is not None and limit < len(reader):
            pick = np.sort(np.random.default_rng(seed).choice(len(reader), size=limit, replace=False))
            return SplitArrays(reader.take(pick), reader.labels[pick], reader.tracks[pick])
        reader.verify()
        return SplitArrays(reader.read(), reader.labels, reader.tracks)
    finally:
        reader.close()


@dataclass(frozen=True)
class OriginalFile:
    """A test image as a user sends it: the encoded file, whole (no ROI box), and its label."""

    path: Path
    label: int

    def read_bytes(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            raise StageError(f"{self.path} cannot be read ({exc}); rerun `pipeline prepare`") from None


def read_test_files(prepared: Path = PREPARED_DIR) -> list[OriginalFile]:
    """The test split's original files with their labels, in the test arrays' order; empty when the prepared
    data has none (made by an older prepare, or by a test's fake)."""
    manifest = read_manifest(prepared)
    if not manifest.test_files:
        return []
    labels = SplitReader("test", prepared).labels
    if len(labels) != len(manifest.test_files):
        raise StageError(
            f"{Path(prepared) / MANIFEST_FILE}: {len(manifest.test_files)} test files for {len(labels)} test images; rerun `pipeline prepare`"
        )
    return [
        OriginalFile(Path(prepared) / name, int(label)) for name, label in zip(manifest.test_files, labels, strict=True)
    ]


class ModelInput:
    """Images as every runtime's predict() takes them, one batch at a time: float32 [n, 3, S, S] in [0, 1] made
    from uint8 rows [N, S, S, 3] (a split's shards, or the original test files decoded once into a scratch file:
    pipeline/images/served_input.py), labels in memory. What evaluate, optimize and benchmark hold is one batch, not the
    split: 20,000 images at 224 px would be 12 GB as float32."""

    def __init__(self, rows: Callable[[int, int], np.ndarray], labels: np.ndarray) -> None:
        self._rows = rows  # (start, stop) -> uint8 [stop - start, S, S, 3]
        self.labels = np.asarray(labels, dtype=np.int64)

    @classmethod
    def of_split(
        cls, split: str, prepared: Path | Files = PREPARED_DIR, *, image_size: int | None = None
    ) -> ModelInput:
        """A prepared split, its shards checked against the manifest's SHA-256 first (as read_split does)."""
        reader = SplitReader(split, prepared, image_size=image_size)
        reader.verify()
        return cls(reader.read, reader.labels)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def head(self, count: int) -> np.ndarray:
        """The first `count` images (all of them when fewer)."""
        return to_model_input(self._rows(0, min(count, len(self))))

    def batches(self, size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), size):
            yield to_model_input(self._rows(start, min(start + size, len(self))))
