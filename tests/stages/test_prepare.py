import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.artifacts.prepared import read_split
from pipeline.config import Params
from pipeline.data.listing import list_csv
from pipeline.errors import StageError
from pipeline.stages import prepare
from tests.helpers.images import SyntheticImages
from tests.helpers.params import make_params


def _load(split: str) -> dict[str, np.ndarray]:
    arrays = read_split(split, Path("data/prepared"))
    return {"images": arrays.images, "labels": arrays.labels, "tracks": arrays.tracks}


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")}


@pytest.fixture
def labels_csv(synthetic_images: SyntheticImages) -> Path:
    """The tests' images as a CSV with each object's box and group (frames of one object) and a test split."""
    return synthetic_images.csv


def csv_params(path: Path, tracking: bool = False, **data: object) -> Params:
    return make_params(path, tracking, source="csv", **data)


def test_prepare_writes_arrays_manifest_and_reports(labels_csv: Path, workdir: Path) -> None:
    raw_before = _snapshot(labels_csv.parent)
    prepare.run(csv_params(labels_csv, image_size=24, val_fraction=0.34))

    train, val, test = _load("train"), _load("val"), _load("test")
    assert train["images"].shape[1:] == (24, 24, 3) and train["images"].dtype == np.uint8
    assert len(train["labels"]) + len(val["labels"]) == 43 * 6
    assert len(test["labels"]) == 86
    manifest = json.loads(Path("data/prepared/manifest.json").read_text())
    assert manifest["image_size"] == 24 and len(manifest["classes"]) == 43
    assert manifest["splits"]["val"]["per_class"] == [2] * 43  # one of three groups per class, 2 frames each
    assert len(manifest["mean"]) == 3 and all(0 < s < 1 for s in manifest["std"])
    assert len(manifest["content_sha256"]) == 64
    metrics = json.loads(Path("reports/prepare/metrics.json").read_text())
    assert metrics["bad_images"] == 0 and metrics["test_images"] == 86
    assert Path("reports/prepare/class_distribution.csv").read_text().count("\n") == 44
    # The stage wrote only its outputs: the dataset is untouched and no stray files appear.
    assert _snapshot(labels_csv.parent) == raw_before
    assert sorted(p.name for p in workdir.iterdir()) == ["data", "reports"]
    assert sorted(p.name for p in (workdir / "data").iterdir()) == ["prepared"]


def test_crop_follows_the_roi_box(labels_csv: Path, workdir: Path) -> None:
    prepare.run(csv_params(labels_csv, image_size=16, roi_margin=0.0))
    images, labels = _load("test")["images"], _load("test")["labels"]
    # With no margin the crop is the class-coloured square only: the centre equals the edge colour.
    label = int(labels[0])
    expected = [(label * 37) % 256, (label * 91) % 256, (label * 53) % 256]
    assert images[0][8, 8].tolist() == expected
    assert np.abs(images[0][0, 0].astype(int) - expected).max() <= 2


def test_validation_split_never_shares_a_group_with_train(labels_csv: Path, workdir: Path) -> None:
    prepare.run(csv_params(labels_csv, val_fraction=0.34))
    train_tracks = set(_load("train")["tracks"].tolist())
    val_tracks = set(_load("val")["tracks"].tolist())
    assert val_tracks and not train_tracks & val_tracks
    assert set(_load("val")["labels"].tolist()) == set(range(43))  # stratified: every class in val


def test_split_is_deterministic_for_a_seed(labels_csv: Path) -> None:
    files = list_csv(labels_csv).train
    assert prepare.split_by_track(files, 0.34, 1) == prepare.split_by_track(files, 0.34, 1)
    assert prepare.split_by_track(files, 0.34, 1) != prepare.split_by_track(files, 0.34, 2)


def _corrupt(csv: Path, count: int) -> list[Path]:
    victims = sorted((csv.parent / "train").rglob("*.png"))[:count]
    for path in victims:
        path.write_bytes(path.read_bytes()[:60])  # truncated in the pixel data: each its own bytes
    return victims


def test_corrupt_images_are_counted_not_fatal(labels_csv: Path, workdir: Path) -> None:
    victims = _corrupt(labels_csv, 2)
    prepare.run(csv_params(labels_csv, max_bad_fraction=0.05))
    manifest = json.loads(Path("data/prepared/manifest.json").read_text())
    assert manifest["bad_images"]["count"] == 2
    assert manifest["bad_images"]["files"] == [f"00/{v.name}" for v in victims]
    total = len(_load("train")["labels"]) + len(_load("val")["labels"])
    assert total == 43 * 6 - 2
    assert "00/00_00.png" in Path("reports/prepare/bad_images.txt").read_text()


