"""Prepared shards read straight from a DVC remote on a real S3 server (SeaweedFS): a clone with no `dvc pull`
reads the rows it asks for by ranged reads, and trains the same weights as a run on the local folder."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.artifacts import prepared
from pipeline.errors import StageError
from tests.helpers.params import train_params
from tests.helpers.prepared import write_prepared
from tests.helpers.project import GIT_IDENTITY, run
from tests.helpers.s3 import KEYS, weed_s3

pytestmark = pytest.mark.slow

DVC = [sys.executable, "-m", "dvc"]


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with weed_s3() as endpoint:
        yield endpoint


@pytest.fixture
def pushed(s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A DVC project whose data/prepared (6 training shards) is pushed to the S3 remote, and a clone of it with
    nothing pulled."""
    for key, value in KEYS.items():
        monkeypatch.setenv(key, value)
    env = {**os.environ, **GIT_IDENTITY}
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo, env)
    run([*DVC, "init", "-q"], repo, env)
    write_prepared(repo, shard_mb=48 * 768 / 2**20)  # 48 images of 16 px a shard
    run([*DVC, "add", "-q", "data/prepared"], repo, env)
    for args in (["add", "-d", "team", f"s3://dvc/{tmp_path.name}"], ["modify", "team", "endpointurl", s3]):
        run([*DVC, "remote", *args], repo, env)
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-qm", "prepared data on the team remote"], repo, env)
    run([*DVC, "push", "-q"], repo, env)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], tmp_path, env)
    return repo, clone


def test_a_clone_reads_rows_straight_from_the_remote(pushed: tuple[Path, Path]) -> None:
    repo, clone = pushed
    local = repo / "data" / "prepared"
    files = prepared.DvcRemoteFiles(str(clone))
    reader = prepared.SplitReader("train", files)
    assert len(reader._shards) == 6 and np.array_equal(reader.labels, prepared.SplitReader("train", local).labels)
    rows = np.random.default_rng(0).permutation(len(reader))[:40]
    assert np.array_equal(reader.take(rows), prepared.SplitReader("train", local).take(rows))
    assert all(url.startswith("s3://dvc/") for url in files._urls.values()), "a batch's rows as concurrent ranges"
    cached = prepared.DvcRemoteFiles(str(repo))  # its DVC cache holds the shards (dvc add): read there, not remotely
    assert np.array_equal(
        prepared.SplitReader("train", cached).take(rows), prepared.SplitReader("train", local).take(rows)
    )
    assert cached._urls and set(cached._urls.values()) == {""}
    reader.verify()
    assert np.array_equal(prepared.read_split("test", files).images, prepared.read_split("test", local).images)
    assert not (clone / "data" / "prepared").exists(), "nothing was pulled into the clone"
    cache = clone / ".dvc" / "cache"
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*")), "nor into its cache"


def test_a_shard_gone_from_the_remote_is_one_line_naming_it(pushed: tuple[Path, Path]) -> None:
    _, clone = pushed
    files = prepared.DvcRemoteFiles(str(clone))
    reader = prepared.SplitReader("train", files)
    reader.take([0])
    shard = reader._shards[-1].name
    files._remote_of(shard)
    files._remote.rm(files._urls[shard])  # lost on the remote after the run opened it
    with pytest.raises(StageError, match=rf"shard data/prepared/{shard} .*cannot be read from s3://"):
        reader.take([len(reader) - 1])


def test_bench_remote_read_measures_both_ways_on_the_same_rows(pushed: tuple[Path, Path], capsys) -> None:
    remote_read = pytest.importorskip("benchmarks.remote_read", reason="the lab (benchmarks/) is not in this project")

    _, clone = pushed
    assert remote_read.main(["--repo", str(clone), "--batches", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "16 px rows in 6 shards" in out and "concurrent ranges:" in out and "one read a row:" in out
    assert not (clone / "data" / "prepared").exists()


def test_training_from_the_remote_learns_what_the_local_folder_teaches(
    pushed: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.artifacts import model as model_file
    from pipeline.stages import train

    repo, clone = pushed
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(repo)
    train.run(train_params(epochs=1, checkpoint_every=0))
    local = torch.load(model_file.MODEL_PATH, map_location="cpu", weights_only=True)["state_dict"]
    monkeypatch.chdir(clone)
    train.run(train_params(epochs=1, checkpoint_every=0, data_from="dvc-remote"))
    remote = torch.load(model_file.MODEL_PATH, map_location="cpu", weights_only=True)["state_dict"]
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)
    assert not (clone / "data" / "prepared").exists()


def test_nothing_to_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.stages import train

    monkeypatch.chdir(tmp_path)  # no DVC project here: nothing to read, said in one line before any process starts
    with pytest.raises(StageError, match=r"^data/prepared/manifest.json \(DVC remote of \.\) cannot be read"):
        train.run(train_params(data_from="dvc-remote"))
