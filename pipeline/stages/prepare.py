"""The prepare stage: GTSRB images -> compact uint8 arrays for train / val / test plus a manifest.

    data.root (or $GTSRB_ROOT) --torchvision GTSRB + official CSVs--> split train/val by track, stratified by class
        --> the served framing (data.crop: auto = derived from the training split's sign boxes)
        --> train, val: each file as the server frames it (data.framing: served), or the sign's box + margin (roi)
        --> test: the sign's box + margin (the ROI protocol), and its original files kept for the served figure
        --> data/prepared/{train,val,test}.npz, data/prepared/manifest.json (artifacts.prepared)
        --> reports/prepare/metrics.json, reports/prepare/class_distribution.csv

Unreadable images are counted and listed, never fatal unless more than data.max_bad_fraction are bad.
Outputs are written to a temporary folder and swapped in at the end: a failed run leaves the previous
outputs as they were, and nothing outside the outputs is touched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pipeline.artifacts import REPORTS_DIR, prepared
from pipeline.artifacts.prepared import (
    PREPARED_DIR,
    SPLITS,
    BadImages,
    PreparedManifest,
    SplitArrays,
    SplitInfo,
    content_sha256,
)
from pipeline.config import DataConfig, Params
from pipeline.console import log, progress
from pipeline.data.gtsrb import CLASS_NAMES, NUM_CLASSES, SignFile, list_split
from pipeline.errors import StageError
from pipeline.preprocess import NO_CROP, BadImage, Crop, Framing, open_image
from pipeline.tracking import stage_run

REPORT_DIR = REPORTS_DIR / "prepare"


def split_by_track(files: Sequence[SignFile], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of train and val files. Whole tracks go to one side; each class gives ~val_fraction
    of its tracks to val (at least one when it has two or more), so val is stratified by class."""
    rng = np.random.default_rng(seed)
    tracks_of_class: dict[int, list[int]] = {}
    for f in files:
        tracks_of_class.setdefault(f.label, [])
        if f.track not in tracks_of_class[f.label]:
            tracks_of_class[f.label].append(f.track)
    val_tracks: set[tuple[int, int]] = set()
    for label in sorted(tracks_of_class):
        tracks = sorted(tracks_of_class[label])
        n_val = max(1, round(len(tracks) * val_fraction)) if len(tracks) >= 2 else 0
        chosen: list[int] = rng.choice(len(tracks), size=n_val, replace=False).tolist() if n_val else []
        val_tracks.update((label, tracks[i]) for i in chosen)
    train_idx = [i for i, f in enumerate(files) if (f.label, f.track) not in val_tracks]
    val_idx = [i for i, f in enumerate(files) if (f.label, f.track) in val_tracks]
    return train_idx, val_idx


def served_crop(files: Sequence[SignFile], config: DataConfig) -> Crop:
    """`data.crop`: for `auto`, the mean background fraction at each side of the training files' sign boxes,
    less roi_margin x the box's mean size, so the average served image frames the sign as `roi` would: in
    GTSRB the sign is off-centre (more background at the left and top) and about a fifth of each side is
    background, pixels the 32 px model cannot spare. `none` (or no boxes) keeps the whole image."""
    sized = [(f.box, f.size) for f in files if f.box is not None and f.size is not None]
    if config.crop == "none" or not sized:
        return NO_CROP
    boxes = np.array([box for box, _ in sized], dtype=np.float64)  # x1, y1, x2, y2 (inclusive)
    sizes = np.array([size for _, size in sized], dtype=np.float64)  # width, height
    w, h = sizes[:, 0], sizes[:, 1]
    box_w, box_h = (boxes[:, 2] - boxes[:, 0] + 1) / w, (boxes[:, 3] - boxes[:, 1] + 1) / h
    margin = config.roi_margin
    sides = (
        boxes[:, 0] / w - margin * box_w,
        boxes[:, 1] / h - margin * box_h,
        (w - 1 - boxes[:, 2]) / w - margin * box_w,
        (h - 1 - boxes[:, 3]) / h - margin * box_h,
    )
    left, top, right, bottom = (round(max(0.0, float(side.mean())), 4) for side in sides)
    return (left, top, right, bottom)


def _load_one(file: SignFile, framing: Framing, use_box: bool) -> np.ndarray | str:
    """The image as an array, or the reason it could not be read."""
    try:
        return framing.array(open_image(str(file.path)), file.box if use_box else None)
    except BadImage as exc:
        return str(exc)


def load_arrays(
    files: Sequence[SignFile], framing: Framing, use_box: bool, description: str
) -> tuple[SplitArrays, list[tuple[str, str]], list[Path]]:
    """Decode, frame and resize every file (by its box + margin when `use_box` and it has one, else as the
    server frames a file); returns the arrays, (file name, reason) of the bad ones and the paths of the good
    ones (in the arrays' order)."""
    size = framing.size
    images = np.empty((len(files), size, size, 3), dtype=np.uint8)
    keep = np.zeros(len(files), dtype=bool)
    bad: list[tuple[str, str]] = []
    # PIL releases the GIL while decoding and resizing, so threads use both cores.
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = pool.map(lambda f: _load_one(f, framing, use_box), files)
        for i, result in enumerate(progress(results, len(files), description)):
            if isinstance(result, str):
                bad.append((f"{files[i].path.parent.name}/{files[i].path.name}", result))
            else:
                images[i] = result
                keep[i] = True
    labels = np.array([f.label for f in files], dtype=np.uint8)
    tracks = np.array([f.label * 100_000 + f.track if f.track >= 0 else -1 for f in files], dtype=np.int32)
    kept = [f.path for f, ok in zip(files, keep, strict=True) if ok]
    return SplitArrays(images[keep], labels[keep], tracks[keep]), bad, kept


