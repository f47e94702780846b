"""Every file stages hand each other: written and read through its owner module, and one clear StageError for
a missing, foreign or corrupt file (never a traceback, never code run from the file)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.architectures import nets
from pipeline.artifacts import image, predictions, prepared, serving
from pipeline.artifacts import model as model_file
from pipeline.artifacts import variants as variants_file
from pipeline.artifacts.variants import InputSpec, ModelManifest, Preprocess, Variant
from pipeline.errors import StageError
from tests.helpers.prepared import write_prepared


def test_prepared_round_trip_and_checks(tmp_path: Path) -> None:
    folder = write_prepared(tmp_path, sizes=(86, 43, 43), image_size=16)
    manifest = prepared.read_manifest(folder)
    assert manifest.image_size == 16 and manifest.splits["train"].count == 86 and len(manifest.classes) == 43
    test = prepared.read_split("test", folder, image_size=16)
    assert test.images.shape == (43, 16, 16, 3) and test.images.dtype == np.uint8
    assert test.model_input().shape == (43, 3, 16, 16) and test.model_input().flags.c_contiguous
    assert float(test.model_input().max()) <= 1.0
    subset = prepared.read_split("train", folder, limit=10, seed=1)
    assert (
        len(subset) == 10
        and subset.labels.tolist() == prepared.read_split("train", folder, limit=10, seed=1).labels.tolist()
    )
    with pytest.raises(StageError, match=r"test: images are 16 px, expected 24 px"):
        prepared.read_split("test", folder, image_size=24)
    assert not list(tmp_path.glob("data/.prepared-*")), "the staging folder was swapped in, not left behind"


def _arrays(rng: np.random.Generator, n: int, size: int = 8) -> prepared.SplitArrays:
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return prepared.SplitArrays(images, (np.arange(n) % 5).astype(np.uint8), np.arange(n, dtype=np.int32))


def test_shards_stream_and_read_by_row(tmp_path: Path) -> None:
    """Rows go into shards of shard_mb each; the reader returns any rows in any order, across shard borders,
    equal to what was written; the content hash is the in-memory one (independent of the shard size)."""
    rng = np.random.default_rng(0)
    arrays = {"train": _arrays(rng, 1000), "val": _arrays(rng, 30), "test": _arrays(rng, 20)}
    manifest = write_prepared(tmp_path, sizes=(86, 43, 43), image_size=8)  # a valid manifest to start from
    template = prepared.read_manifest(manifest).model_copy(update={"num_classes": 5, "classes": list("abcde")})
    folder = prepared.write(arrays, template, tmp_path / "sharded", shard_mb=64 * 192 / 2**20)  # 64 rows a shard
    written = prepared.read_manifest(folder)
    shards = written.splits["train"].shards
    assert [s.count for s in shards] == [64] * 15 + [40] and shards[3].file == "train/images-00003.npy"
    assert written.content_sha256 == prepared.content_sha256(arrays)
    assert written.splits["train"].per_class == np.bincount(arrays["train"].labels, minlength=5).tolist()
    reader = prepared.SplitReader("train", folder)
    rows = np.array([999, 0, 63, 64, 65, 500, 0, 959, 960])
    assert np.array_equal(reader.take(rows), arrays["train"].images[rows])
    assert np.array_equal(reader.read(60, 70), arrays["train"].images[60:70]) and reader.take([]).shape == (0, 8, 8, 3)
    assert np.array_equal(reader.labels, arrays["train"].labels) and np.array_equal(
        reader.tracks, arrays["train"].tracks
    )
    with pytest.raises(IndexError):
        reader.take([1000])
    reader.verify()
    assert np.array_equal(prepared.read_split("val", folder).images, arrays["val"].images)


class _InMemoryFiles:
    """Another `prepared.Files` (neither on this disk nor in DVC): every file held in memory."""

    def __init__(self, folder: Path) -> None:
        self.blobs = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def where(self, name: str) -> str:
        return f"memory:{name}"

    def read_bytes(self, name: str) -> bytes:
        if name not in self.blobs:
            raise FileNotFoundError(name)
        return self.blobs[name]

    def read_record(self, name: str, schema: type[Any]) -> Any:
        return schema.model_validate_json(self.read_bytes(name))

    def size(self, name: str) -> int:
        return len(self.read_bytes(name))

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        data = self.read_bytes(name)[offset : offset + buffer.nbytes]
        buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        return [self.read_into(name, offset, row) for offset, row in zip(offsets, buffers, strict=True)]

    def close(self) -> None:
        pass


def test_the_reader_reads_any_files_of_the_protocol(tmp_path: Path) -> None:
    """SplitReader asks a copy of data/prepared/ only what `Files` names: a copy held elsewhere reads the same."""
    folder = write_prepared(tmp_path, sizes=(86, 43, 43), image_size=8, shard_mb=32 * 192 / 2**20)
    files = _InMemoryFiles(folder)
    assert prepared.files_of(files) is files and isinstance(prepared.files_of(folder), prepared.LocalFiles)
    assert prepared.read_manifest(files) == prepared.read_manifest(folder)
    rows = [85, 0, 31, 32, 64]
    assert np.array_equal(
        prepared.SplitReader("train", files).take(rows), prepared.SplitReader("train", folder).take(rows)
    )
    assert np.array_equal(prepared.read_split("test", files).images, prepared.read_split("test", folder).images)


def test_prepared_missing_truncated_corrupt_and_foreign(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"manifest.json not found: run `pipeline prepare` first"):
        prepared.read_manifest(tmp_path)
    folder = write_prepared(tmp_path, sizes=(86, 43, 43))
    shard = folder / "test" / "images-00000.npy"
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(StageError, match=r"^shard \S+test/images-00000.npy is missing: run `pipeline prepare`"):
        prepared.read_split("test", folder)
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(StageError, match=r"^shard \S+images-00000.npy is \d+ bytes, expected \d+ \(truncated\?\)"):
        prepared.read_split("test", folder)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(StageError, match=r"^shard \S+images-00000.npy does not match the manifest's SHA-256"):
        prepared.read_split("test", folder)
    shard.write_bytes(data)
    assert len(prepared.read_split("test", folder)) == 43
    (folder / "test" / "labels.npy").unlink()
    with pytest.raises(StageError, match=r"test/labels.npy not found: run `pipeline prepare` first"):
        prepared.read_split("test", folder)
    (folder / "manifest.json").write_text(json.dumps({"image_size": 32}))
    with pytest.raises(StageError, match=r"manifest.json: invalid PreparedManifest"):
        prepared.read_manifest(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(StageError, match=r"manifest.json cannot be read"):
        prepared.read_manifest(folder)


def test_prepared_arrays_never_unpickle(tmp_path: Path) -> None:
    folder = write_prepared(tmp_path, sizes=(86, 43, 43))
    labels = folder / "val" / "labels.npy"
    kept = labels.read_bytes()
    np.save(labels, np.array([object()] * 43, dtype=object), allow_pickle=True)
    with pytest.raises(StageError, match=r"val/labels.npy cannot be read"):
        prepared.read_split("val", folder)
    labels.write_bytes(kept)
    np.save(folder / "val" / "images-00000.npy", np.array([object()] * 43, dtype=object), allow_pickle=True)
    with pytest.raises(StageError, match=r"val/images-00000.npy: images are object \[43\], expected uint8"):
        prepared.SplitReader("val", folder)


class _Payload:
    """Unpickling this would create a marker file: the model reader must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (str(self.marker), "ran"))  # type: ignore[return-value]


