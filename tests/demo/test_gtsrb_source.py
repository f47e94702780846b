"""The demo's data source (pipeline/data/gtsrb.py), its recipe and names, and prepare on it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.artifacts.prepared import read_split
from pipeline.config import NAMED_KEYS, ConfigError, parse_params
from pipeline.data.gtsrb import CLASS_NAMES, list_split
from pipeline.errors import StageError
from pipeline.stages import prepare
from tests.helpers import REPO
from tests.helpers.demo import write_synthetic_gtsrb
from tests.helpers.params import make_params
from tests.helpers.project import link_raw_data, make_project


def test_class_names() -> None:
    assert len(CLASS_NAMES) == 43
    assert CLASS_NAMES[14] == "Stop"


def test_lists_train_with_boxes_tracks_and_labels(synthetic_gtsrb: Path) -> None:
    files = list_split(synthetic_gtsrb, "train")
    assert len(files) == 43 * 3 * 2
    assert {f.label for f in files} == set(range(43))
    assert {f.track for f in files} == {0, 1, 2}
    first = next(f for f in files if f.label == 7)
    assert first.path.parent.name == "00007" and first.box is not None and first.box[:2] == (3, 3)


def test_lists_test_split_with_labels_from_the_official_csv(synthetic_gtsrb: Path) -> None:
    files = list_split(synthetic_gtsrb, "test")
    assert len(files) == 86
    assert [f.label for f in files[:4]] == [0, 0, 1, 1]
    assert all(f.track == -1 and f.box is not None for f in files)


def test_missing_dataset_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(StageError) as info:
        list_split(tmp_path / "nowhere", "train", download=False)
    message = str(info.value)
    assert "GTSRB train split not found" in message
    assert "GTSRB_ROOT" in message and "data.download" in message


def test_real_sample_matches_its_readme(real_gtsrb_root: Path) -> None:
    train = list_split(real_gtsrb_root, "train")
    test = list_split(real_gtsrb_root, "test")
    assert {f.label for f in train} == set(range(43)) == {f.label for f in test}
    assert all(f.box is not None for f in train + test)
    assert len(test) >= 645


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_listing_is_torchvisions_in_its_order(synthetic_gtsrb: Path, split: str) -> None:
    """Read without torchvision (prepare need not import torch), the same files in the same order: the prepared
    splits, and so every figure, stay as they were."""
    from torchvision.datasets import GTSRB

    listed = [(str(f.path), f.label) for f in list_split(synthetic_gtsrb, split)]
    theirs = list(GTSRB(root=str(synthetic_gtsrb), split=split)._samples)
    assert [path for path, _ in listed] == [path for path, _ in theirs]
    if split == "test":
        assert listed == theirs


def test_a_missing_test_csv_is_one_line(synthetic_gtsrb: Path) -> None:
    (synthetic_gtsrb / "gtsrb" / "GT-final_test.csv").unlink()
    with pytest.raises(StageError, match="GTSRB test labels unreadable"):
        list_split(synthetic_gtsrb, "test")


def test_the_demos_prepare_imports_no_torch(synthetic_gtsrb: Path, workdir: Path) -> None:
    """prepare reads, frames and writes images: torch (seconds of imports in every `dvc repro`) is for the stages
    that run a network, or for a library network's pretrained filter (`data.interpolation: auto`)."""
    import subprocess
    import sys

    from tests.helpers.params import write_params_yaml

    write_params_yaml(workdir / "params.yaml", make_params(synthetic_gtsrb, source="gtsrb", image_size=16))
    script = "import sys\nfrom pipeline.config import load_params\nfrom pipeline.stages import prepare\n"
    script += "prepare.run(load_params())\nprint(sorted({'torch', 'torchvision'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    manifest = json.loads((workdir / "data/prepared/manifest.json").read_text())
    assert manifest["subject"]["one"].startswith("traffic sign")  # the source's words reach the model card


@pytest.mark.integration
def test_prepare_on_real_gtsrb(real_gtsrb_root: Path, workdir: Path) -> None:
    prepare.run(make_params(real_gtsrb_root, source="gtsrb"))
    manifest = json.loads(Path("data/prepared/manifest.json").read_text())
    splits = manifest["splits"]
    train, val = read_split("train", Path("data/prepared")), read_split("val", Path("data/prepared"))
    assert manifest["bad_images"]["count"] == 0
    assert splits["test"]["count"] >= 645
    assert all(n > 0 for n in splits["val"]["per_class"])  # every class has a held-out track
    assert not set(train.tracks.tolist()) & set(val.tracks.tolist())
    assert 0.05 < len(val.labels) / (len(train.labels) + len(val.labels)) < 0.2
    # Real photos: the per-channel statistics are those of GTSRB, not of noise.
    assert all(0.2 < m < 0.5 for m in manifest["mean"])


