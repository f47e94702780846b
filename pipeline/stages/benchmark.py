"""The benchmark stage: every accepted variant on every backend this machine has, each measured in its
own subprocess (so oneDNN, thread and fast-math switches apply before import), side by side in one run.

    models/manifest.json --> one worker process per (variant, backend, setting, threads)
        --> reports/benchmark/report.json (machine facts + every result, failures included)
        --> reports/benchmark/table.md (GitHub job summary), results.csv (DVC plots), throughput.png
        --> reports/benchmark/profile.txt (where the chosen variant spends its time)
        --> models/serving.json: the fastest variant x runtime for the server that passed the accuracy gate
            (evaluate's quality gate then decides whether it becomes the registry's `champion`)

`pipeline compare REPORT...` merges reports of several machines (x86 and Arm runners) into one table. The parts
live in pipeline/benchmarking/ (setups, worker, choice, roofline, report, profile).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts import serving as serving_file
from pipeline.artifacts.prepared import MANIFEST_FILE, PREPARED_DIR
from pipeline.benchmarking import worker
from pipeline.benchmarking.choice import choose, headline_rounds, no_servable_setup
from pipeline.benchmarking.profile import profile
from pipeline.benchmarking.report import REPORT_DIR, assemble, compare, served_headline, write_reports
from pipeline.benchmarking.roofline import measure_sgemm
from pipeline.benchmarking.setups import Result, plan
from pipeline.config import Params
from pipeline.console import log
from pipeline.errors import StageError

__all__ = ["compare", "run"]  # compare: `pipeline compare`


def run(params: Params) -> None:
    from pipeline.machine import facts
    from pipeline.runtimes import read_manifest
    from pipeline.tracking import stage_run

    config = params.benchmark
    manifest = read_manifest(MODELS_DIR)
    if not (PREPARED_DIR / MANIFEST_FILE).is_file():
        raise StageError(f"{PREPARED_DIR / MANIFEST_FILE} is missing: run the prepare stage first")
    machine = facts()
    setups, results = plan(manifest, machine, config)
    if not setups:
        raise StageError("no variant/backend combination to benchmark (check benchmark.backends)")
    with stage_run("benchmark", params, {"benchmark": config.model_dump(mode="json")}) as tracker:
        began = time.perf_counter()
        results += worker.time_all(setups, config)
        chosen = choose(results, config)
        rounds = headline_rounds(chosen, results, config)
        sgemm = measure_sgemm(config.min_seconds)
        log(f"benchmark: roofline, fp32 sgemm on all cores (GMAC/s): {json.dumps(sgemm) if sgemm else 'not measured'}")
        report = assemble(machine, config, manifest, results, chosen, rounds, sgemm, time.perf_counter() - began)
        write_reports(report, config)
        if chosen is None:
            raise StageError(no_servable_setup(manifest.variants, config))
        measured = next(v.sha256 for v in manifest.variants if v.name == chosen.setup.variant)
        serving_file.write(serving_file.ServingChoice(**asdict(chosen.setup), metrics=chosen.metrics, sha256=measured))
        if config.profile:
            profile(chosen.setup, manifest, REPORT_DIR / "profile.txt")
        else:  # still written: dvc.yaml declares it, and a stale profile must not pass for this run's
            (REPORT_DIR / "profile.txt").write_text("profiling disabled (benchmark.profile: false)\n")
        _track(tracker, results, report, manifest, chosen)
        log(f"benchmark: serving {chosen.setup.label}, if evaluate's quality gate passes it")


def _track(tracker: Any, results: list[Result], report: dict[str, Any], manifest: Any, chosen: Result) -> None:
    """Every result's figures, the reports and the choice on the stage's MLflow run; the headline on the parent."""
    for r in results:
        if r.status == "ok":
            key = f"{r.setup.variant}.{r.setup.backend}.{r.setup.setting}.t{r.setup.threads}"
            tracker.log_metrics({f"{key}.{k}": v for k, v in r.metrics.items()})
    for name in ("report.json", "table.md", "throughput.png", "profile.txt"):
        tracker.log_artifact(REPORT_DIR / name)
    tracker.set_tags({"chosen": chosen.setup.label})
    tracker.log_headline(served_headline(report, manifest, chosen))