def test_model_round_trip_and_a_crafted_file_never_runs(tmp_path: Path) -> None:
    net = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=4).eval()
    arch = nets.arch_kwargs("signnet", 16, 4, 0.2)
    path = model_file.write(tmp_path / "model.pt", arch, [0.5] * 3, [0.25] * 3, ["a"] * 43, net.state_dict())
    loaded, payload = model_file.read(path)
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(loaded(x), net(x)) and payload["classes"] == ["a"] * 43
    model_file.check_against(payload, path, 43, 16)
    with pytest.raises(StageError, match=r"trained at 16x16, the prepared data is 32x32"):
        model_file.check_against(payload, path, 43, 32)

    marker = tmp_path / "marker"
    with (tmp_path / "evil.pt").open("wb") as fh:
        pickle.dump({"arch": _Payload(marker)}, fh)
    with pytest.raises(StageError, match=r"not a model saved by `pipeline train`"):
        model_file.read(tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(StageError, match=r"not found: run `pipeline train` first"):
        model_file.read(tmp_path / "missing.pt")
    torch.save({"weights": {}}, tmp_path / "foreign.pt")
    with pytest.raises(StageError, match=r"expected keys"):
        model_file.read(tmp_path / "foreign.pt")


def _manifest(variants: list[Variant]) -> ModelManifest:
    return ModelManifest(
        architecture="signnet",
        classes=["a"] * 43,
        num_classes=43,
        image_size=16,
        preprocess=Preprocess(roi_margin=0.1, resize=16, mean=[0.5] * 3, std=[0.25] * 3),
        input=InputSpec(name="images", shape=[-1, 3, 16, 16]),
        output=InputSpec(name="logits", shape=[-1, 43]),
        baseline_accuracy=0.9,
        test_images=43,
        max_accuracy_drop=0.005,
        variants=variants,
    )


def _variant(name: str, accepted: bool) -> Variant:
    return Variant(
        name=name,
        file=f"{name}.onnx",
        format="onnx",
        runtimes=["onnxruntime"],
        precision="fp32",
        accuracy=0.9,
        accuracy_drop=0.0,
        size_bytes=1,
        sha256="0" * 64,
        parameters=1,
        accepted=accepted,
    )


def test_variants_publish_moves_only_accepted_files(tmp_path: Path) -> None:
    staging = tmp_path / "models" / "variants.staging"
    staging.mkdir(parents=True)
    (staging / "fp32-onnx.onnx").write_bytes(b"x")
    (staging / "int8-onnx.onnx").write_bytes(b"y")
    published = variants_file.publish(
        staging, _manifest([_variant("fp32-onnx", True), _variant("int8-onnx", False)]), tmp_path / "models"
    )
    assert [p.name for p in (tmp_path / "models" / "variants").iterdir()] == ["fp32-onnx.onnx"]
    assert not staging.exists()
    assert variants_file.read_manifest(tmp_path / "models") == published
    assert published.variant("fp32-onnx").file == "variants/fp32-onnx.onnx"
    with pytest.raises(StageError, match=r"'int8-onnx' was rejected"):
        published.variant("int8-onnx")


@pytest.mark.parametrize("fail_at", range(1, 11))
def test_variants_publish_killed_at_any_step_never_leaves_a_mismatched_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """A kill during publish (simulated: the `fail_at`-th filesystem change raises) leaves the old manifest
    with its own files, or no manifest; never a manifest next to another run's files."""
    import os
    import shutil

    models = tmp_path / "models"

    def publish(content: bytes) -> None:
        staging = models / "variants.staging"
        staging.mkdir(parents=True)
        (staging / "fp32-onnx.onnx").write_bytes(content)
        variant = _variant("fp32-onnx", True).model_copy(update={"sha256": hashlib.sha256(content).hexdigest()})
        variants_file.publish(staging, _manifest([variant]), models)

    publish(b"old")
    calls = {"n": 0}

    def failing(real):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise KeyboardInterrupt("killed")
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Path, "rename", failing(Path.rename))
    monkeypatch.setattr(Path, "replace", failing(Path.replace))
    monkeypatch.setattr(Path, "unlink", failing(Path.unlink))
    monkeypatch.setattr(os, "replace", failing(os.replace))
    monkeypatch.setattr(shutil, "rmtree", failing(shutil.rmtree))
    with contextlib.suppress(KeyboardInterrupt):
        publish(b"new")
    monkeypatch.undo()
    if (models / "manifest.json").exists():
        manifest = variants_file.read_manifest(models)
        entry = manifest.variant("fp32-onnx")
        assert hashlib.sha256((models / entry.file).read_bytes()).hexdigest() == entry.sha256
    publish_again = models / "variants.staging"
    shutil.rmtree(publish_again, ignore_errors=True)
    publish(b"again")  # and the next run recovers from whatever was left
    assert (models / "variants" / "fp32-onnx.onnx").read_bytes() == b"again"
    assert sorted(p.name for p in models.iterdir()) == ["manifest.json", "variants"]


