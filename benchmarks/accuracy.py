"""`python -m benchmarks accuracy`: the trained model's accuracy on a labelled set of image files, as served (each
whole file through the server's own decode and framing) and as ROI crops (the sign's box + roi_margin, how
papers report GTSRB), with 95 % intervals.

For held-out sets that are not the prepared test split, such as GTSRB's full official test set:
`--csv` names the labels: GTSRB's `GT-final_test.csv` (`;`, Filename) or the Kaggle layout's `Test.csv`
(`,`, Path), with columns ClassId and optionally Roi.X1..Roi.Y2; `--images` is the folder of the files;
`--exclude` a folder whose file stems are left out (e.g. the shared sample, to report on the rest).
Reporting only: choose recipes on the validation split, never on a test set.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

from pipeline.errors import StageError


def read_labels(csv_path: Path, images: Path, exclude: set[str]) -> list[tuple[Path, int, tuple[int, ...] | None]]:
    text = csv_path.read_text()
    delimiter = ";" if text.splitlines()[0].count(";") > text.splitlines()[0].count(",") else ","
    rows = []
    for row in csv.DictReader(text.splitlines(), delimiter=delimiter):
        name = Path(row.get("Path") or row.get("Filename") or "").name
        if not name or Path(name).stem in exclude:
            continue
        try:
            box = tuple(int(row[k]) for k in ("Roi.X1", "Roi.Y1", "Roi.X2", "Roi.Y2"))
        except (KeyError, TypeError, ValueError):
            box = None
        rows.append((images / name, int(row["ClassId"]), box))
    if not rows:
        raise StageError(f"{csv_path}: no labelled rows (columns ClassId and Path or Filename)")
    return rows


def interval(correct: int, n: int) -> list[float]:
    p = correct / n
    half = 1.96 * math.sqrt(p * (1 - p) / n)
    return [round(p - half, 4), round(p + half, 4)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--exclude", type=Path, help="leave out files whose stem is a file stem in this folder")
    parser.add_argument(
        "--variant", help="a shipped variant of models/manifest.json (e.g. int8-onnx) instead of the trained model"
    )
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args(argv)

    import torch

    from pipeline.artifacts import model as model_file
    from pipeline.artifacts.prepared import read_manifest
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.serve.protocol import decode_images

    exclude = {p.stem for p in args.exclude.iterdir()} if args.exclude else set()
    rows = read_labels(args.csv, args.images, exclude)
    labels = np.array([label for _, label, _ in rows])
    framing = read_manifest().served_framing()
    if args.variant:  # what the server runs: the same runtime interface
        from pipeline.artifacts import MODELS_DIR
        from pipeline.runtimes import open_runtime

        runtime = open_runtime(MODELS_DIR, args.variant)

        def predict(batch: np.ndarray) -> np.ndarray:
            return np.asarray(runtime.predict(batch)).argmax(1)

    else:
        model, _ = model_file.read()
        model.eval()

        def predict(batch: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return model(torch.from_numpy(batch)).argmax(1).numpy()

    served, roi = [], []
    for start in range(0, len(rows), args.batch):
        chunk = rows[start : start + args.batch]
        files = [path.read_bytes() for path, _, _ in chunk]
        served.append(predict(decode_images([(f, None) for f in files], framing, MAX_PIXELS)))
        if all(box is not None for _, _, box in chunk):
            boxed = [(f, box) for f, (_, _, box) in zip(files, chunk, strict=True)]
            roi.append(predict(decode_images(boxed, framing, MAX_PIXELS)))  # type: ignore[arg-type]
    report: dict[str, object] = {
        "model": args.variant or "models/model.pt",
        "images": len(rows),
        "framing_crop": list(framing.crop),
    }
    for name, parts in (("served", served), ("roi", roi)):
        if len(parts) == len(served):
            predicted = np.concatenate(parts)
            correct = int((predicted == labels).sum())
            report[name] = {
                "accuracy": round(correct / len(rows), 4),
                "errors": len(rows) - correct,
                "ci95": interval(correct, len(rows)),
            }
    if "roi" in report:
        gap = report["roi"]["accuracy"] - report["served"]["accuracy"]  # type: ignore[index]
        report["whole_vs_roi_gap_points"] = round(100 * gap, 2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
