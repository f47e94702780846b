"""The train stage: a tiny run through the CLI, exact resume after kill -9, corrupt checkpoints,
2-process DDP and FSDP on CPU, and resuming with another number of processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import read_manifest
from pipeline.cli import app
from pipeline.config import Params, parse_params
from pipeline.data.loader import load_split
from pipeline.errors import StageError
from pipeline.stages import train
from pipeline.training import checkpoint as ckpt
from pipeline.training.budget import TimeBudget
from pipeline.training.loop import KILL_AFTER_STEP_ENV
from tests.helpers import REPO
from tests.helpers.params import train_params, write_params_yaml
from tests.helpers.prepared import replace_split, write_prepared


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    write_prepared(work)
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(KILL_AFTER_STEP_ENV, raising=False)
    return work


def weights(path: Path = model_file.MODEL_PATH) -> dict[str, torch.Tensor]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    return payload["state_dict"]


def checkpoints(params: Params) -> Path:
    """This params' checkpoint folder (one per params + data fingerprint), relative to the project."""
    return Path("models/checkpoints") / ckpt.fingerprint(params, read_manifest(Path("data/prepared")))


def run_killed(params: Params, after_step: int, cwd: Path, pace: dict[int, float] | None = None) -> None:
    """`pipeline train` in a subprocess that SIGKILLs itself right after `after_step` (`pace`: as `paced`)."""
    write_params_yaml(cwd / "params.yaml", params)
    env = {**os.environ, KILL_AFTER_STEP_ENV: str(after_step), "PYTHONPATH": str(REPO)}
    command = ["-m", "pipeline.cli", "train", "-p", "params.yaml"]
    if pace is not None:
        command = ["-c", f"from tests.stages.test_train import paced\npaced({pace!r})\n"
                   "from pipeline.cli import app\napp(['train', '-p', 'params.yaml'])"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def test_tiny_run_through_the_cli_with_mlflow(project: Path) -> None:
    params = train_params()  # validation held out: how recipes are chosen
    raw = params.model_dump(mode="json")
    raw["tracking"] = {"enabled": True, "uri": "sqlite:///mlflow.db", "experiment": "test"}
    # Brief optimize and benchmark settings: evaluate (below) measures the variant the benchmark chose.
    raw["optimize"] = {"prune_amount": 0.0, "finetune_epochs": 0, "int8_torch": False, "bf16": "off",
                       "calibration_images": 64, "max_accuracy_drop": 1.0}  # fmt: skip
    raw["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1,
                        "backends": ["onnxruntime"], "max_accuracy_drop": 1.0, "profile": False}  # fmt: skip
    write_params_yaml(project / "params.yaml", parse_params(raw))
    result = CliRunner().invoke(app, ["train", "-p", "params.yaml"])
    assert result.exit_code == 0, result.output
    payload = torch.load(model_file.MODEL_PATH, weights_only=True)
    assert payload["arch"]["name"] == "signnet"
    assert "normalize.mean" in payload["state_dict"]
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    assert metrics["steps"] == 16 and 0.0 <= metrics["val_accuracy"] <= 1.0
    history = (project / "reports/train/history.csv").read_text().splitlines()
    assert history[0] == "epoch,train_loss,val_accuracy,lr,images_per_s" and len(history) == 3
    assert (project / "reports/train/curves.png").exists()

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    (run,) = [r for r in runs if r.data.tags.get("stage") == "train"]
    (parent,) = [r for r in runs if r.info.run_id == run.data.tags["mlflow.parentRunId"]]
    assert run.data.params["train.epochs"] == "2"
    # The pipeline's parent run: every param, the headline metric, the data it saw.
    assert parent.data.params["train.epochs"] == "2" and "data.image_size" in parent.data.params
    assert (
        parent.data.metrics["val_accuracy"] == metrics["val_accuracy"] and "stage_seconds.train" in parent.data.metrics
    )
    prepared = json.loads((project / "data/prepared/manifest.json").read_text())
    assert [d.dataset.digest for d in parent.inputs.dataset_inputs] == [prepared["content_sha256"][:36]]
    assert run.data.tags["device"] == "cpu" and run.data.tags["torch"] == torch.__version__
    assert len(client.get_metric_history(run.info.run_id, "val_accuracy")) == 2
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert "model/model.pt" in artifacts

    for stage in ("optimize", "benchmark", "evaluate"):
        result = CliRunner().invoke(app, [stage, "-p", "params.yaml"])
        assert result.exit_code == 0, result.output
    assert (project / "reports/evaluate/metrics.json").exists()
    # evaluate, a separate command, joined the same parent and rolled its headline up to it.
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert len([r for r in runs if "mlflow.parentRunId" not in r.data.tags]) == 1
    (evaluated,) = [r for r in runs if r.data.tags.get("stage") == "evaluate"]
    assert evaluated.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert "test_accuracy" in client.get_run(parent.info.run_id).data.metrics


def test_the_shipped_model_trains_on_validation_too(project: Path) -> None:
    """train.train_on_val (a recipe's choice for the model it ships): every labelled image is a training image, and
    no figure pretends that validation was held out."""
    counts = {s: len(load_split(s)) for s in ("train", "val")}
    params = train_params(checkpoint_every=0, train_on_val=True)
    raw = params.model_dump(mode="json")
    raw["tracking"] = {"enabled": True, "uri": "sqlite:///mlflow.db", "experiment": "test"}
    write_params_yaml(project / "params.yaml", parse_params(raw))
    result = CliRunner().invoke(app, ["train", "-p", "params.yaml"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    images = counts["train"] + counts["val"]
    assert metrics["train_images"] == images and metrics["validation"] == "trained on"
    assert metrics["steps"] == 2 * (images // params.train.batch_size) and metrics["val_accuracy"] is None
    history = (project / "reports/train/history.csv").read_text().splitlines()
    assert [row.split(",")[2] for row in history[1:]] == ["", ""]  # no validation column to misread
    saved = ckpt.latest(checkpoints(params))  # the loader drew its batches from train + val
    assert saved is not None and saved.state["loader"]["num_samples"] == images

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    (run,) = [r for r in runs if r.data.tags.get("stage") == "train"]
    assert "val_accuracy" not in run.data.metrics and "final_val_accuracy" not in run.data.metrics
    assert run.data.metrics["train_seconds"] > 0
    assert "validation trained on" in result.output


def test_kill_9_then_resume_gives_the_weights_of_an_uninterrupted_run(project: Path, tmp_path: Path) -> None:
    params = train_params()
    run_killed(params, after_step=5, cwd=project)  # checkpoint at step 3, killed in the middle of epoch 1
    assert [p.name for p in checkpoints(params).iterdir()] == ["step_00000003"]
    assert not model_file.MODEL_PATH.exists()
    train.run(params)
    assert json.loads((checkpoints(params) / "step_00000016/trainer.json").read_text())["step"] == 16
    resumed = weights()

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write_prepared(fresh)
    os.chdir(fresh)
    train.run(params)
    uninterrupted = weights()
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_a_corrupt_checkpoint_is_named_and_never_used(project: Path) -> None:
    params = train_params(epochs=1)
    train.run(params)
    latest = project / checkpoints(params) / "step_00000008"
    shard = next(latest.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(StageError, match=r"checkpoint .*step_00000008 is corrupt: .*truncated"):
        train.run(params)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(StageError, match=r"step_00000008 is corrupt: .*SHA-256"):
        train.run(params)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_a_tampered_and_resealed_checkpoint_never_runs_code(project: Path, tmp_path: Path) -> None:
    """Checksums prove a folder is whole, not that its sealer is trusted: a hostile `.metadata` pickle, sealed
    anew so every checksum matches, is refused by the metadata loader, and the marker file never appears."""
    import pickle

    from pipeline.training import checkpoint as ckpt

    params = train_params(epochs=1)
    train.run(params)
    latest = project / checkpoints(params) / "step_00000008"
    marker = tmp_path / "code-ran"
    (latest / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    state = json.loads((latest / "trainer.json").read_text())
    partial = latest.with_name(latest.name + ".partial")
    latest.rename(partial)
    (partial / ckpt.MARKER).unlink()
    ckpt.seal(partial, state)  # re-sealed: the checksums now match the tampered file
    with pytest.raises(StageError, match=r"cannot be loaded .*not allowed"):
        train.run(params)  # resumes from it
    assert not marker.exists()


def test_a_marker_with_the_wrong_shape_is_a_clear_error(project: Path) -> None:
    params = train_params(epochs=1)
    train.run(params)
    latest = project / checkpoints(params) / "step_00000008"
    for bad in ('{"files": {"trainer.json": {"bytes": 1}}}', '{"files": []}', "[]", '{"files": {"../x": 1}}'):
        (latest / "COMPLETE.json").write_text(bad)
        with pytest.raises(StageError, match=r"step_00000008 is corrupt: COMPLETE.json is not a checkpoint marker"):
            train.run(params)


def test_interrupted_save_is_ignored_and_other_params_start_over(project: Path) -> None:
    params = train_params(epochs=1)
    train.run(params)
    (checkpoints(params) / "step_00000009.partial").mkdir()  # killed while saving
    train.run(params)  # resumes from the complete step 8: nothing left to train
    changed = train_params(epochs=1, lr=0.001)
    train.run(changed)  # other params: trains from scratch in its own folder, the first run's kept
    state = json.loads((checkpoints(changed) / "step_00000008/trainer.json").read_text())
    assert state["fingerprint"] == ckpt.fingerprint(changed, read_manifest(Path("data/prepared")))
    assert not (checkpoints(params) / "step_00000009.partial").exists()
    assert (checkpoints(params) / "step_00000008/COMPLETE.json").exists()
    changed_weights = weights()
    train.run(params)  # back to the first params: resumes its finished run, nothing trained
    assert json.loads((project / "reports/train/metrics.json").read_text())["steps"] == 8
    assert not all(torch.equal(a, b) for a, b in zip(changed_weights.values(), weights().values(), strict=True))
    for lr in (0.002, 0.0015):  # two more runs: only the two most recent other folders stay
        train.run(train_params(epochs=1, lr=lr))
    kept = {p.name for p in Path("models/checkpoints").iterdir()}
    assert checkpoints(params).name not in kept and checkpoints(changed).name in kept and len(kept) == 3


def test_missing_data_is_a_stage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StageError, match="run `pipeline prepare` first"):
        train.run(train_params())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_with_another_number_of_processes(project: Path, strategy: str) -> None:
    """One process killed after its checkpoint at step 3, then the same run on two processes (gloo on the CPU)
    resumes it to the end: each process writes its shard of the checkpoint, the run's record says two processes."""
    params = train_params()
    run_killed(params, after_step=5, cwd=project)  # one process, checkpoint at step 3
    train.run(train_params(nproc=2, strategy=strategy))  # resumes at global sample 3 * 32 on 2 processes
    state = json.loads((checkpoints(params) / "step_00000016/trainer.json").read_text())
    assert state["step"] == 16 and state["world_size"] == 2 and state["strategy"] == strategy
    assert state["loader"] == {"epoch": 2, "offset": 0, "seed": 0, "global_batch_size": 32, "num_samples": 256}
    assert [e["epoch"] for e in state["history"]] == [1, 2]
    assert len(list((checkpoints(params) / "step_00000016").glob("*.distcp"))) == 2
    assert len(weights()) > 0
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 16


def test_logit_adjustment_lets_a_rare_class_win_back_its_share(project: Path) -> None:
    """Classes 0 and 1 look alike; class 0 is 5x as common. Plain training learns the prior (class 1 gets
    ~1/6 of the two-way probability); with train.logit_adjustment = 1 the model's logits are balanced,
    so class 1 gets about half."""
    import numpy as np

    rng = np.random.default_rng(0)
    labels = np.array([0] * 200 + [1] * 40, dtype=np.uint8)
    images = np.clip(rng.normal(128, 30, size=(240, 16, 16, 3)), 0, 255).astype(np.uint8)
    replace_split(project / "data/prepared", "train", images, labels)
    probe = torch.from_numpy(np.clip(rng.normal(128, 30, size=(64, 16, 16, 3)), 0, 255).astype(np.float32) / 255)

    def rare_share(tau: float) -> float:
        train.run(train_params(epochs=6, logit_adjustment=tau, augment=False, checkpoint_every=0))
        payload = torch.load(model_file.MODEL_PATH, map_location="cpu", weights_only=True)
        from pipeline.architectures import nets

        model = nets.build_from_arch(payload["arch"], payload["mean"], payload["std"])
        model.load_state_dict(payload["state_dict"])
        with torch.no_grad():
            p = model.eval()(probe.permute(0, 3, 1, 2)).softmax(1)
        return float((p[:, 1] / (p[:, 0] + p[:, 1])).mean())

    plain, adjusted = rare_share(0.0), rare_share(1.0)
    assert plain < 0.3
    assert adjusted > plain + 0.15


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])  # sgd also catches a mis-scaled member gradient
def test_each_committee_member_learns_exactly_as_it_would_alone(project: Path, optimizer: str) -> None:
    """model.members = 2: member 0 is built first from the same seed and sees the same batches and dropout
    draws, and its gradient comes from its own loss only, so it ends with the single network's weights."""
    train.run(train_params(checkpoint_every=0, optimizer=optimizer))
    alone = weights()
    single_parameters = json.loads(Path("reports/train/metrics.json").read_text())["parameters"]
    raw = train_params(checkpoint_every=0, optimizer=optimizer).model_dump(mode="json")
    raw["model"]["members"] = 2
    train.run(parse_params(raw))
    payload = torch.load(model_file.MODEL_PATH, map_location="cpu", weights_only=True)
    assert payload["arch"]["members"] == 2
    committee = payload["state_dict"]
    for name, tensor in alone.items():
        torch.testing.assert_close(committee[f"members.0.{name}"], tensor, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(committee["members.1.features.0.weight"], alone["features.0.weight"])
    assert json.loads(Path("reports/train/metrics.json").read_text())["parameters"] == 2 * single_parameters


def test_a_time_budget_plans_the_epochs_that_fit_after_the_first(project: Path, capsys: pytest.CaptureFixture) -> None:
    """train.max_minutes (as Ultralytics' `time`): after the first epoch the run trains the epochs that fit at that
    pace, at least one and at most train.epochs, and says so; the schedule then anneals over the planned epochs."""
    train.run(train_params(epochs=6, max_minutes=0.0001, checkpoint_every=0))  # far less than one epoch
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    assert (metrics["epochs"], metrics["steps"], metrics["max_minutes"]) == (1, 8, 0.0001)
    assert len((project / "reports/train/history.csv").read_text().splitlines()) == 2  # header + one epoch
    assert "so 1 of train.epochs' 6 fit in train.max_minutes=0.0001" in capsys.readouterr().err.replace("\n", " ")
    # A generous budget changes nothing: every epoch, and the weights of a run without one.
    train.run(train_params(epochs=2, max_minutes=600, checkpoint_every=0))
    budgeted = weights()
    assert json.loads((project / "reports/train/metrics.json").read_text())["epochs"] == 2
    train.run(train_params(epochs=2, checkpoint_every=0))
    assert all(torch.equal(budgeted[k], v) for k, v in weights().items())
    assert (TimeBudget(1, 6).fits(25.0), TimeBudget(1, 6).fits(7.0)) == (2, 6)


def test_the_budget_is_planned_again_after_every_epoch_at_the_mean_pace(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """One slow first epoch (another program busy, the first steps' warm-up) does not decide the run: after every
    epoch the plan is made again from the mean of the epochs so far, never below the epochs done, and said when it
    changes; the schedule anneals over the last plan."""
    assert [TimeBudget(1, 6).fits(seconds, done) for seconds, done in ((45.0, 1), (25.0, 2), (30.0, 3))] == [1, 2, 3]
    capsys.readouterr()
    assert TimeBudget(1, 6, planned=5).fits(12.0, 2, main=True) == 5 and not capsys.readouterr().err
    assert TimeBudget(1, 6, planned=5).fits(10.0, 2, main=True) == 6
    assert "an epoch takes 10 s here (the mean of 2), so 6 of" in capsys.readouterr().err.replace("\n", " ")
    real = TimeBudget.fits
    calls: list[tuple[float, int, int | None]] = []

    def planned(budget: TimeBudget, seconds: float, done: int = 1, world: int = 1, main: bool = False) -> int:
        calls.append((seconds, done, budget.planned))
        return real(budget, {1: 30.0, 2: 20.0}.get(done, 20.0), done, world, main)  # 2 epochs fit, then 3

    monkeypatch.setattr(TimeBudget, "fits", planned)
    params = train_params(epochs=6, max_minutes=1, checkpoint_every=0)
    train.run(params)
    assert [(done, before) for _, done, before in calls] == [(1, None), (2, 2), (3, 3)]
    assert all(seconds > 0 for seconds, _, _ in calls)
    history = (project / "reports/train/history.csv").read_text().splitlines()[1:]
    assert len(history) == 3 and json.loads((project / "reports/train/metrics.json").read_text())["epochs"] == 3
    assert float(history[-1].split(",")[3]) < 0.02 * params.train.lr  # annealed over the last plan's three


def test_the_planned_epochs_anneal_the_schedule_and_stay_in_the_checkpoint(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TimeBudget, "fits", lambda *_: 2)  # the pace's plan, made deterministic
    params = train_params(epochs=6, max_minutes=1, checkpoint_every=3)
    train.run(params)
    history = (project / "reports/train/history.csv").read_text().splitlines()[1:]
    assert len(history) == 2
    last_lr = float(history[-1].split(",")[3])
    assert last_lr < 0.02 * params.train.lr  # the cosine's end on the second epoch, not a sixth of the way
    saved = ckpt.latest(checkpoints(params))
    assert saved is not None and saved.state["step"] == 16 and saved.state["budget"]["planned"] == 2


def paced(pace: dict[int, float], monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Every epoch of the time budget takes `pace[epoch]` seconds (10 when not given), whatever the clock says: plans
    that do not depend on this machine's speed (in a subprocess, without `monkeypatch`, for good)."""
    real = TimeBudget.after_epoch

    def after_epoch(budget: TimeBudget, done: int, seconds: float, world: int = 1, main: bool = True) -> int:
        return real(budget, done, pace.get(done, 10.0), world, main)

    if monkeypatch is None:
        TimeBudget.after_epoch = after_epoch  # type: ignore[method-assign]
    else:
        monkeypatch.setattr(TimeBudget, "after_epoch", after_epoch)


def test_a_run_killed_mid_budget_resumes_to_the_epochs_an_uninterrupted_one_plans(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time budget's state (the finished epochs' seconds, the last plan) is in every checkpoint: killed in the
    middle of epoch 2, when the plan says 2 epochs and would say 3 after it, the resumed run anneals over 2, plans 3
    after epoch 2, and ends with the epochs, schedule and weights of a run never interrupted."""
    pace = {1: 30.0, 2: 10.0}  # in 1 minute: 60 / 30 = 2 epochs after the first; 60 / 20 = 3 after the second
    params = train_params(epochs=6, max_minutes=1)
    run_killed(params, after_step=13, cwd=project, pace=pace)  # checkpoint at step 12: epoch 2, half done
    saved = json.loads((checkpoints(params) / "step_00000012/trainer.json").read_text())
    assert saved["format"] == 2 and saved["budget"] == {"seconds": 30.0, "planned": 2}
    paced(pace, monkeypatch)
    train.run(params)
    resumed, history = weights(), (project / "reports/train/history.csv").read_text()
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    assert (metrics["epochs"], metrics["steps"]) == (3, 24)

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write_prepared(fresh)
    os.chdir(fresh)
    train.run(params)
    assert json.loads((fresh / "reports/train/metrics.json").read_text())["epochs"] == 3
    uninterrupted_history = (fresh / "reports/train/history.csv").read_text()
    assert [row.split(",")[3] for row in history.splitlines()] == [
        row.split(",")[3] for row in uninterrupted_history.splitlines()
    ]  # the same schedule
    uninterrupted = weights()
    assert resumed.keys() == uninterrupted.keys()
    for key in resumed:
        assert torch.equal(resumed[key], uninterrupted[key]), key


def test_early_stopping_keeps_its_best_epoch_through_a_resume(project: Path) -> None:
    """The best epoch's weights and its counters are in the checkpoint: rerunning a finished run (a resume with
    nothing left to train) writes the model and figures of the run itself, not its last epoch's."""
    params = train_params(epochs=3, early_stopping_patience=5, checkpoint_every=0)
    train.run(params)
    first, metrics = weights(), json.loads((project / "reports/train/metrics.json").read_text())
    assert metrics["best_epoch"] in (1, 2, 3)
    saved = ckpt.latest(checkpoints(params))
    assert saved is not None and saved.state["early_stopping"]["best_epoch"] == metrics["best_epoch"]
    assert (saved.folder / ckpt.BEST_WEIGHTS).exists()
    train.run(params)
    again = json.loads((project / "reports/train/metrics.json").read_text())
    assert (again["best_epoch"], again["best_val_accuracy"]) == (metrics["best_epoch"], metrics["best_val_accuracy"])
    assert all(torch.equal(first[k], v) for k, v in weights().items())


def test_a_checkpoint_of_the_format_before_sections_still_resumes(project: Path) -> None:
    """trainer.json of format 1 (flat planned_epochs, budget_seconds, stopped_early; no `format`) resumes; a format
    this version does not know is refused with a message, not a traceback."""
    params = train_params(epochs=1)
    train.run(params)
    latest = project / checkpoints(params) / "step_00000008"
    state = json.loads((latest / "trainer.json").read_text())
    old = {k: v for k, v in state.items() if k not in ("format", "budget", "early_stopping")}
    old |= {"stopped_early": False, "planned_epochs": None, "budget_seconds": 0.0}

    def reseal(trainer_state: dict[str, Any]) -> None:
        partial = latest.with_name(latest.name + ".partial")
        latest.rename(partial)
        (partial / ckpt.MARKER).unlink()
        ckpt.seal(partial, trainer_state)

    reseal(old)
    train.run(params)  # resumes the finished run: nothing trained, the same figures
    metrics = json.loads((project / "reports/train/metrics.json").read_text())
    assert metrics["steps"] == 8 and metrics["epochs"] == 1
    reseal({**state, "format": 99})
    with pytest.raises(StageError, match=r"step_00000008 is in trainer-state format 99, which this train stage"):
        train.run(params)
