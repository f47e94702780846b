"""`pipeline tune`: an Optuna study over `tune.space`, each trial the train stage's own worker with validation held out.

    params.yaml (tune.*) --Optuna (TPE | random; median | hyperband pruner; RDB storage)--> trials
        each trial: params + the trial's values, train.train_on_val false --stages.train.worker--> val accuracy per
        epoch, reported to the trial (a pruned trial stops at once)
    --> reports/tune/{study.json, best.yaml, best.args, history.png, importances.png}; MLflow: one parent run per
        study, a child run per trial (its values, its curve, its state)

The study lives in its storage (sqlite tune.db by default, any database URL: the team stack's PostgreSQL), so a killed
`pipeline tune` resumes it and several processes or machines share it; `tune.trials` counts complete and pruned
trials over all of them. Recipes are chosen on the validation split only: the test files are never read here.
Apply the winner to the whole pipeline with `dvc exp run $(cat reports/tune/best.args)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline import console
from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts.prepared import PREPARED_DIR, read_manifest
from pipeline.config import ConfigError, Params, SearchRange, parse_params
from pipeline.errors import StageError

TUNE_REPORTS = REPORTS_DIR / "tune"
STORAGE_ENV = "PIPELINE_TUNE_STORAGE"
DEFAULT_STORAGE = "sqlite:///tune.db"
STORAGE_ATTEMPTS = 5
STORAGE_RACES = ("already exists", "UNIQUE constraint failed", "duplicate key", "database is locked")
HEARTBEAT_S = 5  # a killed process's running trial is failed once its heartbeat is 2x this old


def storage_url(params: Params) -> str:
    return os.environ.get(STORAGE_ENV) or params.tune.storage or DEFAULT_STORAGE


def study_name(params: Params) -> str:
    return params.tune.study or f"{params.tracking.experiment}-tune"


def with_values(params: Params, values: Mapping[str, Any], source: str = "tune.space") -> Params:
    """`params` with dotted keys set, validated like params.yaml (a value out of a key's bounds: ConfigError)."""
    raw = params.model_dump(mode="json")
    for key, value in values.items():
        section, _, field = key.partition(".")
        raw[section][field] = value
    return parse_params(raw, source)


def check_space(params: Params) -> dict[str, str]:
    """Each key's kind (float | int | choice), or a StageError in one line naming the first bad key, before any
    trial: an unknown key, a section that is not a recipe's, or a bound params itself would refuse."""
    space = params.tune.space
    if not space:
        raise StageError("tune.space is empty: name at least one params key to search (see params.yaml)")
    kinds: dict[str, str] = {}
    current = params.model_dump(mode="json")
    for key, spec in space.items():
        section, _, field = key.partition(".")
        if section not in ("model", "train", "augment", "regularize", "data") or field not in current.get(section, {}):
            raise StageError(
                f"tune.space.{key}: unknown key (use section.key of params.yaml: train.lr, augment.scale ...)"
            )
        value = current[section][field]
        kind = (
            "choice"
            if spec.choices is not None
            else "int"
            if isinstance(value, int) and not isinstance(value, bool)
            else "float"
        )
        probes = spec.choices if spec.choices is not None else [spec.low, spec.high]
        for probe in probes:
            try:
                given = int(probe) if kind == "int" and probe is not None else probe
                with_values(params, {key: given}, f"tune.space.{key}")
            except ConfigError as exc:
                raise StageError(str(exc).splitlines()[0]) from None
        kinds[key] = kind
    return kinds


def suggest(trial: Any, key: str, spec: SearchRange, kind: str) -> Any:
    if kind == "choice":
        return trial.suggest_categorical(key, spec.choices)
    if kind == "int":
        return trial.suggest_int(key, int(spec.low or 0), int(spec.high or 0), log=spec.log)
    return trial.suggest_float(key, float(spec.low or 0.0), float(spec.high or 0.0), log=spec.log)


def open_storage(url: str) -> Any:
    """Optuna's RDB storage at `url`, made on first use. Two processes making one store at once race in its table
    creation (one sees "table ... already exists" or a duplicate schema version): the loser opens it again, made."""
    import optuna

    attempt = 1
    while True:
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=2 * HEARTBEAT_S)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if attempt == STORAGE_ATTEMPTS or not any(race in first for race in STORAGE_RACES):
                raise StageError(f"tune storage {url}: cannot be opened ({first})") from None
        time.sleep(0.2 * attempt)
        attempt += 1


def make_study(params: Params) -> Any:
    import optuna

    t = params.tune
    sampler = (
        optuna.samplers.RandomSampler(seed=t.seed) if t.sampler == "random" else optuna.samplers.TPESampler(seed=t.seed)
    )
    epochs = t.epochs or params.train.epochs
    pruner: Any
    if t.pruner == "median":  # one finished trial is enough to compare with: small budgets are the point here
        pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    elif t.pruner == "hyperband":
        pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=epochs)
    else:
        pruner = optuna.pruners.NopPruner()
    return optuna.create_study(
        storage=open_storage(storage_url(params)),
        study_name=study_name(params),
        direction="maximize",
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )


