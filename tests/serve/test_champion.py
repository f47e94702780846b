"""Which registered version the server runs, when the registry cannot say (the champion itself is served and checked
in tests/stages/test_evaluate.py, after a worse run failed its gate)."""

from __future__ import annotations

import os

import pytest

from pipeline.config import parse_params
from pipeline.errors import StageError
from pipeline.machine.ports import free_port
from pipeline.serve import champion


def test_a_tracking_server_that_does_not_answer_names_no_version_and_leaves_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    params = parse_params({"tracking": {"enabled": True}})
    assert champion.registered_as(params, "a" * 64) is None
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the quick try is only for the lookup


def test_no_store_here_is_no_version_and_no_new_store(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = f"{tmp_path}/mlflow.db"
    params = parse_params({"tracking": {"enabled": True, "uri": f"sqlite:///{store}"}})
    assert champion.registered_as(params, "a" * 64) is None
    assert not os.path.exists(store)  # the server never creates a store


def test_serving_the_champion_needs_the_registry() -> None:
    with pytest.raises(StageError, match="--champion needs the model registry"):
        champion.download_champion(parse_params({"tracking": {"enabled": False}}))
