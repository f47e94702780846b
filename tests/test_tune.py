"""`pipeline tune` on a small real data set (scikit-learn's handwritten digits as a folder of PNGs): trials that
stop early, one MLflow parent with a child per trial, a study that survives kill -9 and is shared by two processes,
and a bad search space refused in one line before any trial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline import tune
from pipeline.config import ConfigError, parse_params
from pipeline.errors import StageError
from tests.helpers import REPO
from tests.helpers.digits import write_digits_folder
from tests.helpers.params import TEST_RECIPE


def digits_params(work: Path, digits: Path, **tune_section: object) -> dict[str, object]:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["recipe"] = str(TEST_RECIPE)  # tiny images: the small-network recipe, not the photos one
    raw["data"].update({"source": "folder", "root": str(digits), "image_size": 8, "download": False})
    raw["model"].update({"width": 8, "members": 1})
    raw["train"].update({"batch_size": 64, "threads": 1})
    raw["tracking"].update({"enabled": True, "uri": f"sqlite:///{work / 'mlflow.db'}", "experiment": "digits"})
    raw["tune"].update({"trials": 3, "epochs": 3, "space": {"train.lr": {"choices": [0.003, 1e-7]}}, **tune_section})
    return raw


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_digits_folder(tmp_path_factory.mktemp("digits") / "digits")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits: Path) -> Path:
    from pipeline.stages import prepare

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv(tune.STORAGE_ENV, raising=False)
    raw = digits_params(work, digits)
    (work / "params.yaml").write_text(yaml.safe_dump(raw))
    prepare.run(parse_params({**raw, "tracking": {"enabled": False}}))
    return work


def test_a_bad_search_space_is_one_line_before_any_trial(project: Path, digits: Path) -> None:
    cases = {
        "unknown key": {"train.learning_rate": {"low": 0.001, "high": 0.01}},
        "tune.space.train.lr": {"train.lr": {"low": 0.001, "high": 50.0}},  # params' own bound: lr <= 10
        "tune.space is empty": {},
    }
    for expected, space in cases.items():
        params = parse_params(digits_params(project, digits, space=space))
        with pytest.raises(StageError) as caught:
            tune.run(params)
        assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match="low < high"):  # an empty range: params.yaml itself is refused
        parse_params(digits_params(project, digits, space={"train.lr": {"low": 0.01, "high": 0.01}}))
    assert not (project / "tune.db").exists()  # nothing was started


def test_three_trials_one_pruned_one_parent_run_with_a_child_each_and_the_winner_as_params(
    project: Path, digits: Path
) -> None:
    import optuna
    from mlflow import MlflowClient

    params = parse_params(digits_params(project, digits))
    study = optuna.create_study(storage=tune.storage_url(params), study_name=tune.study_name(params),
                                direction="maximize")  # fmt: skip
    for lr in (0.003, 1e-7, 0.003):  # the second learns nothing: behind the first at its first epoch
        study.enqueue_trial({"train.lr": lr})
    tune.run(params)

    report = json.loads((project / "reports/tune/study.json").read_text())
    assert report["counts"]["complete"] == 2 and report["counts"]["pruned"] == 1
    pruned = next(t for t in report["trials"] if t["state"] == "pruned")
    assert pruned["params"] == {"train.lr": 1e-7} and pruned["epochs"] == 1  # stopped at once
    assert report["best"]["params"] == {"train.lr": 0.003} and report["best"]["value"] > 0.5
    assert (project / "reports/tune/best.args").read_text().strip() == "-S train.lr=0.003"
    assert yaml.safe_load((project / "reports/tune/best.yaml").read_text()) == {"train.lr": 0.003}
    assert (project / "reports/tune/history.png").is_file()
    assert not (project / "models").exists()  # the trials never touched the pipeline's model

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].data.tags["tune.role"] == "study"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(c.data.tags["tune.state"] for c in children) == ["complete", "complete", "pruned"]
    curve = client.get_metric_history(children[0].info.run_id, "val_accuracy")
    assert len(curve) >= 1
    assert "history.png" in {a.path.split("/")[-1] for a in client.list_artifacts(parents[0].info.run_id, "tune")}


def test_a_new_study_starts_from_the_params_own_recipe(project: Path, digits: Path) -> None:
    """tune.baseline: trial 0 of a new study is params.yaml's own values, reported beside the winner; a value
    outside the space enqueues nothing."""
    raw = digits_params(
        project, digits, trials=1, epochs=1, space={"train.lr": {"low": 0.001, "high": 0.01, "log": True}}
    )
    raw["train"]["lr"] = 0.0042
    tune.run(parse_params(raw))
    report = json.loads((project / "reports/tune/study.json").read_text())
    assert report["trials"][0]["params"] == {"train.lr": 0.0042} and report["trials"][0]["baseline"] is True
    assert report["baseline"]["number"] == 0 and report["baseline"]["value"] == report["best"]["value"]

    raw |= {"tune": {**raw["tune"], "study": "outside", "space": {"train.lr": {"choices": [0.001, 0.01]}}}}
    tune.run(parse_params(raw))
    report = json.loads((project / "reports/tune/study.json").read_text())
    assert report["baseline"] is None and report["trials"][0]["params"]["train.lr"] in (0.001, 0.01)


def _tune_process(work: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "tune"], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _counted(work: Path) -> tuple[int, int]:
    import optuna

    try:
        study = optuna.load_study(study_name="digits-tune", storage=f"sqlite:///{work / 'tune.db'}")
    except KeyError:  # the file exists, the study is not made yet
        return 0, 0
    states = [t.state for t in study.get_trials(deepcopy=False)]
    done = [s for s in states if s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
    return len(done), len(states)


@pytest.mark.slow
def test_a_killed_tune_resumes_its_study(project: Path, digits: Path) -> None:
    """kill -9 of `pipeline tune` during its second trial; the rerun finishes the study: tune.trials counted trials
    in all, the killed one not among them."""
    raw = digits_params(project, digits, trials=3, epochs=8, space={"train.lr": {"low": 0.001, "high": 0.01}})
    raw["tune"]["pruner"] = "none"  # every trial runs its 8 epochs: the kill lands inside the second one
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    process = _tune_process(project)
    assert process.stdout is not None
    # killed the moment the second trial says it started (polling the study raced fast trials on a busy machine)
    output = []
    for line in process.stdout:
        output.append(line)
        if "tune: trial 1: " in line:
            break
    assert "tune: trial 1: " in output[-1], "".join(output)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    counted_then, started_then = _counted(project)
    assert counted_then == 1 and started_then == 2, (counted_then, started_then)
    rerun = _tune_process(project)
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output
    assert f"{counted_then} trial(s) done, {3 - counted_then} to go" in output
    assert _counted(project)[0] == 3


def test_a_new_storage_opened_by_two_at_once_is_made_once_and_opens_for_both(tmp_path: Path) -> None:
    import threading

    # Optuna makes a new store's tables on first open: two openers at once raced there (about 9 rounds in 10 here)
    for round_ in range(6):
        url = f"sqlite:///{tmp_path / f'tune-{round_}.db'}"
        start, failures = threading.Barrier(2), []

        def open_at_once(url: str = url, start: threading.Barrier = start, failures: list[str] = failures) -> None:
            start.wait()
            try:
                tune.open_storage(url)
            except StageError as exc:
                failures.append(str(exc))

        openers = [threading.Thread(target=open_at_once) for _ in range(2)]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join()
        assert failures == [], failures
    with pytest.raises(StageError, match=r"^tune storage postgresql://nobody@127\.0\.0\.1:1/x: cannot be opened"):
        tune.open_storage("postgresql://nobody@127.0.0.1:1/x")  # not a race: one line at once


@pytest.mark.slow
def test_two_tune_processes_share_one_study(project: Path, digits: Path) -> None:
    raw = digits_params(project, digits, trials=4, epochs=4, space={"train.lr": {"low": 0.001, "high": 0.01}})
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    from mlflow import MlflowClient

    # sqlite stores are made by the first client; two processes creating one at once race in MLflow's migrations
    # (several machines use the team stack's server). Made here, as a first `pipeline tune` would.
    MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_experiments()
    first = _tune_process(project)
    time.sleep(1.0)  # the first creates the study; the second loads it
    second = _tune_process(project)
    outputs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert all("tune: trial" in out for out in outputs), outputs  # each ran trials of the one study
    counted, _ = _counted(project)
    assert 4 <= counted <= 5  # tune.trials in all (each process may start one just before the other's last ends)