def test_serving_choice_missing_valid_and_foreign(tmp_path: Path) -> None:
    assert serving.read(tmp_path) is None
    choice = serving.ServingChoice(variant="int8-onnx", backend="onnxruntime", metrics={"throughput_b32": 1.0})
    serving.write(choice, tmp_path)
    assert serving.read(tmp_path) == choice
    (tmp_path / serving.SERVING_FILE).write_text(json.dumps({"model": "x"}))
    with pytest.raises(StageError, match=r"serving.json: invalid ServingChoice .*rerun `pipeline benchmark`"):
        serving.read(tmp_path)


def test_predictions_and_image_record(tmp_path: Path) -> None:
    record = predictions.Predictions(
        variant="int8-onnx",
        model_version="0123456789ab",
        classes=["a", "b"],
        labels=[0, 1, 1],
        predicted=[0, 1, 0],
        served_predicted=[0, 0, 0],
    )
    path = predictions.write(record, tmp_path / "predictions.json")
    assert predictions.read(path).accuracy == pytest.approx(2 / 3)
    assert predictions.read(path).served_accuracy == pytest.approx(1 / 3)
    first = predictions.read(path).first(2)
    assert (first.accuracy, first.served_accuracy, first.variant, first.model_version) == (
        1.0, 0.5, "int8-onnx", "0123456789ab"
    )  # fmt: skip
    path.write_text(
        json.dumps({"variant": "x", "model_version": "y", "classes": ["a"], "labels": [0, 0], "predicted": [0]})
    )
    with pytest.raises(StageError, match=r"2 labels but 1 predictions"):
        predictions.read(path)
    with pytest.raises(StageError, match=r"run `pipeline containerize` first"):
        image.read(tmp_path / "image.json")
    built = image.ImageRecord(skipped=False, image="gtsrb-server", tag="gtsrb-server:abc", id="sha256:1")
    assert image.read(image.write(built, tmp_path / "image.json")) == built
    assert not list(tmp_path.glob(".*.tmp-*")), "atomic writes leave no temporary files"
