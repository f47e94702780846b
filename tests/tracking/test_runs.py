"""pipeline/tracking/__init__.py: what MLflow prints while a variant is logged."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from pipeline.tracking import quiet_mlflow_logging
from tests.helpers.images import SyntheticImages


def _define_untyped_model() -> None:
    """What models-from-code runs at every log and load: MLflow advises type hints for such a class."""
    from mlflow.pyfunc import PythonModel

    class Untyped(PythonModel):
        def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
            return model_input


def test_mlflows_advice_is_hidden_while_logging_and_other_warnings_are_not() -> None:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_mlflow_logging():
            _define_untyped_model()
            warnings.warn("ours", UserWarning, stacklevel=1)
        hidden = [str(w.message) for w in shown]
        _define_untyped_model()  # outside the context the advice shows (so this test can fail)
        after = [str(w.message) for w in shown]
    assert "ours" in hidden and not any("type hints" in m for m in hidden)
    assert any("type hints" in m for m in after)


def test_a_store_mlflow_refuses_is_one_line_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synthetic_images: SyntheticImages
) -> None:
    """MLFLOW_TRACKING_URI=file:… (MLflow 3 refuses the file store): the stage says so in one line and what to set,
    with no traceback, before it writes anything."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.helpers.params import make_params

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    params = make_params(synthetic_images.folder, tracking=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["prepare"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "MLflow tracking at file:" in result.output and "cannot be used" in result.output
    assert "MLFLOW_TRACKING_URI" in result.output
    assert not (tmp_path / "data" / "prepared").exists()


def test_only_runs_of_the_default_branch_promote_by_default(tmp_path: Path) -> None:
    from pipeline.tracking import why_not_promote

    event = tmp_path / "event.json"
    event.write_text(json.dumps({"repository": {"default_branch": "main"}}))
    ci = {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_PATH": str(event)}
    on_main = {**ci, "GITHUB_EVENT_NAME": "push", "GITHUB_REF": "refs/heads/main", "GITHUB_REF_NAME": "main"}
    assert why_not_promote("auto", on_main, tmp_path) == ""
    assert why_not_promote("auto", {}, tmp_path) == ""  # a run on your machine
    pull_request = {**ci, "GITHUB_EVENT_NAME": "pull_request", "GITHUB_REF": "refs/pull/7/merge"}
    assert "pull request" in why_not_promote("auto", pull_request, tmp_path)
    branch = {**on_main, "GITHUB_REF": "refs/heads/try-lr", "GITHUB_REF_NAME": "try-lr"}
    assert "branch try-lr" in why_not_promote("auto", branch, tmp_path)
    queued = tmp_path / "repo/.dvc/tmp/exps/tmpabc"
    queued.mkdir(parents=True)
    assert "sweep" in why_not_promote("auto", {}, queued)
    assert why_not_promote("always", pull_request, queued) == ""
    assert why_not_promote("never", on_main, tmp_path) != ""