def enqueue_baseline(study: Any, params: Params, kinds: Mapping[str, str]) -> None:
    """A new study's first trial: params.yaml's own values of the space's keys, when every one lies in the space
    (a choice among the choices, a number within the range)."""
    if not params.tune.baseline or study.get_trials(deepcopy=False):
        return
    current = params.model_dump(mode="json")
    values: dict[str, Any] = {}
    for key, spec in params.tune.space.items():
        section, _, field = key.partition(".")
        value = current[section][field]
        inside = (
            value in (spec.choices or [])
            if kinds[key] == "choice"
            else spec.low is not None and spec.high is not None and spec.low <= value <= spec.high
        )
        if not inside:
            console.log(f"tune: no baseline trial: {key}={value} (params.yaml) is outside tune.space")
            return
        values[key] = value
    # skip_if_exists: a second process starting the same new study at the same moment adds no second copy
    study.enqueue_trial(values, user_attrs={"baseline": True}, skip_if_exists=True)


def counted(study: Any) -> int:
    """Trials that count toward tune.trials: complete and pruned (a failed or killed one does not)."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


@contextlib.contextmanager
def trial_folder(prepared: Path) -> Iterator[Path]:
    """A scratch project for one trial: the prepared data linked in, its model and checkpoints thrown away (the
    pipeline's own models/model.pt is never touched)."""
    with tempfile.TemporaryDirectory(prefix="tune-trial-") as tmp:
        folder = Path(tmp)
        (folder / "data").mkdir()
        (folder / "data" / "prepared").symlink_to(prepared.resolve(), target_is_directory=True)
        here = Path.cwd()
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(here)


class Tracking:
    """One MLflow parent run per study (found again on resume, by tag), a child run per trial."""

    def __init__(self, params: Params, study: str) -> None:
        self.enabled = params.tracking.enabled
        self.parent: str | None = None
        if not self.enabled:
            return
        import mlflow

        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri)
        experiment = mlflow.set_experiment(params.tracking.experiment)
        client = mlflow.MlflowClient()
        found = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`tune.study` = '{study}' and tags.`tune.role` = 'study'"
        )
        if found:
            self.parent = found[0].info.run_id
        else:
            run = client.create_run(experiment.experiment_id, run_name=f"tune {study}",
                                    tags={"tune.study": study, "tune.role": "study"})  # fmt: skip
            self.parent = run.info.run_id
            client.log_param(self.parent, "tune", json.dumps(params.tune.model_dump(mode="json")))
        self.client = client
        self.experiment_id = experiment.experiment_id

    def child(self, number: int, values: Mapping[str, Any]) -> str | None:
        if not self.enabled:
            return None
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial {number}",
            tags={"mlflow.parentRunId": str(self.parent), "tune.study": "child", "tune.trial": str(number)},
        )
        for key, value in values.items():
            self.client.log_param(run.info.run_id, key, value)
        return str(run.info.run_id)

    def epoch(self, run_id: str | None, metrics: Mapping[str, float], step: int) -> None:
        if run_id is not None:
            for key, value in metrics.items():
                self.client.log_metric(run_id, key, float(value), step=step)

    def end(self, run_id: str | None, state: str, value: float | None) -> None:
        if run_id is None:
            return
        self.client.set_tag(run_id, "tune.state", state)
        if value is not None:
            self.client.log_metric(run_id, "best_val_accuracy", value)
        self.client.set_terminated(run_id, "FINISHED" if state != "failed" else "FAILED")

    def finish(self) -> None:
        if self.enabled and self.parent is not None:
            self.client.set_terminated(self.parent, "FINISHED")

    def artifacts(self, folder: Path, best: Mapping[str, Any] | None) -> None:
        if not self.enabled or self.parent is None:
            return
        for path in sorted(folder.iterdir()):
            self.client.log_artifact(self.parent, str(path), "tune")
        if best is not None:
            self.client.log_metric(self.parent, "best_val_accuracy", float(best["value"]))
            for key, value in best["params"].items():
                self.client.set_tag(self.parent, f"best.{key}", str(value))


