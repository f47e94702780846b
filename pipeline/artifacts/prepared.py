"""data/prepared/: the prepare stage's output, read by train, evaluate, optimize, benchmark, deploy and monitor.

    data/prepared/{train,val,test}/images-NNNNN.npy  image shards: uint8 [n, S, S, 3] RGB, at most data.shard_mb each
    data/prepared/{train,val,test}/labels.npy        uint8 [N]; tracks.npy: int32 [N] (class * 100_000 + group, -1)
    data/prepared/manifest.json          PreparedManifest: image size, classes, mean/std, each split's shards with
                                         their counts and SHA-256, the content hash
    data/prepared/test_files/            the test split's original image files, byte for byte, in the arrays'
                                         order: what a user sends the server (whole images, no box)

Why `.npy` shards read by offset (and not WebDataset, LitData or MDS): the training loader's guarantees (one
global permutation per epoch, resume at the same sample with another process count) need any sample by its
index; a row of a shard is at a fixed offset, so a batch is one `pread` per image, straight into the batch
buffer. Nothing is memory-mapped, so a process holds only its batches, whatever the data's size (a mapped file
counts in RSS as it is touched). WebDataset's tar streams are sequential (a shuffle buffer, no global order);
LitData and MDS index samples too, but add their own chunk format, cache and workers to what numpy reads.

The writer streams: shards are written as they are filled, the content hash and per-channel sums are updated as
they go, the folder is staged and swapped in whole, so readers never see half of it. numpy and pydantic only:
the server image and `pipeline monitor` read it without torch.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import DATA_DIR
from pipeline.artifacts._files import read_model, write_model
from pipeline.errors import StageError
from pipeline.images.preprocess import NO_CROP, Framing, Interpolation, Resize

PREPARED_DIR = DATA_DIR / "prepared"
MANIFEST_FILE = "manifest.json"
TEST_FILES = "test_files"
SPLITS = ("train", "val", "test")
LABELS_FILE = "labels.npy"
TRACKS_FILE = "tracks.npy"
RERUN = "run `pipeline prepare` first (or `dvc pull`)"
SHARD_MB = 64


@dataclass
class SplitArrays:
    images: np.ndarray  # uint8 [N, S, S, 3]
    labels: np.ndarray  # uint8 [N]
    tracks: np.ndarray  # int32 [N]: class * 100_000 + track, -1 for test

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def model_input(self) -> np.ndarray:
        """float32 [N, 3, S, S] in [0, 1]: what every runtime's predict() takes."""
        return to_model_input(self.images)


def to_model_input(images: np.ndarray) -> np.ndarray:
    """uint8 [N, S, S, 3] -> float32 [N, 3, S, S] in [0, 1] (the server's own conversion, value for value)."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255)


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


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardInfo(_Record):
    file: str
    """Path under data/prepared/ (SPLIT/images-NNNNN.npy)."""
    count: int
    sha256: str
    """Of the shard's pixel bytes (not the .npy header)."""


class DataSubject(_Record):
    """What a data set's images show, in the model card's words: a built-in source says; a folder of yours is
    described by its classes."""

    one: str
    """What one image shows (the card: "Classify a photo of one ...")."""
    groups: str = "groups"
    """What the groups split off whole for validation are called."""
    group_is: str = "objects"
    """What one group is."""
    untested: str | None = None
    """Conditions the data does not cover, for the card's limits."""


class SplitInfo(_Record):
    file: str
    """The split's folder under data/prepared/."""
    count: int
    per_class: list[int]
    tracks: int | None
    """Groups (photos of one object, kept together) in the split; None for the test split."""
    shards: list[ShardInfo] = []


class BadImages(_Record):
    count: int
    of: int
    files: list[str]


