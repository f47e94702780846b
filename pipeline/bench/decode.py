"""What the server's image decode costs per image: libspng against PIL for PNG, side by side in one run.

    uv run pipeline bench decode data/prepared/test_files --size 32 [--repeats 7]

Each file (any format PIL reads) is re-encoded as PNG in memory, as `pipeline monitor` and the benchmark clients send
it; the server's own path (`serve.protocol.decode_images`: header check, decode, framing into the model's input)
runs over all of them with libspng and with PIL, interleaved, best of `--repeats`. Prints microseconds per image for
each and their ratio, and checks that both gave the same tensor, byte for byte.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline import preprocess
from pipeline.serve.protocol import decode_images


def _time(bodies: list[bytes], framing: preprocess.Framing) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    out = decode_images([(body, None) for body in bodies], framing, preprocess.MAX_PIXELS)
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipeline bench decode", description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="image files (e.g. data/prepared/test_files)")
    ap.add_argument("--size", type=int, default=32, help="the model's input side (data.image_size)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--limit", type=int, default=2000, help="at most this many files")
    args = ap.parse_args(argv)
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
