"""MLflow tracking shared by every stage: one parent run per pipeline execution, one nested run per stage.

The parent is what the MLflow UI compares: it is named after the DVC experiment (`dvc exp run` sets
$DVC_EXP_NAME; found again by it and the baseline commit), else the commit (and `-dirty`; found again by the
commit and a digest of the params), so every stage of one execution joins it, from its own process, after a kill, or when one stage is rerun. It
carries every param (`section.key`) and the headline metrics as the stages produce them (names in
HEADLINE_METRICS, stable for saved views and `mlflow.search_runs`), the dataset as an MLflow dataset input
(digest = the prepared data's checksum), and each stage's wall time (`stage_seconds.<stage>`).

The store is an embedded sqlite file by default (`tracking.uri`, relative to the project: under `dvc exp run
--temp` or a queued experiment, to the main workspace, $DVC_ROOT); $MLFLOW_TRACKING_URI points it at a server
instead. MLflow is imported lazily: it is slow to import and most commands need it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from pipeline.config import Params, TrackingConfig
from pipeline.errors import StageError


def tracking_uri(config: TrackingConfig) -> str:
    """The tracking URI, with a relative sqlite path made absolute: MLflow caches stores by URI string,
    so `sqlite:///mlflow.db` would otherwise keep pointing at the first working directory it was used in."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        # DVC runs queued and --temp experiments in a copy of the repo: their runs belong in the workspace's store.
        base = Path(os.environ.get("DVC_ROOT") or Path.cwd())
        uri = prefix + str(base / uri[len(prefix) :])
    return uri


EXECUTION_TAG = "pipeline.execution"
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # the UI's model-training view
HEADLINE_METRICS = (
    "val_accuracy",  # train: the last epoch's validation accuracy
    "test_accuracy",  # evaluate: on the test split's original files as served (the gate)
    "test_roi_accuracy",  # evaluate: the ROI protocol
    "test_macro_f1",
    "served_accuracy",  # benchmark: the served variant on the served input
    "served_throughput_b32",  # benchmark: images/s at batch 32 of the served variant
    "speedup_b32_vs_default_eager",  # ... against PyTorch's default eager fp32: the median of interleaved rounds
    "speedup_b32_vs_default_eager_low",  # ... and the range of those rounds
    "speedup_b32_vs_default_eager_high",
    "served_p50_ms",
    "served_p99_ms",
    "served_size_bytes",
)


def git_dirty() -> bool:
    try:  # what the stages write themselves (dvc.lock, committed metrics) does not make the code dirty
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!dvc.lock", ":!reports"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def execution(params: Params) -> tuple[str, str]:
    """(key, display name) of the pipeline execution these params belong to."""
    digest = hashlib.sha256(json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:10]
    experiment = os.environ.get("DVC_EXP_NAME")
    if experiment:
        # A DVC experiment's name is unique on its baseline commit: every stage of it, in whatever process or
        # temporary workspace DVC runs it, finds the same parent by that alone.
        return f"exp:{experiment}:{os.environ.get('DVC_EXP_BASELINE_REV', '')[:10]}", experiment
    commit = git_commit()[:10]
    return f"run:{commit}:{digest}", f"{commit}{'-dirty' if git_dirty() else ''} {digest[:6]}"


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

    def __init__(self, mlflow_module: Any | None, client: Any | None = None, parent_id: str | None = None) -> None:
        self._mlflow = mlflow_module
        self._client = client
        self.parent_id = parent_id

    def log_headline(self, metrics: Mapping[str, float], here: bool = True) -> None:
        """Metrics of this stage that also go on the pipeline's parent run (names from HEADLINE_METRICS); `here`
        False when this run already has them (e.g. per epoch)."""
        unknown = set(metrics) - set(HEADLINE_METRICS)
        if unknown:
            raise ValueError(f"not headline metrics: {sorted(unknown)}")
        if here:
            self.log_metrics(metrics)
        if self._client is not None and self.parent_id:
            for key, value in metrics.items():
                self._client.log_metric(self.parent_id, key, float(value))

    def log_dataset(self, name: str, source: Path, digest: str, counts: Mapping[str, int], context: str) -> None:
        """The data this run saw, as an MLflow dataset input (the UI's Dataset column), here and on the parent."""
        if self._mlflow is None:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(
            name=name,
            digest=digest[:36],
            source_type="local",
            source=json.dumps({"uri": str(source.resolve())}),
            profile=json.dumps({"num_rows": sum(counts.values()), **counts}),
        )
        entry = DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])
        run_id = self.run_id
        if self._client is not None:
            for target in (run_id, self.parent_id):
                if target:
                    self._client.log_inputs(target, datasets=[entry])

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
    stage: str, params: Params, logged: Mapping[str, Any] | None = None, system_metrics: bool = False
) -> Iterator[StageRun]:
    """Open the stage's MLflow run (its own params: `logged`), nested under the pipeline execution's parent run."""
    config = params.tracking
    if not config.enabled:
        yield StageRun(None)
        return
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = tracking_uri(config)
    try:
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.set_experiment(config.experiment)
        client = mlflow.MlflowClient(tracking_uri=uri)
        if experiment.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
            client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
        parent_id = _parent_run(client, experiment.experiment_id, params)
    except MlflowException as exc:  # a store MLflow refuses (a file: store, a server that answers an error)
        reason = str(exc).strip().splitlines()[0][:300]
        raise StageError(
            f"MLflow tracking at {uri} cannot be used: {reason} (set MLFLOW_TRACKING_URI to sqlite:///mlflow.db or a "
            "tracking server, or tracking.enabled: false)"
        ) from None
    started = time.perf_counter()
    with mlflow.start_run(run_name=stage, tags={"mlflow.parentRunId": parent_id}, log_system_metrics=system_metrics):
        run = StageRun(mlflow, client, parent_id)
        run.set_tags(
            {
                "stage": stage,
                "git_commit": git_commit(),
                "python": platform.python_version(),
                "machine": platform.machine(),
            }
        )
        if logged:
            run.log_params(flatten("", logged))
        try:
            yield run
        finally:
            client.log_metric(parent_id, f"stage_seconds.{stage}", time.perf_counter() - started)
            client.set_tag(parent_id, "last_stage", stage)
            client.set_terminated(parent_id, "FINISHED")