def build_manifest(
    arrays: dict[str, SplitArrays],
    bad: list[tuple[str, str]],
    total: int,
    config: DataConfig,
    crop: Crop = NO_CROP,
    test_originals: Sequence[Path] = (),
) -> PreparedManifest:
    train = arrays["train"].images.reshape(-1, 3).astype(np.float64) / 255.0
    return PreparedManifest(
        dataset="GTSRB",
        layout="images: uint8 [N, H, W, 3] RGB; labels: uint8 [N]",
        image_size=config.image_size,
        roi_margin=config.roi_margin,
        num_classes=NUM_CLASSES,
        classes=list(CLASS_NAMES),
        mean=[round(float(v), 6) for v in train.mean(axis=0)],
        std=[round(float(v), 6) for v in train.std(axis=0)],
        splits={
            split: SplitInfo(
                file=f"{split}.npz",
                count=len(arrays[split].labels),
                per_class=np.bincount(arrays[split].labels, minlength=NUM_CLASSES).tolist(),
                tracks=len(np.unique(arrays[split].tracks)) if split != "test" else None,
            )
            for split in SPLITS
        },
        bad_images=BadImages(count=len(bad), of=total, files=[name for name, _ in bad]),
        content_sha256=content_sha256(arrays),
        test_files=[f"{prepared.TEST_FILES}/{path.name}" for path in test_originals],
        framing=config.framing,
        crop=crop,
    )


def write_reports(manifest: PreparedManifest, bad: list[tuple[str, str]], report_dir: Path) -> dict[str, float]:
    report_dir.mkdir(parents=True, exist_ok=True)
    splits = manifest.splits
    total = sum(splits[s].count for s in SPLITS) + len(bad)
    metrics = {f"{s}_images": float(splits[s].count) for s in SPLITS}
    metrics["bad_images"] = float(len(bad))
    metrics["bad_fraction"] = round(len(bad) / total, 6) if total else 0.0
    (report_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    lines = ["class,name,train,val,test"]
    for c in range(NUM_CLASSES):
        counts = ",".join(str(splits[s].per_class[c]) for s in SPLITS)
        lines.append(f'{c},"{CLASS_NAMES[c]}",{counts}')
    (report_dir / "class_distribution.csv").write_text("\n".join(lines) + "\n")
    (report_dir / "bad_images.txt").write_text("".join(f"{name}\t{why}\n" for name, why in bad))
    return metrics


def run(params: Params) -> None:
    config = params.data
    root = config.resolved_root()
    with stage_run("prepare", params.tracking, {"data": config.model_dump(mode="json")}) as tracker:
        log(f"prepare: reading GTSRB from {root}")
        train_files = list_split(root, "train", config.download)
        test_files = list_split(root, "test", config.download)
        train_idx, val_idx = split_by_track(train_files, config.val_fraction, config.seed)
        crop = served_crop([train_files[i] for i in train_idx], config)
        framing = Framing(config.image_size, config.roi_margin, crop)
        log(f"prepare: served framing: whole image less {crop} (left, top, right, bottom); train/val: {config.framing}")

        arrays: dict[str, SplitArrays] = {}
        bad: list[tuple[str, str]] = []
        kept: dict[str, list[Path]] = {}
        roi_train = config.framing == "roi"
        for split, files, use_box in (
            ("train", [train_files[i] for i in train_idx], roi_train),
            ("val", [train_files[i] for i in val_idx], roi_train),
            ("test", test_files, True),
        ):
            arrays[split], split_bad, kept[split] = load_arrays(files, framing, use_box, f"prepare {split}")
            bad += split_bad

        total = len(train_files) + len(test_files)
        for name, why in bad[:20]:
            log(f"prepare: skipped {name}: {why}")
        if len(bad) > config.max_bad_fraction * total:
            raise StageError(
                f"{len(bad)} of {total} images are unreadable ({len(bad) / total:.1%}), more than "
                f"data.max_bad_fraction={config.max_bad_fraction:.1%}; first: {bad[0][0]}: {bad[0][1]}. "
                "Previous outputs were left as they were."
            )
        for split in SPLITS:
            if len(arrays[split].labels) == 0:
                raise StageError(f"the {split} split is empty after preparation; check data.val_fraction")

        # The test split's original files go along: evaluate measures what the server is sent (whole images).
        manifest = build_manifest(arrays, bad, total, config, crop, kept["test"])
        prepared.write(arrays, manifest, PREPARED_DIR, kept["test"])
        metrics = write_reports(manifest, bad, REPORT_DIR)
        tracker.log_metrics(metrics)
        tracker.log_artifact(PREPARED_DIR / prepared.MANIFEST_FILE)
        tracker.log_artifact(REPORT_DIR / "class_distribution.csv")
        log(
            "prepare: "
            + ", ".join(f"{s} {int(metrics[f'{s}_images'])}" for s in SPLITS)
            + f" images at {config.image_size}x{config.image_size}; {len(bad)} unreadable"
        )