class PreparedManifest(_Record):
    dataset: str
    layout: str
    image_size: int
    roi_margin: float
    num_classes: int
    classes: list[str]
    mean: list[float]
    """Per-channel mean of the training split's pixels / 255 (used by `model.input_norm: dataset`)."""
    std: list[float]
    splits: dict[str, SplitInfo]
    bad_images: BadImages
    content_sha256: str
    """SHA-256 of every split's images and labels: what a checkpoint or a model was made from."""
    test_files: list[str] = []
    """The test split's original files under data/prepared/ (test_files/NAME), one per test image, in order."""
    image_size_reason: str = ""
    """Why `image_size` differs from data.image_size, when the time budget chose it (data.min_image_size); empty
    when it is data.image_size as written."""
    boxes: bool = True
    """Whether the test files carry object boxes. Without them the test arrays (the ROI protocol) are the served
    input itself, so evaluate and optimize score them once."""
    framing: Literal["served", "roi"] = "roi"
    """How train and val were made: `served` = whole files less `crop` (what the server is sent), `roi` = the
    sign's box + roi_margin. The test arrays are always the ROI protocol (how papers report the demo data); the served
    test input is test_files/ through `served_framing()`."""
    crop: tuple[float, float, float, float] = NO_CROP
    """What the served input cuts off a whole image (left, top, right, bottom fractions); see preprocess.Framing."""
    resize_mode: Resize = "stretch"
    """How the image becomes a square (data.resize): stretch | center_crop | pad."""
    interpolation: Interpolation = "bilinear"
    """The resize's filter (data.interpolation, `auto` resolved from model.name's pretrained weights)."""
    reduced_jpeg_decode: bool = False
    """Large JPEGs decoded at a fraction of their size (data.reduced_jpeg_decode)."""
    subject: DataSubject | None = None
    """What the images show, when the source says (the model card's intended use and limits)."""

    def served_framing(self) -> Framing:
        """How the server turns a file into this data's model input (optimize copies it into models/manifest)."""
        return Framing(
            self.image_size, self.roi_margin, self.crop, self.resize_mode, self.interpolation, self.reduced_jpeg_decode
        )


def content_sha256(arrays: dict[str, SplitArrays]) -> str:
    """The hash the writer computes as it streams: each split's image bytes, then its labels, in SPLITS order."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for array in (arrays[split].images, arrays[split].labels):
            digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


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
    summed as vectors (a float64 copy of every pixel would cost 24 bytes each; numpy's strided sum over the
    channel axis is 10x slower), in blocks of `rows` so the uint32 squares stay small."""
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
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFiles:
    """data/prepared/ on this machine's disk: rows read with `pread` into the caller's buffer."""

    def __init__(self, root: Path = PREPARED_DIR) -> None:
        self.root = Path(root)
        self._fds: dict[str, int] = {}

    def where(self, name: str) -> str:
        return str(self.root / name)

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.root / name, os.O_RDONLY)
        return os.preadv(fd, [buffer.data], offset)

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        """buffers[k] from offsets[k] (the caller's uint8 rows): one pread each; the bytes each read got."""
        return _row_by_row(self, name, offsets, buffers)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, object]:  # file descriptors do not travel to another process
        return {**self.__dict__, "_fds": {}}


