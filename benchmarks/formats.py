"""The prepared shards against the streaming formats we could have used, side by side in one run.

    uv run --with litdata==0.2.76 --with mosaicml-streaming==0.13.0 --with webdataset==1.0.2 \\
        python -m benchmarks formats data/prepared --rows 8000 [--rounds 2] [--workdir /tmp/formats]

Copies the first `--rows` images of the prepared training split (uint8 rows, labels) into LitData chunks, MosaicML
Streaming's MDS shards and WebDataset tars (64 MB each, no compression: what `data.shard_mb` writes), then reads one
epoch of each in shuffled order, batch 32, in the reading process (no loader workers: the cost an image on one core;
each library's own dataset class, batched alike for all), every reader in a fresh process, the formats interleaved
over `--rounds`: seconds to the first batch, images per second after it and their ratio to the `.npy` shards, and
the reader's peak RSS (VmHWM). Every reader must hand out each image exactly once, with its label and its pixels,
or the run fails. The three libraries are not the project's dependencies: the command above brings them for the
run only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.artifacts.prepared import SplitReader
from pipeline.machine import own_peak_rss_mib

FORMATS = ("npy", "litdata", "mds", "webdataset")
NEEDS = {"litdata": "litdata", "mds": "streaming", "webdataset": "webdataset"}
SHARD_BYTES = 64 << 20
BATCH = 32


def _rows(prepared: Path, count: int) -> Iterator[tuple[int, np.ndarray, int]]:
    reader = SplitReader("train", prepared)
    try:
        count = min(count, len(reader))
        for start in range(0, count, 512):
            images = reader.read(start, min(start + 512, count))
            for k, image in enumerate(images):
                yield start + k, image, int(reader.labels[start + k])
    finally:
        reader.close()


def write(fmt: str, prepared: Path, rows: int, out: Path) -> None:
    """`rows` training images in `fmt` under `out` (the `.npy` shards are read in place)."""
    out.mkdir(parents=True)
    if fmt == "litdata":
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(str(out), chunk_bytes=SHARD_BYTES)
        for i, image, label in _rows(prepared, rows):
            writer.add_item(i, {"index": i, "image": image, "label": label})
        writer.done()
        writer.merge()
    elif fmt == "mds":
        from streaming import MDSWriter

        columns = {"index": "int", "image": "ndarray:uint8", "label": "int"}
        with MDSWriter(out=str(out), columns=columns, size_limit=SHARD_BYTES) as writer:
            for i, image, label in _rows(prepared, rows):
                writer.write({"index": i, "image": image, "label": label})
    elif fmt == "webdataset":
        import webdataset as wds

        with wds.ShardWriter(str(out / "shard-%05d.tar"), maxsize=SHARD_BYTES, verbose=0) as writer:
            for i, image, label in _rows(prepared, rows):
                writer.write({"__key__": f"{i:08d}", "npy": image, "cls": label, "idx.cls": i})


def _batches(fmt: str, prepared: Path, rows: int, where: Path) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(indices, images uint8 [b, S, S, 3], labels) in the format's own shuffled order."""
    if fmt == "npy":  # what pipeline/data/loader.py does: one global permutation, a batch read by row
        reader = SplitReader("train", prepared)
        perm = np.random.default_rng(0).permutation(min(rows, len(reader)))
        for start in range(0, len(perm), BATCH):
            idx = perm[start : start + BATCH]
            yield idx, reader.take(idx), reader.labels[idx]
    elif fmt == "litdata":  # batch_decode off: its decode window wastes work on shuffled reads (3.9 vs 0.07 ms)
        from litdata import StreamingDataset

        yield from _grouped(StreamingDataset(str(where), shuffle=True, seed=0, batch_decode=False))
    elif fmt == "mds":
        from streaming import StreamingDataset

        yield from _grouped(StreamingDataset(local=str(where), shuffle=True, shuffle_seed=0, batch_size=BATCH))
    elif fmt == "webdataset":  # shards shuffled, then a 1,000-sample buffer: the library's documented recipe
        import webdataset as wds

        urls = [str(p) for p in sorted(where.glob("shard-*.tar"))]
        data = (
            wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False)
            .shuffle(1000, rng=random.Random(0))
            .decode()
            .to_tuple("idx.cls", "npy", "cls")
            .batched(BATCH, partial=True)
        )
        for idx, images, labels in data:
            yield np.asarray(idx), np.asarray(images), np.asarray(labels)


