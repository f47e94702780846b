"""How fast training reads the prepared shards straight from your DVC remote: a batch's rows as concurrent ranged
GETs (what the loader does with `train.data_from: dvc-remote`) against one block-cached seek and read per row,
interleaved in one run.

    uv run python -m benchmarks remote-read [--repo .] [--split train] [--batches 8] [--rounds 3]

REPO is a DVC project whose data/prepared is pushed to its default remote (`dvc add data/prepared && dvc push`);
nothing needs to be pulled. Batches of 32 rows in a seeded shuffled order; both ways must give the same rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pipeline.artifacts import prepared

BATCH = 32
PER_ROW, CONCURRENT = "one read a row", "concurrent ranges"


def rates(repo: str, split: str, batches: int, rounds: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {PER_ROW: [], CONCURRENT: []}
    for _ in range(rounds):
        kept: np.ndarray | None = None
        for mode, rows_per_s in found.items():
            reader = prepared.SplitReader(split, prepared.DvcRemoteFiles(repo, ranged=mode == CONCURRENT))
            order = np.random.default_rng(0).permutation(len(reader))[: (batches + 1) * BATCH]
            reader.take(order[:BATCH])  # the shards opened and the remote resolved before the clock starts
            started, rows, got = time.perf_counter(), 0, []
            for b in range(1, batches + 1):
                got.append(reader.take(order[b * BATCH : (b + 1) * BATCH]))
                rows += len(got[-1])
            rows_per_s.append(rows / (time.perf_counter() - started))
            reader.close()
            pixels = np.concatenate(got)
            if kept is not None and not np.array_equal(kept, pixels):
                raise SystemExit("the two ways read different rows")
            kept = pixels
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks remote-read", description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=".", help="a DVC project with data/prepared on its default remote")
    ap.add_argument("--split", default="train", choices=prepared.SPLITS)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    manifest = prepared.read_manifest(prepared.DvcRemoteFiles(args.repo))
    size, shards = manifest.image_size, len(manifest.splits[args.split].shards)
    found = rates(args.repo, args.split, args.batches, args.rounds)
    print(f"{args.split}: {size} px rows in {shards} shards, batches of {BATCH} in a shuffled order")
    for mode, rows_per_s in found.items():
        print(f"{mode:>18}: {', '.join(f'{r:.0f}' for r in rows_per_s)} rows/s")
    print(f"{'ratio (best)':>18}: {max(found[CONCURRENT]) / max(found[PER_ROW]):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