class DvcRemoteFiles:
    """data/prepared/ as a DVC repository's dvc.lock records it, read through DVC's own filesystem (dvc.api):
    from the local cache when it has the files, else straight from the DVC remote (S3, GCS, Azure, SSH, ...) by
    ranged reads, with no `dvc pull` and no shared disk: how processes on several machines read one data set."""

    def __init__(
        self, repo: str = ".", rev: str | None = None, path: str = str(PREPARED_DIR), *, ranged: bool = True
    ) -> None:
        """`ranged=False` reads row by row even where concurrent ranges work (`python -m benchmarks remote-read`)."""
        from dvc.api import DVCFileSystem

        self.repo, self.rev, self.path, self.ranged = repo, rev, path.rstrip("/"), ranged
        self.fs = DVCFileSystem(repo, rev=rev)
        self._files: dict[str, Any] = {}
        self._remote: Any = None  # the default remote's fsspec filesystem, once a batch needs it
        self._urls: dict[str, str] = {}

    def where(self, name: str) -> str:
        return f"{self.path}/{name} (DVC remote of {self.repo}{'@' + self.rev if self.rev else ''})"

    def read_bytes(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(f"{self.path}/{name}")
        return data

    def _open(self, name: str) -> Any:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.fs.open(f"{self.path}/{name}", "rb")
        return f

    def size(self, name: str) -> int:
        f = self._open(name)  # the remote's object size (a directory's listing may not record it)
        return int(f.size) if hasattr(f, "size") else int(f.seek(0, os.SEEK_END))  # a file of the workspace

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        f = self._open(name)
        f.seek(offset)
        data = f.read(buffer.nbytes)
        buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        """A batch's rows of one shard as concurrent ranged GETs of exactly their bytes (fsspec's `cat_ranges`
        on the remote's own filesystem: s3fs, gcsfs, adlfs), not one block-cached seek and read after another;
        at 224 px on SeaweedFS's S3 that is 9x the rows a second. Falls back to `read_into` where the remote's
        filesystem cannot (a local or SSH remote, no remote configured) and where this machine's DVC cache holds
        the shard."""
        remote = self._remote_of(name)
        if remote is None:
            return _row_by_row(self, name, offsets, buffers)
        fs, url = remote
        ends = [offset + row.nbytes for offset, row in zip(offsets, buffers, strict=True)]
        parts = fs.cat_ranges([url] * len(offsets), list(offsets), ends, on_error="return")
        got = []
        for part, row in zip(parts, buffers, strict=True):
            if isinstance(part, BaseException):
                raise StageError(f"shard {self.where(name)} cannot be read from {url} ({type(part).__name__}: {part})")
            row[: len(part)] = np.frombuffer(part, dtype=np.uint8)
            got.append(len(part))
        return got

    def _remote_of(self, name: str) -> tuple[Any, str] | None:
        if not self.ranged:
            return None
        if name in self._urls:
            return (self._remote, self._urls[name]) if self._urls[name] else None
        url = ""
        try:
            import dvc.api
            from dvc.repo import Repo

            with Repo(self.repo) as repo:
                if self._remote is None:
                    self._remote = repo.cloud.get_remote().fs.fs  # the fsspec instance, with the remote's config
                if hasattr(self._remote, "cat_ranges") and getattr(self._remote, "async_impl", False):
                    url = dvc.api.get_url(f"{self.path}/{name}", repo=self.repo, rev=self.rev)
                    oid = "".join(url.rsplit("/", 2)[-2:])  # .../files/md5/ab/cdef...: the object's md5
                    if repo.cache.local.exists(oid):  # pulled into this machine's cache: read it there
                        url = ""
        except Exception:  # no default remote, or one fsspec cannot range-read concurrently: read row by row
            url = ""
        self._urls[name] = url
        return (self._remote, url) if url else None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_files": {}, "_remote": None, "_urls": {}}


Files = LocalFiles | DvcRemoteFiles


def _row_by_row(files: Files, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
    """buffers[k] from offsets[k], one `read_into` each: the bytes each read got."""
    return [files.read_into(name, offset, row) for offset, row in zip(offsets, buffers, strict=True)]


def files_of(prepared: Path | Files) -> Files:
    return prepared if isinstance(prepared, LocalFiles | DvcRemoteFiles) else LocalFiles(Path(prepared))


def read_manifest(prepared: Path | Files = PREPARED_DIR) -> PreparedManifest:
    if isinstance(prepared, DvcRemoteFiles):
        try:
            return PreparedManifest.model_validate_json(prepared.read_bytes(MANIFEST_FILE))
        except Exception as exc:  # any fsspec backend's error, or a foreign file
            raise StageError(f"{prepared.where(MANIFEST_FILE)} cannot be read ({type(exc).__name__}: {exc})") from None
    root = prepared.root if isinstance(prepared, LocalFiles) else Path(prepared)
    return read_model(root / MANIFEST_FILE, PreparedManifest, RERUN)


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
    are on this disk (a path) or read straight from the DVC remote (DvcRemoteFiles)."""

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
