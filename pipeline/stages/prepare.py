"""The prepare stage: labelled image files -> uint8 image shards for train / val / test plus a manifest.

    data.root --data.source's lister (pipeline/data/sources.py)--> split train/val by group, stratified by class
        --> the served framing (data.crop: auto = derived from the training split's object boxes)
        --> train, val: each file as the server frames it (data.framing: served), or the object's box + margin (roi)
        --> test: the box + margin (the ROI protocol), and its original files kept for the served figure
        --> data/prepared/{train,val,test}/ shards, streamed, data/prepared/manifest.json (artifacts.prepared)
        --> reports/prepare/metrics.json, reports/prepare/class_distribution.csv

Unreadable images are counted and listed, never fatal unless more than data.max_bad_fraction are bad.
Outputs are written to a temporary folder and swapped in at the end: a failed run leaves the previous
outputs as they were, and nothing outside the outputs is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeline.artifacts import REPORTS_DIR, prepared
from pipeline.artifacts.prepared import (
    PREPARED_DIR,
    SPLITS,
    BadImages,
    PreparedManifest,
)
from pipeline.config import LIBRARY_NETWORK, DataConfig, Params
from pipeline.console import log, progress
from pipeline.data import sources
from pipeline.data.decode import decoded
from pipeline.data.listing import Listing, SignFile
from pipeline.errors import StageError
from pipeline.images.preprocess import NO_CROP, Crop, Framing, Interpolation
from pipeline.tracking import stage_run

REPORT_DIR = REPORTS_DIR / "prepare"


def split_by_track(
    files: Sequence[SignFile], val_fraction: float, seed: int, classes: Sequence[str] | None = None, what: str = "val"
) -> tuple[list[int], list[int]]:
    """Indices of the files that stay and of those held out. Whole groups (frames of one object: a source's tracks, a CSV's `group`; a file
    without one is its own group) go to one side; each class gives ~`val_fraction` of its groups to the held-out
    side, at least one, so both sides hold every class. A class with fewer than two groups cannot be on both
    sides: a StageError names it."""
    rng = np.random.default_rng(seed)
    tracks_of_class: dict[int, list[int]] = {}
    keys = [f.track if f.track >= 0 else -2 - i for i, f in enumerate(files)]  # no group: the file alone
    for f, key in zip(files, keys, strict=True):
        tracks_of_class.setdefault(f.label, [])
        if key not in tracks_of_class[f.label]:
            tracks_of_class[f.label].append(key)
    too_small = sorted(label for label, tracks in tracks_of_class.items() if len(tracks) < 2)
    if too_small:
        names = ", ".join(f"{classes[label] if classes else label}" for label in too_small)
        raise StageError(
            f"too few images to hold out a {what} split with every class: {names} (one file or group each). "
            "Each class needs at least two files, or groups, to be on both sides: add images or remove the class"
        )
    val_tracks: set[tuple[int, int]] = set()
    for label in sorted(tracks_of_class):
        tracks = sorted(tracks_of_class[label])
        n_val = min(len(tracks) - 1, max(1, round(len(tracks) * val_fraction)))
        chosen: list[int] = rng.choice(len(tracks), size=n_val, replace=False).tolist()
        val_tracks.update((label, tracks[i]) for i in chosen)
    train_idx = [i for i, f in enumerate(files) if (f.label, keys[i]) not in val_tracks]
    val_idx = [i for i, f in enumerate(files) if (f.label, keys[i]) in val_tracks]
    return train_idx, val_idx


def list_source(config: DataConfig) -> Listing:
    """The files of `data.source`: every class has training files, none is only in test (listing.py checks)."""
    root = raw_root(config)
    log(f"prepare: reading {config.source} data from {root}")
    return sources.lister(config.source)(root, config.download)


def drop_duplicates(
    fit: Sequence[SignFile], val: Sequence[SignFile], test: Sequence[SignFile]
) -> tuple[list[SignFile], list[SignFile], list[tuple[str, str]]]:
    """val less the files whose bytes equal a training file, test less those equal to a training or validation
    file (a test image that is also a training image measures memory, not accuracy); each file is read once.
    Returns val, test and (file, why) of those left out."""
    seen: dict[str, tuple[Path, str]] = {}  # digest -> the first file with it, and its split
    dropped: list[tuple[str, str]] = []

    def keep(f: SignFile, split: str) -> bool:
        try:
            digest = hashlib.sha256(f.path.read_bytes()).hexdigest()
        except OSError:
            return True  # unreadable: load_arrays counts it
        twin = seen.get(digest)
        if twin is not None and twin[1] != split:
            where = "the training split" if twin[1] == "train" else "the validation split"
            dropped.append(
                (
                    f"{f.path.parent.name}/{f.path.name}",
                    f"same bytes as {twin[0].parent.name}/{twin[0].name} in {where}",
                )
            )
            return False
        seen.setdefault(digest, (f.path, split))
        return True

    for f in fit:
        keep(f, "train")
    kept_val = [f for f in val if keep(f, "val")]
    kept_test = [f for f in test if keep(f, "test")]
    return kept_val, kept_test, dropped


def header_size(path: Path) -> tuple[int, int] | None:
    """(width, height) from an image file's header, without decoding it; None when it does not open (prepare counts
    it as unreadable when it decodes the file)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.size
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def served_crop(files: Sequence[SignFile], config: DataConfig) -> Crop:
    """`data.crop`: for `auto`, the mean background fraction at each side of the training files' sign boxes,
    less roi_margin x the box's mean size, so the average served image frames the object as `roi` would: an
    off-centre object with a fifth of each side background (road signs in dash-cam crops) gets those pixels back,
    which a 32 px model cannot spare. `none` (or no boxes) keeps the whole image. A size the source does not state
    (a CSV's boxes) is read from the file's header."""
    if config.crop == "none":
        return NO_CROP
    sized = [(f.box, f.size or header_size(f.path)) for f in files if f.box is not None]
    sized = [(box, size) for box, size in sized if size is not None]
    if not sized:
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


