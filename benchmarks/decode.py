"""What the server's image decode costs per image, two decoders side by side in one run.

    uv run python -m benchmarks decode data/prepared/test_files --size 32 [--repeats 7]
    uv run python -m benchmarks decode data/prepared/test_files --size 224 --format jpeg [--upscale 8] [--resize pad]

PNG (the default): each file (any format PIL reads) is re-encoded as PNG in memory, as `pipeline monitor` and the
benchmark clients send it; libspng against PIL, which must give the same tensor byte for byte. JPEG: each file's own
bytes when it is a JPEG (else re-encoded at quality 95; with --upscale F, enlarged F times first, as a phone's
photo), a full decode against data.reduced_jpeg_decode (1/2, 1/4 or 1/8 of the size); prints how far their pixels
are apart. Either way the server's own path (`serve.protocol.decode_images`: header check, decode, framing into the
model's input) runs over all of them, interleaved, best of `--repeats`: microseconds per image and their ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.images import preprocess
from pipeline.serve.protocol import decode_images


def _time(bodies: list[bytes], framing: preprocess.Framing) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    out = decode_images([(body, None) for body in bodies], framing, preprocess.MAX_PIXELS)
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks decode", description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="image files (e.g. data/prepared/test_files)")
    ap.add_argument("--size", type=int, default=32, help="the model's input side (data.image_size)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--limit", type=int, default=2000, help="at most this many files")
    ap.add_argument("--format", choices=["png", "jpeg"], default="png")
    ap.add_argument("--upscale", type=float, default=1.0, help="jpeg: enlarge each image this many times first")
    ap.add_argument("--resize", choices=list(preprocess.RESIZE_MODES), default="stretch", help="data.resize")
    args = ap.parse_args(argv)
    if args.format == "jpeg":
        return _jpeg(args)
    if preprocess.pyspng is None:
        print("pyspng is not installed: nothing to compare")
        return 2
    bodies = []
    for path in sorted(p for p in args.folder.iterdir() if p.is_file())[: args.limit]:
        out = io.BytesIO()
        Image.open(path).convert("RGB").save(out, "PNG")
        bodies.append(out.getvalue())
    if not bodies:
        print(f"no files in {args.folder}")
        return 2
    framing = preprocess.Framing(args.size)
    spng = preprocess.pyspng
    best = {"libspng": float("inf"), "pil": float("inf")}
    outputs: dict[str, np.ndarray] = {}
    try:
        for _ in range(args.repeats):
            for name in best:
                preprocess.pyspng = spng if name == "libspng" else None
                seconds, outputs[name] = _time(bodies, framing)
                best[name] = min(best[name], seconds)
    finally:
        preprocess.pyspng = spng
    report = {
        "images": len(bodies),
        "size": args.size,
        "us_per_image": {name: round(s / len(bodies) * 1e6, 1) for name, s in best.items()},
        "pil_over_libspng": round(best["pil"] / best["libspng"], 2),
        "identical": bool(np.array_equal(outputs["libspng"], outputs["pil"])),
    }
    print(json.dumps(report))
    return 0 if report["identical"] else 1


def _jpeg(args: argparse.Namespace) -> int:
    bodies = []
    for path in sorted(p for p in args.folder.iterdir() if p.is_file())[: args.limit]:
        with Image.open(path) as image:
            if image.format == "JPEG" and args.upscale == 1.0:
                bodies.append(path.read_bytes())
                continue
            rgb = image.convert("RGB")
            if args.upscale != 1.0:
                size = (round(rgb.width * args.upscale), round(rgb.height * args.upscale))
                rgb = rgb.resize(size, Image.Resampling.BICUBIC)
            out = io.BytesIO()
            rgb.save(out, "JPEG", quality=95)
            bodies.append(out.getvalue())
    if not bodies:
        print(f"no files in {args.folder}")
        return 2
    framings = {
        "full": preprocess.Framing(args.size, resize=args.resize),
        "reduced": preprocess.Framing(args.size, resize=args.resize, reduced_jpeg_decode=True),
    }
    best = {name: float("inf") for name in framings}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, framing in framings.items():
            seconds, outputs[name] = _time(bodies, framing)
            best[name] = min(best[name], seconds)
    with Image.open(io.BytesIO(bodies[0])) as first:
        example = f"{first.width}x{first.height}"
    difference = np.abs(outputs["full"] - outputs["reduced"]) * 255
    report = {
        "images": len(bodies),
        "first_image": example,
        "size": args.size,
        "resize": args.resize,
        "us_per_image": {name: round(s / len(bodies) * 1e6, 1) for name, s in best.items()},
        "full_over_reduced": round(best["full"] / best["reduced"], 2),
        "mean_abs_difference_levels": round(float(difference.mean()), 3),
    }
    print(json.dumps(report))
    return 0