def objective(params: Params, kinds: Mapping[str, str], tracking: Tracking) -> Any:
    import optuna

    from pipeline.stages import train

    base = with_values(params, {"train.train_on_val": False, "train.checkpoint_every": 0,
                                "train.epochs": params.tune.epochs or params.train.epochs})  # fmt: skip
    prepared = PREPARED_DIR.resolve()

    def run_trial(trial: optuna.Trial) -> float:
        values = {key: suggest(trial, key, params.tune.space[key], kind) for key, kind in kinds.items()}
        trial_params = with_values(base, values)
        run_id = tracking.child(trial.number, values)
        seen: list[float] = []
        console.log(f"tune: trial {trial.number}: {values}")

        def report(metrics: Mapping[str, float], epoch: int) -> None:
            tracking.epoch(run_id, metrics, epoch)
            accuracy = metrics.get("val_accuracy")
            if accuracy is None:
                return
            seen.append(float(accuracy))
            trial.report(float(accuracy), epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"val accuracy {accuracy:.4f} at epoch {epoch}: behind the other trials")

        try:
            with trial_folder(prepared):
                train.worker(0, 1, trial_params, None, report)
        except optuna.TrialPruned:
            console.log(f"tune: trial {trial.number} pruned after {len(seen)} epoch(s) ({seen[-1]:.4f})")
            tracking.end(run_id, "pruned", max(seen) if seen else None)
            raise
        except Exception:
            tracking.end(run_id, "failed", None)
            raise
        value = max(seen) if seen else 0.0
        console.log(f"tune: trial {trial.number} complete: best val accuracy {value:.4f}")
        tracking.end(run_id, "complete", value)
        return value

    return run_trial


def summarize(study: Any, folder: Path) -> dict[str, Any] | None:
    """study.json, best.yaml + best.args (the winner as params), and Optuna's plots; the best trial or None."""
    from optuna.trial import TrialState

    folder.mkdir(parents=True, exist_ok=True)
    trials = [
        {
            "number": t.number,
            "state": t.state.name.lower(),
            "value": t.value,
            "params": t.params,
            "epochs": len(t.intermediate_values),
            "curve": dict(sorted(t.intermediate_values.items())),
            "baseline": bool(t.user_attrs.get("baseline")),
        }
        for t in study.get_trials(deepcopy=False)
    ]
    # the first trial of a new study: params.yaml's recipe (tune.baseline)
    baseline = next(({"number": t["number"], "state": t["state"], "value": t["value"], "params": t["params"]}
                     for t in trials if t["baseline"]), None)  # fmt: skip
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    best = None
    if complete:
        winner = max(complete, key=lambda t: t.value)
        best = {"number": winner.number, "value": winner.value, "params": winner.params}
        (folder / "best.yaml").write_text(yaml.safe_dump(dict(winner.params), sort_keys=True))
        (folder / "best.args").write_text(" ".join(f"-S {k}={v}" for k, v in sorted(winner.params.items())) + "\n")
    counts = {state: sum(t["state"] == state for t in trials) for state in ("complete", "pruned", "fail", "running")}
    summary = {"study": study.study_name, "counts": counts, "best": best, "baseline": baseline, "trials": trials}
    (folder / "study.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if complete:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as plots

        with contextlib.suppress(Exception):  # optional figures: a plotting quirk must not lose the study
            plots.plot_optimization_history(study)
            plt.tight_layout()
            plt.savefig(folder / "history.png", dpi=100)
        plt.close("all")
        if len(complete) >= 2:
            with contextlib.suppress(Exception):
                plots.plot_param_importances(study)
                plt.tight_layout()
                plt.savefig(folder / "importances.png", dpi=100)
            plt.close("all")
    return best


def run(params: Params) -> None:
    import logging

    import optuna

    kinds = check_space(params)  # a bad space: one line, before any trial or storage
    read_manifest(PREPARED_DIR)  # no prepared data: one line naming the command to run
    optuna.logging.set_verbosity(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    study = make_study(params)
    enqueue_baseline(study, params, kinds)
    name = study_name(params)
    tracking = Tracking(params, name)
    done = counted(study)
    remaining = max(0, params.tune.trials - done)
    console.log(f"tune: study {name} in {storage_url(params)}: {done} trial(s) done, {remaining} to go")
    started = time.perf_counter()
    if remaining:
        from optuna.study import MaxTrialsCallback
        from optuna.trial import TrialState

        study.optimize(
            objective(params, kinds, tracking),
            n_trials=remaining,
            timeout=params.tune.timeout_s or None,
            callbacks=[MaxTrialsCallback(params.tune.trials, states=(TrialState.COMPLETE, TrialState.PRUNED))],
            catch=(StageError,),
        )
    best = summarize(study, TUNE_REPORTS)
    tracking.artifacts(TUNE_REPORTS, best)
    tracking.finish()
    summary = json.loads((TUNE_REPORTS / "study.json").read_text())
    counts, baseline = summary["counts"], summary["baseline"]
    if best is None:
        raise StageError(f"tune: no trial completed ({counts}); see {TUNE_REPORTS / 'study.json'}")
    console.log(
        f"tune: {counts['complete']} complete, {counts['pruned']} pruned, {counts['fail']} failed in "
        f"{time.perf_counter() - started:.0f} s; best trial {best['number']}: val accuracy {best['value']:.4f} with "
        f"{best['params']}. Apply it: dvc exp run $(cat {TUNE_REPORTS / 'best.args'})"
    )
    if baseline is not None:
        value = "-" if baseline["value"] is None else f"{baseline['value']:.4f}"
        console.log(f"tune: params.yaml's own recipe was trial {baseline['number']} ({baseline['state']}, val {value})")
