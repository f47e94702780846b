"""Fixtures for the container tests (test_containerize.py, test_deploy.py): a Docker engine or a clean skip,
a tiny project whose model went through the real train -> optimize -> benchmark -> evaluate stages, and its server
image built once per session by the real containerize stage.

The base image: $PIPELINE_TEST_BASE_IMAGE, else a debootstrap image built by docker/base-image.sh (no
registry of base images is needed). Building it takes a few minutes the first time on a machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.artifacts.prepared import read_split
from pipeline.config import ConfigError, Params, parse_params
from tests.helpers import REPO
from tests.helpers.params import SYNTHETIC_NAME, TEST_RECIPE

TEST_IMAGE = "gtsrb-server-test"
DEFAULT_TEST_BASE = "local/python:3.11-slim-bookworm"


@contextlib.contextmanager
def chdir(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def engine_or_skip() -> Any:
    from pipeline.ship.docker_engine import NoEngine, find_engine

    try:
        return find_engine()
    except NoEngine as exc:
        if os.environ.get("PIPELINE_REQUIRE_DOCKER"):  # CI started an engine: not finding it is a failure
            pytest.fail(f"PIPELINE_REQUIRE_DOCKER is set but {exc}")
        pytest.skip(f"no Docker engine: {exc}")


def ship_params(**sections: dict[str, Any]) -> Params:
    """Params for the tiny project: small model, tracking off, the test image name and base."""
    raw: dict[str, Any] = {
        "recipe": str(TEST_RECIPE),
        "name": SYNTHETIC_NAME,
        "model": {"name": "signnet", "width": 8},
        "train": {"epochs": 2, "batch_size": 32, "checkpoint_every": 0, "threads": 1},
        "evaluate": {"min_accuracy": 0.0},
        # Only what the image needs: the fp32 ONNX export (no pruning, no int8, no bf16): seconds, not minutes.
        "optimize": {
            "max_accuracy_drop": 1.0,
            "prune_amount": 0.0,
            "finetune_epochs": 0,
            "int8_torch": False,
            "int8_onnx": False,
            "bf16": "off",
            "calibration_images": 64,
        },
        # A brief benchmark: its choice (fp32-onnx, the only ONNX variant) and report make the model card.
        "benchmark": {
            "threads": [0],
            "min_seconds": 0.05,
            "latency_calls": 5,
            "warmup": 1,
            "backends": ["onnxruntime", "torch-eager"],
            "max_accuracy_drop": 1.0,
            "headline_rounds": 1,  # the rounds' median and range: tests/stages/test_benchmark.py
            "profile": False,
        },
        "tracking": {"enabled": False},
        "containerize": {
            "image": TEST_IMAGE,
            "variant": "fp32-onnx",
            "base_image": os.environ.get("PIPELINE_TEST_BASE_IMAGE", DEFAULT_TEST_BASE),
        },
        "deploy": {"ready_timeout_s": 120.0, "container_name": f"{TEST_IMAGE}-{os.getpid()}"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    try:
        return parse_params(raw)
    except ConfigError:
        # The optimize section may not exist yet (or have other keys): drop it and use its defaults.
        raw.pop("optimize", None)
        return parse_params(raw)


def make_project(root: Path) -> Path:
    """A project folder with data/prepared (tiny synthetic), models/ and reports/ from the real stages (prepare's
    writer, then train, optimize, benchmark, evaluate, card), params.yaml."""
    import yaml

    from pipeline.stages import benchmark, card, evaluate, optimize, train
    from tests.helpers.prepared import write_prepared

    root.mkdir(parents=True, exist_ok=True)
    params = ship_params()
    (root / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    write_prepared(root, sizes=(256, 43, 86), image_size=16, originals=True)
    with chdir(root):
        train.run(params)
        optimize.run(params)
        benchmark.run(params)
        evaluate.run(params)
        card.run(params)
    return root


@dataclass
class Image:
    project: Path
    params: Params
    report: dict[str, Any]
    engine: Any

    @property
    def ref(self) -> str:
        return str(self.report["id"])

    def test_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        test = read_split("test", self.project / "data" / "prepared")
        return test.images, test.labels.astype(np.int64)


def build_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    engine = engine_or_skip()
    project = make_project(tmp_path_factory.mktemp("ship") / "project")
    params = ship_params()
    from pipeline.stages import containerize

    with chdir(project):
        containerize.run(params)
    report = json.loads((project / "reports" / "containerize" / "image.json").read_text())
    return Image(project, params, report, engine)


@pytest.fixture(scope="session")
def built_image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    return build_image(tmp_path_factory)


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


@pytest.fixture(scope="session")
def local_registry() -> Iterator[str]:
    """A registry on 127.0.0.1 (docker/registry-up.sh: Debian's docker-registry), stopped afterwards."""
    from pipeline.machine.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        ["bash", str(REPO / "docker" / "registry-up.sh"), address], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        message = f"no local registry could be started: {proc.stderr.strip()[-300:]}"
        if os.environ.get("PIPELINE_REQUIRE_DOCKER"):
            pytest.fail(message)
        pytest.skip(message)
    pid = proc.stdout.strip()
    yield address
    if pid.isdigit():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 15)
            time.sleep(0.2)