def _parent_run(client: Any, experiment_id: str, params: Params) -> str:
    """The execution's parent run: found by its tag, else created with every param."""
    from mlflow.entities import Param

    key, name = execution(params)
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{EXECUTION_TAG}` = '{key}'", max_results=1, order_by=["start_time ASC"]
    )
    if found:
        run_id: str = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = {EXECUTION_TAG: key, "git_commit": git_commit(), "mlflow.runName": name}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc_experiment"] = os.environ["DVC_EXP_NAME"]
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    flat = [Param(k, str(v)[:6000]) for k, v in flatten("", params.model_dump(mode="json")).items()]
    for start in range(0, len(flat), 100):  # the store takes at most 100 params per batch
        client.log_batch(run.info.run_id, params=flat[start : start + 100])
    return str(run.info.run_id)


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


def _registry(params: Params) -> tuple[Any, str] | None:
    """(MlflowClient, registered model name), or None when tracking is off."""
    if not params.tracking.enabled:
        return None
    import mlflow

    return mlflow.MlflowClient(tracking_uri=tracking_uri(params.tracking)), params.tracking.registered_model_name


def champion_version(params: Params) -> Any | None:
    """The registered model's version that the `champion` alias points at, or None (no registry, no alias yet)."""
    registry = _registry(params)
    if registry is None:
        return None
    import mlflow

    client, name = registry
    try:
        return client.get_model_version_by_alias(name, "champion")
    except mlflow.exceptions.MlflowException:
        return None


def why_not_promote(policy: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
    """Why evaluate's passed gate must not move `champion` on this run ("" when it may): evaluate.promote `never`;
    with `auto`, a pull request or another branch than the default one in GitHub Actions, or a queued / temporary
    DVC experiment (a sweep). `always` moves it wherever the gate passed; `pipeline promote` moves it by hand."""
    env = os.environ if env is None else env
    if policy == "always":
        return ""
    if policy == "never":
        return "evaluate.promote is never"
    if env.get("GITHUB_ACTIONS") == "true":
        event = env.get("GITHUB_EVENT_NAME", "")
        if event.startswith("pull_request"):
            return "a pull request's run"
        default = _default_branch(env.get("GITHUB_EVENT_PATH", ""))
        branch = env.get("GITHUB_REF_NAME", "")
        if env.get("GITHUB_REF", "").startswith("refs/heads/") and default and branch != default:
            return f"a run on branch {branch}, not the default branch {default}"
    where = (cwd or Path.cwd()).resolve().as_posix()
    if "/.dvc/tmp/exps/" in where + "/":
        return "a queued or temporary DVC experiment (a sweep)"
    return ""


def _default_branch(event_path: str) -> str:
    """The repository's default branch, from the GitHub event's payload ("" when it does not say)."""
    try:
        event = json.loads(Path(event_path).read_text())
    except (OSError, ValueError):
        return ""
    repository = event.get("repository") if isinstance(event, dict) else None
    return str(repository.get("default_branch") or "") if isinstance(repository, dict) else ""


def set_champion(params: Params, variant: str, sha256: str) -> str | None:
    """Point the registry alias `champion` at the newest registered version of this variant file; its number."""
    registry = _registry(params)
    if registry is None:
        return None
    import mlflow

    client, name = registry
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except mlflow.exceptions.MlflowException:
        return None
    matching = [v for v in versions if v.tags.get("variant") == variant and v.tags.get("sha256", sha256) == sha256]
    if not matching:
        return None
    version = max(matching, key=lambda v: int(v.version))
    client.set_registered_model_alias(name, "champion", version.version)
    return str(version.version)


def promote(params: Params, version: str = "", variant: str = "", sha256: str = "") -> str:
    """`pipeline promote`: point `champion` at registered `version`, or at the newest registered version of this
    variant file; its number. A StageError names what is missing."""
    registry = _registry(params)
    if registry is None:
        raise StageError("tracking.enabled is false: there is no registry whose champion to move")
    import mlflow

    client, name = registry
    if not version:
        moved = set_champion(params, variant, sha256)
        if moved is None:
            raise StageError(f"{name} has no registered version of {variant} (sha256 {sha256[:12]})")
        return moved
    try:
        client.get_model_version(name, version)
    except mlflow.exceptions.MlflowException:
        raise StageError(f"{name} has no version {version}") from None
    client.set_registered_model_alias(name, "champion", version)
    return version


MODEL_DEFINITION = Path(__file__).parent / "mlflow_model.py"  # models-from-code: loading imports, never unpickles


def log_variant_model(models_dir: Path, variant: Any, example: bytes, metadata: Mapping[str, Any]) -> Any:
    """Log shipped `variant` (a manifest Variant) of `models_dir` as an MLflow model of the active run, defined by
    pipeline/tracking/mlflow_model.py: the registry's model classifies image files as the server does. Returns mlflow's
    ModelInfo (`model_uri`, `model_id`)."""
    import shutil
    import tempfile
    from importlib.metadata import version

    import mlflow
    import pandas as pd
    from mlflow.models import infer_signature

    from pipeline.runtimes import RUNTIME_BACKENDS

    runtimes = RUNTIME_BACKENDS[variant.runtimes[0]].requirements  # what the variant's first backend imports
    requirements = [f"{n}=={version(n)}" for n in ("numpy", "pillow", "pandas", "pydantic", "pyyaml", *runtimes)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "models"  # the manifest and this one variant file, at the manifest's relative path
        (folder / variant.file).parent.mkdir(parents=True)
        shutil.copy2(models_dir / variant.file, folder / variant.file)
        shutil.copy2(models_dir / "manifest.json", folder / "manifest.json")
        named = Path(tmp) / "variant.json"
        named.write_text(json.dumps({"variant": variant.name}))
        example_input = pd.DataFrame({"image": [example]})
        example_output = pd.DataFrame({"class_id": [0], "class_name": ["0"], "probability": [1.0]})
        with quiet_mlflow_logging():
            return mlflow.pyfunc.log_model(
                name=variant.name,
                python_model=str(MODEL_DEFINITION),
                artifacts={"models": str(folder), "variant": str(named)},
                code_paths=[str(MODEL_DEFINITION.parent)],
                signature=infer_signature(example_input, example_output),
                input_example=example_input,
                pip_requirements=requirements,
                metadata={"variant": variant.name, "sha256": variant.sha256, **metadata},
            )


@contextmanager
def quiet_mlflow_logging() -> Iterator[None]:
    """MLflow's advice that does not apply to a logged variant, kept out of the stage's output (about ten lines
    per variant): the integer `class_id` column hint, the untyped `predict` (on purpose: the signature is
    logged), pip's version in a uv project, the input-example check and the artifact download bars. Errors
    still show."""
    import logging
    import warnings
    from unittest import mock

    import mlflow

    loggers = [logging.getLogger(n) for n in ("mlflow.utils.environment", "mlflow.utils.uv_utils", "mlflow.pyfunc")]
    levels = [lg.level for lg in loggers]
    package = str(Path(mlflow.__file__).parent)
    with warnings.catch_warnings(), mock.patch.dict(os.environ, {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
        # Not a warnings filter: MLflow's own `filter_user_warnings_once` puts "once" in front of any filter
        # while it logs, so its UserWarnings are dropped where they are shown (catch_warnings restores this).
        show = warnings.showwarning

        def show_unless_mlflows(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if not (issubclass(category, UserWarning) and filename.startswith(package)):
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_unless_mlflows
        try:
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)