def _grouped(samples: Iterable[dict]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A library's samples in batches, collated the same way for every format (its own loader left out)."""
    batch: list[dict] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == BATCH:
            yield _collate(batch)
            batch = []
    if batch:
        yield _collate(batch)


def _collate(batch: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array([s["index"] for s in batch]),
        np.stack([s["image"] for s in batch]),
        np.array([s["label"] for s in batch]),
    )


def read_epoch(fmt: str, prepared: Path, rows: int, where: Path) -> dict[str, float]:
    """One epoch: images/s, and a check that every image came once, with its label and its pixels."""
    reader = SplitReader("train", prepared)
    expected = reader.labels[: min(rows, len(reader))]
    seen = np.zeros(len(expected), dtype=np.int64)
    probe = {0, len(expected) // 2, len(expected) - 1}
    if fmt in NEEDS:  # the library's import (torch for two of them) is not the format's cost
        importlib.import_module(NEEDS[fmt])
    started = time.perf_counter()
    first: tuple[float, int] | None = None
    for idx, images, labels in _batches(fmt, prepared, rows, where):
        idx = np.asarray(idx, dtype=np.int64)
        if first is None:  # opening, indexing and the first batch apart: the rate is the stream's
            first = (time.perf_counter(), len(idx))
        np.add.at(seen, idx, 1)
        if not np.array_equal(np.asarray(labels, dtype=np.int64), expected[idx].astype(np.int64)):
            raise SystemExit(f"{fmt}: labels do not match the rows they came with")
        for k in probe.intersection(idx.tolist()):
            if not np.array_equal(images[int(np.flatnonzero(idx == k)[0])], reader.take([k])[0]):
                raise SystemExit(f"{fmt}: row {k}'s pixels differ from the prepared shard")
    ended = time.perf_counter()
    if first is None or not (seen == 1).all():
        raise SystemExit(f"{fmt}: {int((seen == 0).sum())} images never came, {int((seen > 1).sum())} came twice")
    return {
        "first_batch_s": first[0] - started,
        "images_per_s": (len(expected) - first[1]) / (ended - first[0]),
        "peak_rss_mib": own_peak_rss_mib(),
    }


def _measure(fmt: str, args: argparse.Namespace, where: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.formats", "--read", fmt, str(args.prepared)]
    command += ["--rows", str(args.rows), "--workdir", str(where)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"reading {fmt} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class Figures:
    write_s: float
    mb: float  # the copy on disk (0 for the .npy shards, read in place)
    rates: list[float] = field(default_factory=list)  # images/s after the first batch, one a round
    rss: list[float] = field(default_factory=list)  # the reader's peak RSS, MiB
    first: list[float] = field(default_factory=list)  # seconds to the first batch


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks formats", description=__doc__.splitlines()[0])
    ap.add_argument("prepared", type=Path, help="a prepared folder (data/prepared)")
    ap.add_argument("--rows", type=int, default=8000, help="images of the training split to copy and read")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--workdir", type=Path, default=None, help="where the copies go (default: a temporary folder)")
    ap.add_argument("--read", choices=FORMATS, default=None, help=argparse.SUPPRESS)  # one reader, in a child
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.read:
        print(json.dumps(read_epoch(args.read, args.prepared, args.rows, args.workdir)))
        return 0
    missing = [NEEDS[f] for f in args.formats if f in NEEDS and _absent(NEEDS[f])]
    if missing:
        print(f"not installed: {', '.join(missing)}; run through `uv run --with ...` as this tool's --help shows")
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="formats-"))
    figures: dict[str, Figures] = {}
    try:
        for fmt in args.formats:
            where = work / fmt
            shutil.rmtree(where, ignore_errors=True)
            started = time.perf_counter()
            if fmt != "npy":
                write(fmt, args.prepared, args.rows, where)
            figures[fmt] = Figures(time.perf_counter() - started, _du(where) / 1e6 if fmt != "npy" else 0.0)
        for _ in range(args.rounds):
            for fmt in args.formats:
                got = _measure(fmt, args, work / fmt)
                figures[fmt].rates.append(got["images_per_s"])
                figures[fmt].rss.append(got["peak_rss_mib"])
                figures[fmt].first.append(got["first_batch_s"])
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    base = max(figures["npy"].rates) if "npy" in figures else 0.0
    print(f"{args.rows} images, shuffled, batch {BATCH}, one process, best of {args.rounds} rounds")
    print(f"{'format':<12}{'write s':>9}{'MB':>9}{'1st batch s':>13}{'img/s':>9}{'x npy':>8}{'peak RSS MiB':>14}")
    for fmt, f in figures.items():
        best = max(f.rates)
        ratio = f"{best / base:.2f}" if base else "-"
        mb = f"{f.mb:.0f}" if f.mb else ""
        print(f"{fmt:<12}{f.write_s:>9.1f}{mb:>9}{min(f.first):>13.2f}{best:>9.0f}{ratio:>8}{max(f.rss):>14.0f}")
    if args.json:
        args.json.write_text(json.dumps({fmt: asdict(f) for fmt, f in figures.items()}, indent=2) + "\n")
    return 0


def _absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    sys.exit(main())
