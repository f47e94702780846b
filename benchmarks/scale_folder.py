"""Make a large folder data set of photo-sized JPEGs from GTSRB, to measure prepare and training at scale.

    uv run python -m benchmarks scale-folder --gtsrb "$GTSRB_ROOT" --out /data/scale --images 100000 --size 224

Writes OUT/<class>/<n>.jpg (`data.source: folder`): every image is a GTSRB training image, cropped around its
sign with a random margin, rotated a little, colour-jittered, resized to SIZE x SIZE (bicubic) and saved as
JPEG q90, so no two files are the same bytes and each class keeps GTSRB's share. Made in worker processes on
every core; the folder is never committed (put it outside the project, or under data/, which git ignores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

from pipeline.data.gtsrb import list_split


def _make(job: tuple[int, str, int, tuple[int, int, int, int] | None, int, str, int]) -> int:
    n, source, label, box, size, out, seed = job
    rng = np.random.default_rng(seed + n)
    with Image.open(source) as opened:
        image: Image.Image = opened.convert("RGB")
        w, h = image.size
        x1, y1, x2, y2 = box or (0, 0, w - 1, h - 1)
        margin = rng.uniform(0.05, 0.3)
        bw, bh = x2 - x1 + 1, y2 - y1 + 1
        crop = (
            max(0, int(x1 - margin * bw)),
            max(0, int(y1 - margin * bh)),
            min(w, int(x2 + 1 + margin * bw)),
            min(h, int(y2 + 1 + margin * bh)),
        )
        image = image.crop(crop).rotate(float(rng.uniform(-8, 8)), Image.Resampling.BILINEAR)
        image = image.resize((size, size), Image.Resampling.BICUBIC)
        image = ImageEnhance.Brightness(image).enhance(float(rng.uniform(0.7, 1.3)))
        image = ImageEnhance.Contrast(image).enhance(float(rng.uniform(0.8, 1.2)))
        folder = Path(out) / f"{label:02d}"
        image.save(folder / f"{n:06d}.jpg", quality=90)
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gtsrb", type=Path, required=True, help="GTSRB in torchvision's layout ($GTSRB_ROOT)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--images", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    files = list_split(args.gtsrb, "train")
    if not files:
        sys.exit(f"no GTSRB training images under {args.gtsrb}")
    for label in sorted({f.label for f in files}):
        (args.out / f"{label:02d}").mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(args.seed).integers(0, len(files), args.images)
    jobs = (
        (n, str(files[i].path), files[i].label, files[i].box, args.size, str(args.out), args.seed)
        for n, i in enumerate(order.tolist())
    )
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done, _ in enumerate(pool.map(_make, jobs, chunksize=256), start=1):
            if done % 10_000 == 0:
                print(f"{done:,} images, {time.perf_counter() - start:.0f} s", flush=True)
    size = sum(p.stat().st_size for p in args.out.rglob("*.jpg"))
    print(
        f"{args.images:,} JPEGs at {args.size} px from {len(files):,} GTSRB images: {size / 2**30:.2f} GiB in {args.out}"
    )


if __name__ == "__main__":
    main()
