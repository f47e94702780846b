"""MLflow tracking shared by every stage: one run per stage execution.

The store is an embedded sqlite file by default (`tracking.uri`); $MLFLOW_TRACKING_URI points it at a
server instead. MLflow is imported lazily: it is slow to import and most commands need it once.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.config import TrackingConfig


def tracking_uri(config: TrackingConfig) -> str:
    """The tracking URI, with a relative sqlite path made absolute: MLflow caches stores by URI string,
    so `sqlite:///mlflow.db` would otherwise keep pointing at the first working directory it was used in."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        uri = prefix + str(Path.cwd() / uri[len(prefix) :])
    return uri


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """{'data': {'image_size': 32}} -> {'data.image_size': 32} for mlflow.log_params."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else str(key), inner))
        return out
    return {prefix: value}


class StageRun:
    """What a stage may log; every method is a no-op when tracking is disabled."""

    def __init__(self, mlflow_module: Any | None) -> None:
        self._mlflow = mlflow_module

    @property
    def active(self) -> bool:
        return self._mlflow is not None

    @property
    def run_id(self) -> str | None:
        if self._mlflow is None:
            return None
        run = self._mlflow.active_run()
        return run.info.run_id if run else None

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._mlflow is not None:
            self._mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._mlflow is not None:
            self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._mlflow is not None and path.exists():
            self._mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self._mlflow is not None:
            self._mlflow.set_tags(dict(tags))


@contextmanager
def stage_run(
    stage: str, config: TrackingConfig, params: Mapping[str, Any] | None = None, system_metrics: bool = False
) -> Iterator[StageRun]:
    """Open one MLflow run named after the stage, tagged with the environment it ran in."""
    if not config.enabled:
        yield StageRun(None)
        return
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(config))
    mlflow.set_experiment(config.experiment)
    with mlflow.start_run(run_name=stage, log_system_metrics=system_metrics):
        run = StageRun(mlflow)
        run.set_tags(
            {
                "stage": stage,
                "git_commit": git_commit(),
                "python": platform.python_version(),
                "machine": platform.machine(),
            }
        )
        if params:
            run.log_params(flatten("", params))
        yield run


def metrics_logger(config: TrackingConfig, run_id: str | None) -> Callable[[Mapping[str, float], int], None]:
    """log_metrics(metrics, step) into an existing run from another process (e.g. a training worker
    spawned by the stage that opened the run); a no-op when tracking is off or there is no run."""
    if not config.enabled or run_id is None:
        return lambda metrics, step: None
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri(config))

    def log(metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            client.log_metric(run_id, key, float(value), step=step)

    return log