def test_a_csv_with_boxes_gets_the_same_served_crop_as_the_source_that_states_sizes(synthetic_gtsrb: Path) -> None:
    """`crop: auto` from a CSV's boxes: its image sizes come from the files' headers, so the same images and boxes
    as a CSV give the crop the demo's source (which states sizes) gives."""
    from pipeline.data.listing import list_csv
    from pipeline.data.sources import lister

    demo = lister("gtsrb")(synthetic_gtsrb, False)
    rows = ["path,label,group,box,split"]
    for split, files in (("train", demo.train), ("test", demo.test or [])):
        for f in files:
            group = f"{f.label}-{f.track}" if f.track >= 0 else ""
            box = " ".join(map(str, f.box)) if f.box else ""
            rows.append(f"{f.path.relative_to(synthetic_gtsrb)},{f.label},{group},{box},{split}")
    (synthetic_gtsrb / "labels.csv").write_text("\n".join(rows) + "\n")
    listed = list_csv(synthetic_gtsrb / "labels.csv")
    assert all(f.size is None and f.box is not None for f in listed.train)  # a CSV states no sizes
    config = make_params(synthetic_gtsrb, source="gtsrb", crop="auto").data
    crop = prepare.served_crop(listed.train, config)
    assert crop == prepare.served_crop(demo.train, config) and min(crop) > 0
    assert prepare.served_crop(listed.train, config.model_copy(update={"crop": "none"})) == prepare.NO_CROP


def test_the_gtsrb_default_prepares_exactly_what_it_did_before(synthetic_gtsrb: Path, workdir: Path) -> None:
    """The same checksum, crop and validation split as before the data sources existed (pinned from that code)."""
    prepare.run(make_params(synthetic_gtsrb, source="gtsrb"))
    manifest = json.loads(Path("data/prepared/manifest.json").read_text())
    assert manifest["content_sha256"] == "85bd075cea85bef73c5d2aebc562ed5a0dd5e4079727491ba0d594c1598a696f"
    assert manifest["crop"] == [0.0234, 0.0273, 0.0234, 0.0273] and manifest["splits"]["val"]["count"] == 86


def test_the_demos_recipe_and_names_follow_its_source(tmp_path: Path) -> None:
    """`recipe: auto` gives the demo's data its recipe (a 32 px committee of two, a 98.5 % floor); the recipe can also
    be chosen by name for any data; the demo's names are made from the source's own name."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update({"source": "gtsrb", "root": "data/raw"})
    raw["name"] = ""
    for section, key in NAMED_KEYS:
        raw[section][key] = ""
    demo = parse_params(raw)
    assert (demo.recipe, demo.data.image_size, demo.model.name, demo.model.members) == ("gtsrb", 32, "signnet", 2)
    assert demo.evaluate.min_accuracy == 0.985
    assert (demo.augment.rotation, demo.augment.translate, demo.augment.scale, demo.augment.shear) == (10, 0.1, 0.1, 5)
    n = demo.name
    assert (n, demo.serve.model_name, demo.tracking.registered_model_name, demo.containerize.image) == (
        "gtsrb", n, f"{n}-classifier", f"{n}-server")  # fmt: skip
    folder = {**raw, "data": {**raw["data"], "source": "folder", "root": str(tmp_path / "pets")}, "recipe": "gtsrb"}
    forced = parse_params(folder)
    assert (forced.recipe, forced.data.image_size, forced.model.members, forced.name) == ("gtsrb", 32, 2, "pets")
    with pytest.raises(ConfigError, match="name"):
        parse_params({**raw, "name": "Not A Name"})


def test_gtsrb_root_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_params({"data": {"source": "gtsrb", "root": "data/raw"}}).data
    monkeypatch.delenv("GTSRB_ROOT", raising=False)
    assert config.resolved_root() == Path("data/raw")
    monkeypatch.setenv("GTSRB_ROOT", "/elsewhere")
    assert config.resolved_root() == Path("/elsewhere")


def demo_params(folder: Path, download: bool) -> None:
    """The repo's params.yaml into `folder`, tracking off, on the demo source under data/raw (a project made from the
    template may read its own data)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update({"source": "gtsrb", "root": "data/raw", "download": download})
    raw["tracking"]["enabled"] = False
    (folder / "params.yaml").write_text(yaml.safe_dump(raw))


def test_missing_dataset_explains_where_to_get_it_through_the_cli(tmp_path: Path) -> None:
    demo_params(tmp_path, download=False)
    env = {k: v for k, v in __import__("os").environ.items() if k != "GTSRB_ROOT"}
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "prepare"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "GTSRB train split not found under data/raw" in result.stderr
    assert "GTSRB_ROOT" in result.stderr


@pytest.mark.slow
def test_gtsrb_root_elsewhere_than_the_tracked_folder_is_refused_under_dvc(
    tmp_path: Path,
) -> None:
    """$GTSRB_ROOT naming another copy than data/raw (what dvc.yaml tracks) would make DVC blind to its changes:
    prepare refuses in one line that says how to link it."""
    work, env = make_project(tmp_path)
    link_raw_data(work, write_synthetic_gtsrb(tmp_path / "raw-gtsrb"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())  # the demo's source, recipe and names
    params["data"].update({"source": "gtsrb", "root": "data/raw", "download": False})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(env, GTSRB_ROOT=str(write_synthetic_gtsrb(tmp_path / "elsewhere")))
    result = subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode != 0
    line = next(x for x in (result.stdout + result.stderr).splitlines() if "is not the data DVC tracks" in x)
    assert "scripts/raw-data.sh" in line and "Traceback" not in result.stdout + result.stderr