def test_too_many_corrupt_images_fail_and_keep_previous_outputs(labels_csv: Path, workdir: Path) -> None:
    prepare.run(csv_params(labels_csv))
    before = Path("data/prepared/manifest.json").read_text()
    _corrupt(labels_csv, 30)
    with pytest.raises(StageError, match=r"\d+ of 344 images are unreadable .* data.max_bad_fraction"):
        prepare.run(csv_params(labels_csv, max_bad_fraction=0.05))
    assert Path("data/prepared/manifest.json").read_text() == before
    assert sorted(p.name for p in Path("data").iterdir()) == ["prepared"]  # no staging folder left


def test_prepare_logs_to_mlflow(labels_csv: Path, workdir: Path) -> None:
    import mlflow

    prepare.run(csv_params(labels_csv, tracking=True))
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["signs"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("stage") == "prepare"]
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id and len(runs) == 2
    assert run.data.tags["stage"] == "prepare" and run.data.params["data.image_size"] == "32"
    assert run.data.metrics["test_images"] == 86
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"manifest.json", "class_distribution.csv"} <= artifacts


def test_the_test_splits_original_files_go_along_byte_for_byte(labels_csv: Path, workdir: Path) -> None:
    """What a user sends the server is the whole original file: prepare keeps each kept test image's file, in
    the arrays' order, so evaluate can measure exactly that (a corrupt test file is skipped in both)."""
    from pipeline.artifacts.prepared import read_test_files

    broken = labels_csv.parent / "test" / "01" / "01.png"
    broken.write_bytes(b"\x89PNG not really")
    prepare.run(csv_params(labels_csv, max_bad_fraction=0.05))
    files = read_test_files(Path("data/prepared"))
    labels = _load("test")["labels"].tolist()
    assert len(files) == len(labels) == 43 * 2 - 1
    assert [f.label for f in files] == labels
    originals = [p for p in list_csv(labels_csv).test or [] if p.path != broken]
    assert [f.read_bytes() for f in files] == [o.path.read_bytes() for o in originals]


def test_shard_size_changes_how_it_is_stored_not_what_is_read(labels_csv: Path, workdir: Path) -> None:
    """One 1 MB shard holds 85 images at 64 px: the training split becomes several shards, each image written
    while decoding (no split in memory), and every byte read back, the content hash and the mean/std equal what
    one shard per split gives."""
    prepare.run(csv_params(labels_csv, image_size=64, shard_mb=64))
    one = json.loads(Path("data/prepared/manifest.json").read_text())
    single = {split: _load(split) for split in ("train", "val", "test")}
    prepare.run(csv_params(labels_csv, image_size=64, shard_mb=1))
    many = json.loads(Path("data/prepared/manifest.json").read_text())
    assert [s["count"] for s in one["splits"]["train"]["shards"]] == [one["splits"]["train"]["count"]]
    counts = [s["count"] for s in many["splits"]["train"]["shards"]]
    assert len(counts) > 1 and set(counts[:-1]) == {85} and sum(counts) == many["splits"]["train"]["count"]
    assert sorted(p.name for p in Path("data/prepared/train").iterdir())[:2] == ["images-00000.npy", "images-00001.npy"]
    assert many["content_sha256"] == one["content_sha256"] and (many["mean"], many["std"]) == (one["mean"], one["std"])
    for split, arrays in single.items():
        again = _load(split)
        assert all(np.array_equal(arrays[key], again[key]) for key in arrays), split


