"""A throwaway git + DVC copy of the project, for tests that run the real `dvc repro` / `dvc exp run`."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import REPO
from tests.helpers.images import write_synthetic_images
from tests.helpers.params import on_test_data

GIT_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def run_dvc_queue(work: Path, env: dict[str, str], *options: str, timeout: float = 1800) -> str:
    """`dvc queue start OPTIONS` and wait until the queue is empty; `dvc queue status` then. The queue's detached worker
    holds the command's output open until it stops after its last experiment, so reading that output to its end waits
    without polling (each `dvc queue status` is a second of CPU: a poll every few seconds cost minutes over a sweep).
    A worker whose own idle check misses its shutdown stays up with nothing to do (seen once under load, both
    experiments done): from two minutes on, a status every 45 s, and an idle queue's worker is stopped."""
    dvc = [sys.executable, "-m", "dvc"]
    start = subprocess.Popen([*dvc, "queue", "start", *options], cwd=work, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)  # fmt: skip
    deadline = time.monotonic() + timeout

    def stop_worker() -> str:
        subprocess.run([*dvc, "queue", "stop", "--kill"], cwd=work, env=env, capture_output=True, timeout=120)
        start.kill()
        return start.communicate(timeout=30)[0]

    wait = 120.0
    while True:
        try:
            output, _ = start.communicate(timeout=min(wait, max(1.0, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            status = run([*dvc, "queue", "status"], work, env)
        if time.monotonic() >= deadline:
            stop_worker()
            raise AssertionError(f"the queue was not empty after {timeout:.0f} s: {status}") from None
        if "0 active" in status and not re.search(r"\b(Queued|Running)\b", status):  # done: the worker is idle
            subprocess.run([*dvc, "queue", "stop"], cwd=work, env=env, capture_output=True, timeout=120)
            try:
                output, _ = start.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                output = stop_worker()
            break
        wait = 45.0
    assert start.returncode in (0, -9), output
    return run([*dvc, "queue", "status"], work, env)


def make_project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh git + DVC copy of the project on the tests' small synthetic images, linked at data/raw (the tests
    that need real images say so: `real_sample_data`)."""
    work = tmp_path / "project"
    work.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore", "uv.lock"):  # what a clone has
        shutil.copy(REPO / name, work / name)
    shutil.copytree(REPO / "pipeline", work / "pipeline")  # with its bytecode (make test compiles it)
    images = write_synthetic_images(tmp_path / "raw")
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    link_raw_data(work, images.folder)
    params = on_test_data(yaml.safe_load((work / "params.yaml").read_text()), "data/raw")
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    run(["git", "init", "-q"], work, env)
    run([sys.executable, "-m", "dvc", "init", "-q"], work, env)
    return work, env


def link_raw_data(work: Path, root: Path) -> None:
    """data/raw, the folder dvc.yaml tracks (`${data.root}`), as a link to `root`, as users link a copy elsewhere."""
    raw = work / "data" / "raw"
    raw.parent.mkdir(parents=True, exist_ok=True)
    if raw.is_symlink():
        raw.unlink()
    raw.symlink_to(root.resolve(), target_is_directory=True)


def tiny_pipeline_params(work: Path) -> None:
    """A small model and a short benchmark: the whole chain to the card in about a minute."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["model"].update({"name": "signnet", "width": 8, "members": 1})
    params["train"].update({"epochs": 4, "batch_size": 64, "checkpoint_every": 5, "nproc": 1})
    # A four-epoch model: no floor, and the comparative gate as loose as optimize's (the gate has its own tests).
    params["evaluate"].update({"min_accuracy": 0.0, "max_drop": 0.05})
    params["optimize"].update({"prune_amount": 0.0, "int8_torch": False, "calibration_images": 64,
                               "max_accuracy_drop": 0.05})  # fmt: skip
    # One headline round: the rounds' median and range have their own test (tests/stages/test_benchmark.py).
    params["benchmark"].update({"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1, "headline_rounds": 1,
                                "backends": ["onnxruntime"], "max_accuracy_drop": 0.05, "profile": False})  # fmt: skip
    params["tracking"]["enabled"] = False
    (work / "params.yaml").write_text(yaml.safe_dump(params))


def with_network(trained: Path, work: Path, source: str, file: str = "nets/toy.py") -> dict[str, Any]:
    """`work`: `trained`'s prepared data and params, with a network of the project's own (`source` written to
    `file`, named `file:build`, one member, one epoch); its raw params."""
    shutil.copytree(trained / "data", work / "data", symlinks=True)
    (work / file).parent.mkdir(parents=True)
    (work / file).write_text(source)
    raw = yaml.safe_load((trained / "params.yaml").read_text())
    raw["model"].update({"name": f"{file}:build", "members": 1})
    raw["train"].update({"epochs": 1})
    return raw