def write_split(
    writer: prepared.Writer,
    split: str,
    files: Sequence[SignFile],
    framing: Framing,
    use_box: bool,
    num_classes: int,
) -> tuple[prepared.SplitStats, list[tuple[str, str]], list[Path]]:
    """Decode, frame and resize every file (by its box + margin when `use_box` and it has one, else as the
    server frames a file) into the writer's shards, one shard's rows in memory at a time; returns the split's
    stats, (file name, reason) of the bad files and the paths of the good ones (in the shards' order)."""
    size = framing.size
    block = np.empty((min(writer.shard_rows, max(1, len(files))), size, size, 3), dtype=np.uint8)
    labels, tracks = np.empty(len(block), np.uint8), np.empty(len(block), np.int32)
    filled = 0
    bad: list[tuple[str, str]] = []
    kept: list[Path] = []
    writer.begin(split)
    for file, result in zip(
        files, progress(decoded(files, framing, use_box), len(files), f"prepare {split}"), strict=True
    ):
        if isinstance(result, str):
            bad.append((f"{file.path.parent.name}/{file.path.name}", result))
            continue
        block[filled] = result
        labels[filled] = file.label
        tracks[filled] = file.label * 100_000 + file.track if file.track >= 0 else -1
        kept.append(file.path)
        filled += 1
        if filled == len(block):
            writer.add(block, labels, tracks)
            filled = 0
    if filled:
        writer.add(block[:filled], labels[:filled], tracks[:filled])
    return writer.end(num_classes), bad, kept


def build_manifest(
    stats: dict[str, prepared.SplitStats],
    bad: list[tuple[str, str]],
    total: int,
    config: DataConfig,
    framing: Framing,
    test_originals: Sequence[Path] = (),
    classes: Sequence[str] = (),
    dataset: str = "",
    content_sha256: str = "",
    subject: prepared.DataSubject | None = None,
    boxes: bool = True,
    image_size_reason: str = "",
) -> PreparedManifest:
    mean, std = stats["train"].mean_std()
    return PreparedManifest(
        dataset=dataset,
        layout="images: uint8 [N, H, W, 3] RGB in .npy shards; labels: uint8 [N]",
        image_size=framing.size,
        roi_margin=framing.roi_margin,
        num_classes=len(classes),
        classes=list(classes),
        mean=mean,
        std=std,
        splits={split: stats[split].info for split in SPLITS},
        bad_images=BadImages(count=len(bad), of=total, files=[name for name, _ in bad]),
        content_sha256=content_sha256,
        test_files=test_file_names(test_originals),
        boxes=boxes,
        image_size_reason=image_size_reason,
        framing=config.framing,
        crop=framing.crop,
        resize_mode=framing.resize,
        interpolation=framing.interpolation,
        reduced_jpeg_decode=framing.reduced_jpeg_decode,
        subject=subject,
    )