def test_interpolation_auto_is_the_pretrained_weights_own_and_goes_to_the_served_framing(
    labels_csv: Path, workdir: Path
) -> None:
    """data.interpolation: auto: timm's networks and torchvision's efficientnet_b0 were made with bicubic, resnet18
    and our own networks with bilinear; the prepared arrays are made with it and the manifest's served framing
    carries it (optimize copies that into what the server applies)."""
    from pipeline.artifacts.prepared import read_manifest
    from pipeline.config import parse_params
    from pipeline.images.preprocess import Framing

    def prepared_with(model: str, interpolation: str = "auto") -> tuple[Framing, np.ndarray]:
        base = csv_params(labels_csv, image_size=24, interpolation=interpolation)
        prepare.run(parse_params({**base.model_dump(mode="json"), "model": {"name": model}}))
        return read_manifest(Path("data/prepared")).served_framing(), _load("test")["images"]

    framings = {m: prepared_with(m) for m in ("signnet", "torchvision/resnet18", "torchvision/efficientnet_b0")}
    assert {m: f.interpolation for m, (f, _) in framings.items()} == {
        "signnet": "bilinear", "torchvision/resnet18": "bilinear", "torchvision/efficientnet_b0": "bicubic"
    }  # fmt: skip
    assert prepared_with("timm/mobilenetv3_small_050")[0].interpolation == "bicubic"
    bilinear, bicubic = framings["torchvision/resnet18"][1], framings["torchvision/efficientnet_b0"][1]
    assert bilinear.shape == bicubic.shape and not np.array_equal(bilinear, bicubic)  # the filter reached the pixels
    chosen, pixels = prepared_with("torchvision/efficientnet_b0", "bilinear")  # an explicit choice wins
    assert chosen.interpolation == "bilinear" and np.array_equal(pixels, bilinear)
    assert not chosen.reduced_jpeg_decode
    prepare.run(csv_params(labels_csv, image_size=24, reduced_jpeg_decode=True))
    assert read_manifest(Path("data/prepared")).served_framing().reduced_jpeg_decode


def test_min_image_size_prepares_the_largest_side_whose_epochs_fit_the_time_budget(
    labels_csv: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.min_image_size with train.max_minutes: prepare times the network's training step at sides from
    data.image_size down to data.min_image_size (the smallest first) and prepares the largest whose train.epochs fit
    in the budget."""
    from pipeline.artifacts.prepared import read_manifest
    from pipeline.config import parse_params

    def prepared_at(minutes: float, min_image_size: int = 16) -> int:
        base = csv_params(labels_csv, image_size=32, min_image_size=min_image_size).model_dump(mode="json")
        prepare.run(parse_params({**base, "train": {**base["train"], "epochs": 3, "max_minutes": minutes}}))
        side = read_manifest(Path("data/prepared")).image_size
        assert _load("train")["images"].shape[1:] == (side, side, 3)
        assert json.loads(Path("reports/prepare/metrics.json").read_text())["image_size"] == side
        return side

    assert prepared_at(600.0) == 32  # three epochs of these few images fit in ten hours at the largest side
    assert (
        "image size 32 px, the largest side from data.image_size 32 down to data.min_image_size 16 at which "
        "train.epochs=3 fit in train.max_minutes=600 here (signnet trains at 32 px"
        in capsys.readouterr().err.replace("\n", " ")
    )
    assert read_manifest(Path("data/prepared")).image_size_reason == ""  # data.image_size as written: no reason
    assert prepared_at(1e-6) == 16  # nothing fits in a few microseconds: the smallest, timed first, and no larger side
    # the manifest keeps why (the model card's network line says it)
    assert read_manifest(Path("data/prepared")).image_size_reason.startswith("the smallest: at no side from")
    said = capsys.readouterr().err.replace("\n", " ")
    assert "image size 16 px, the smallest: at no side from data.image_size 32 down to data.min_image_size 16" in said
    paces = said.split("signnet trains at")[1]
    assert "16 px " in paces and "32 px " not in paces
    assert prepared_at(1e-6, min_image_size=0) == 32 and "image size" not in capsys.readouterr().err  # off: as written


def test_pretrained_weights_keep_the_image_size_and_a_missing_file_is_one_line(
    labels_csv: Path, workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.min_image_size is for random weights: a network that starts from a weights file keeps data.image_size
    (nothing timed); the same network from random weights gets the smallest side under a budget of microseconds."""
    from safetensors.torch import save_file

    from pipeline.architectures.backbones import library_network
    from pipeline.artifacts.prepared import read_manifest
    from pipeline.config import parse_params

    name = "timm/mobilenetv3_small_050"
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in library_network(name, 1000).state_dict().items()}, str(weights))

    def prepared_with(model_weights: str) -> int:
        base = csv_params(labels_csv, image_size=32, min_image_size=16).model_dump(mode="json")
        prepare.run(parse_params({**base, "model": {**base["model"], "name": name, "weights": model_weights},
                                  "train": {**base["train"], "epochs": 3, "max_minutes": 1e-6}}))  # fmt: skip
        return read_manifest(Path("data/prepared")).image_size

    assert prepared_with(str(weights)) == 32
    said = capsys.readouterr().err.replace("\n", " ")
    assert f"image size 32 px: {name} starts from pretrained weights ({weights})" in said and "trains at" not in said
    assert prepared_with("none") == 16 and f"({name} trains at 16 px" in capsys.readouterr().err.replace("\n", " ")
    with pytest.raises(StageError, match="no such file"):
        prepared_with(str(tmp_path / "missing.safetensors"))
