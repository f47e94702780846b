"""`python -m benchmarks served-folder URL FOLDER`: a running server's accuracy on a labelled folder of image files
(`FOLDER/<class>/<files>`), each file sent whole, one per request, to `/v1/predict` with httpx (what a user's client
does), compared by class name; the accuracy with its 95 % interval, per class, as JSON.

Reporting only: a held-back folder no stage read. Choose recipes on the validation split, never on it.
"""

from __future__ import annotations

import argparse
import json
import math
import mimetypes
from pathlib import Path


def interval(correct: int, n: int, z: float = 1.96) -> list[float]:
    """Wilson's 95 % interval of a proportion."""
    if n == 0:
        return [0.0, 1.0]
    p = correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [round((centre - half) / (1 + z * z / n), 4), round((centre + half) / (1 + z * z / n), 4)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks served-folder", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("folder", type=Path, help="<class>/<files>: the class names the server answers")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    import httpx

    per_class: dict[str, list[int]] = {}
    with httpx.Client(base_url=args.url, timeout=60) as client:
        for folder in sorted(p for p in args.folder.iterdir() if p.is_dir()):
            hits = per_class.setdefault(folder.name, [0, 0])
            for path in sorted(p for p in folder.iterdir() if p.is_file()):
                kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                answer = client.post("/v1/predict", files={"files": (path.name, path.read_bytes(), kind)})
                answer.raise_for_status()
                hits[0] += answer.json()["predictions"][0]["top_k"][0]["name"] == folder.name
                hits[1] += 1
    correct, total = sum(h[0] for h in per_class.values()), sum(h[1] for h in per_class.values())
    result = {
        "files": total,
        "correct": correct,
        "accuracy": round(correct / max(total, 1), 4),
        "accuracy_ci95": interval(correct, total),
        "per_class": {name: round(h[0] / max(h[1], 1), 4) for name, h in per_class.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