def interpolation(params: Params) -> Interpolation:
    """data.interpolation, `auto` resolved: the filter model.name's pretrained weights were made with."""
    if params.data.interpolation != "auto":
        return params.data.interpolation
    if not LIBRARY_NETWORK.match(params.model.name):  # ours or your own module: no pretrained filter, no torch import
        return "bilinear"
    from pipeline.architectures.backbones import (
        expected_interpolation,  # torch and the model libraries: only for `auto`
    )

    return expected_interpolation(params.model.name, params.model.weights)


def pretrained_weights(params: Params) -> str:
    """The file a torchvision/timm network will start from (model.weights, `auto` resolved as train resolves it: the
    library's cache, else a download where the network allows), or "" for random weights; a missing file or another
    hash is one line here, before any image is decoded."""
    m = params.model
    if not LIBRARY_NETWORK.match(m.name) or m.weights == "none":
        return ""
    from pipeline.architectures import backbones

    try:
        info, _ = backbones.resolve(m.name, m.weights, m.weights_sha256)
    except (backbones.WeightsError, ValueError) as exc:
        raise StageError(str(exc)) from None
    return info.file if info.source not in ("none", "random") else ""


def image_size(params: Params, train_images: int, val_images: int, classes: int) -> tuple[int, str]:
    """data.image_size, or with data.min_image_size and train.max_minutes the largest side whose training fits the
    budget on this machine (pipeline/training/pace.py): the side, and why when it is not data.image_size (the log
    and the card say it)."""
    d, t = params.data, params.train
    if not (d.min_image_size and t.max_minutes) or d.min_image_size >= d.image_size:
        return d.image_size, ""
    weights = pretrained_weights(params)
    if weights:  # they learn in a few epochs, at the side they were made for: the budget then plans the epochs
        log(f"prepare: image size {d.image_size} px: {params.model.name} starts from pretrained weights ({weights}); "
            "data.min_image_size is for random weights, which need every epoch")  # fmt: skip
        return d.image_size, ""
    import torch  # the network's own step is timed: only when the side is chosen

    from pipeline.architectures import nets
    from pipeline.training import distributed, pace

    device = distributed.choose_device(t.device)
    members = nets.trained_members(params.model.name, params.model.members)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(distributed.cpu_threads(t.threads, t.nproc))

    def build(side: int) -> torch.nn.Module:
        m = params.model
        return nets.build(m.name, [0.5] * 3, [0.25] * 3, side, m.width, m.dropout, classes, m.input_norm, members)

    trained = train_images + (val_images if t.train_on_val else 0)  # with train_on_val the shipped model trains on both
    scored = 0 if t.train_on_val else val_images
    try:
        side, timed = pace.affordable_size(
            pace.candidate_sizes(d.image_size, d.min_image_size), build,
            batch=max(1, t.batch_size // t.nproc), classes=classes, train_images=trained, val_images=scored,
            epochs=t.epochs, minutes=t.max_minutes, device=device, amp=distributed.amp_dtype(t.amp, device),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    minutes = {p.image_size: p.minutes(t.epochs, trained, scored) for p in timed}
    paces = ", ".join(
        f"{p.image_size} px {p.images_per_second:.0f} img/s: {minutes[p.image_size]:.1f} min" for p in timed
    )
    sides = f"from data.image_size {d.image_size} down to data.min_image_size {d.min_image_size}"
    budget = f"train.epochs={t.epochs} fit in train.max_minutes={t.max_minutes:g} here"
    verdict = (
        f"the largest side {sides} at which {budget}"
        if minutes[side] <= t.max_minutes
        else f"the smallest: at no side {sides} do {budget}, so train.max_minutes plans the epochs that fit"
    )
    log(f"prepare: image size {side} px, {verdict} ({params.model.name} trains at {paces})")
    return side, "" if side == d.image_size else f"{verdict} ({paces})"


def test_file_names(paths: Sequence[Path]) -> list[str]:
    """Names of the kept original test files under data/prepared/: the file names when they are unique,
    else prefixed with their position (class folders often reuse names such as 1.png)."""
    names = [path.name for path in paths]
    if len(set(names)) != len(names):
        names = [f"{i:05d}-{name}" for i, name in enumerate(names)]
    return [f"{prepared.TEST_FILES}/{name}" for name in names]


def write_reports(
    manifest: PreparedManifest, bad: list[tuple[str, str]], report_dir: Path, left_out: Sequence[tuple[str, str]] = ()
) -> dict[str, float]:
    report_dir.mkdir(parents=True, exist_ok=True)
    splits = manifest.splits
    total = sum(splits[s].count for s in SPLITS) + len(bad)
    metrics = {f"{s}_images": float(splits[s].count) for s in SPLITS}
    metrics["image_size"] = float(manifest.image_size)  # data.min_image_size may have chosen it: `dvc exp show` has it
    metrics["bad_images"] = float(len(bad))
    metrics["bad_fraction"] = round(len(bad) / total, 6) if total else 0.0
    (report_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    lines = ["class,name,train,val,test"]
    for c, name in enumerate(manifest.classes):
        counts = ",".join(str(splits[s].per_class[c]) for s in SPLITS)
        lines.append(f'{c},"{name.replace(chr(34), chr(39))}",{counts}')
    (report_dir / "class_distribution.csv").write_text("\n".join(lines) + "\n")
    (report_dir / "bad_images.txt").write_text("".join(f"{name}\t{why}\n" for name, why in bad))
    # Left out before decoding: not image files, outside the data folder, duplicates across splits.
    metrics["left_out_files"] = float(len(left_out))
    (report_dir / "left_out.txt").write_text("".join(f"{name}\t{why}\n" for name, why in left_out))
    return metrics


DVC_STAGE_ENV = "DVC_STAGE"  # set by DVC for every stage command it runs


def raw_root(config: DataConfig) -> Path:
    """The raw data prepare reads: under DVC the folder dvc.yaml tracks (`${data.root}`, also a queued experiment's
    copy of it, `dvc exp run --queue -C data/raw`), else data.root or the copy the source's variable names."""
    queued_copy = Path(".dvc", "tmp", "exps").as_posix() in Path.cwd().as_posix()  # where DVC runs a queued experiment
    if os.environ.get(DVC_STAGE_ENV) and queued_copy and config.root.exists():
        return config.root
    return config.resolved_root()


def check_tracked_root(config: DataConfig) -> None:
    """Under DVC, the raw data read must be the folder dvc.yaml tracks (`${data.root}`): the source's variable
    (DataSource.root_env) pointing elsewhere would make `dvc status` blind to added, removed or changed images, so it is refused in one line."""
    read, tracked = raw_root(config), config.root
    if os.environ.get(DVC_STAGE_ENV) and read.resolve() != tracked.resolve():
        raise StageError(
            f"{sources.DATA_SOURCES[config.source].root_env}={read} is not the data DVC tracks (data.root: {tracked}), so adding or changing an "
            f"image would not re-run prepare: link it there (`scripts/raw-data.sh`, which `make pipeline` runs: "
            f"ln -s {read} {tracked}) or set data.root to it"
        )


def split_files(
    listing: Listing, config: DataConfig
) -> tuple[list[SignFile], list[SignFile], list[SignFile], list[tuple[str, str]]]:
    """train, val and test files (a test split held out by group when the data has none), without duplicates across
    them; and what was left out, with why."""
    if listing.test is None:  # no test split in the data: hold one out, by group, stratified by class
        rest, held = split_by_track(listing.train, config.test_fraction, config.seed + 1, listing.classes, "test")
        train_files, test_files = [listing.train[i] for i in rest], [listing.train[i] for i in held]
    else:
        train_files, test_files = listing.train, listing.test
    train_idx, val_idx = split_by_track(train_files, config.val_fraction, config.seed, listing.classes)
    fit = [train_files[i] for i in train_idx]
    val, test_files, dropped = drop_duplicates(fit, [train_files[i] for i in val_idx], test_files)
    for name, why in dropped[:20]:
        log(f"prepare: left out {name}: {why}")
    return fit, val, test_files, dropped


def served_framing(params: Params, fit: list[SignFile], val: list[SignFile], classes: int) -> tuple[Framing, str]:
    """How a whole file becomes the model's input (the server's framing), and why its side, when the budget chose it."""
    config = params.data
    crop = served_crop(fit, config)
    side, side_reason = image_size(params, len(fit), len(val), classes)
    framing = Framing(side, config.roi_margin, crop, config.resize, interpolation(params), config.reduced_jpeg_decode)
    log(
        f"prepare: served framing: whole image less {crop} (left, top, right, bottom), {framing.resize} to "
        f"{framing.size} px, {framing.interpolation}; train/val: {config.framing}"
    )
    return framing, side_reason


def write_splits(
    writer: prepared.Writer, splits: dict[str, list[SignFile]], framing: Framing, config: DataConfig, classes: list[str]
) -> tuple[dict[str, prepared.SplitStats], list[tuple[str, str]], dict[str, list[Path]]]:
    """Each split's arrays (train and val framed as data.framing says, test always by its boxes); a StageError when
    more than data.max_bad_fraction are unreadable or a split ends up empty."""
    stats: dict[str, prepared.SplitStats] = {}
    bad: list[tuple[str, str]] = []
    kept: dict[str, list[Path]] = {}
    total = sum(len(files) for files in splits.values())
    for split, files in splits.items():
        use_box = split == "test" or config.framing == "roi"
        stats[split], split_bad, kept[split] = write_split(writer, split, files, framing, use_box, len(classes))
        bad += split_bad
        if len(bad) > config.max_bad_fraction * total:
            raise StageError(
                f"{len(bad)} of {total} images are unreadable ({len(bad) / total:.1%}), more than "
                f"data.max_bad_fraction={config.max_bad_fraction:.1%}; first: {bad[0][0]}: {bad[0][1]}. "
                "Previous outputs were left as they were."
            )
    for name, why in bad[:20]:
        log(f"prepare: skipped {name}: {why}")
    for split in SPLITS:
        if stats[split].info.count == 0:
            raise StageError(f"the {split} split is empty after preparation; check data.val_fraction")
        missing = sorted(set(range(len(classes))) - set(np.flatnonzero(stats[split].info.per_class).tolist()))
        if missing:  # its only files there were unreadable or duplicates: said, not fatal
            names = ", ".join(classes[c] for c in missing[:10])
            log(f"prepare: the {split} split has no readable image of {len(missing)} class(es): {names}")
    return stats, bad, kept


def run(params: Params) -> None:
    config = params.data
    check_tracked_root(config)
    with stage_run("prepare", params, {"data": config.model_dump(mode="json")}) as tracker:
        listing = list_source(config)
        for name, why in listing.ignored[:20]:
            log(f"prepare: left out {name}: {why}")
        fit, val, test_files, dropped = split_files(listing, config)
        framing, side_reason = served_framing(params, fit, val, len(listing.classes))
        splits = {"train": fit, "val": val, "test": test_files}
        with prepared.Writer(PREPARED_DIR, framing.size, config.shard_mb) as writer:
            stats, bad, kept = write_splits(writer, splits, framing, config, listing.classes)
            # The test split's original files go along: evaluate measures what the server is sent (whole images).
            manifest = build_manifest(
                stats, bad, sum(map(len, splits.values())), config, framing, kept["test"], listing.classes,
                listing.dataset, writer.content_sha256, listing.subject,
                boxes=any(f.box is not None for f in test_files), image_size_reason=side_reason,
            )  # fmt: skip
            writer.finish(manifest, kept["test"])
        manifest = prepared.read_manifest(PREPARED_DIR)
        metrics = write_reports(manifest, bad, REPORT_DIR, listing.ignored + dropped)
        tracker.log_metrics(metrics)
        tracker.log_artifact(PREPARED_DIR / prepared.MANIFEST_FILE)
        tracker.log_artifact(REPORT_DIR / "class_distribution.csv")
        log(
            "prepare: "
            + ", ".join(f"{s} {int(metrics[f'{s}_images'])}" for s in SPLITS)
            + f" images at {framing.size}x{framing.size}; {len(bad)} unreadable"
        )
