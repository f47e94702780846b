"""Shared fixtures: small synthetic labelled images (and the demo's layout of them), the real sample when configured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import parse_params
from tests.helpers import DATA_ROOT_ENVS, REPO
from tests.helpers.images import SyntheticImages, write_synthetic_images
from tests.helpers.once import built_once
from tests.helpers.params import on_test_data

# `make test` runs the suite on three pytest-xdist workers: a file stays on one worker (its module fixtures are built
# once), the tests that drive the Docker engine share one worker (image tags, the registry), the tests of files
# without module fixtures whose tests are each a whole pipeline run spread one by one, and the longest files start
# first so that no worker waits alone at the end.
ENGINE_TESTS = (
    "tests/ship/",
    "tests/test_template.py::test_a_generated_project_runs_on_its_own_folder_of_images_through_deploy",
)
ACT_TESTS = ("tests/test_act.py", "tests/demo/test_pipeline_workflow.py")  # one act run at a time
ONE_BY_ONE = ("tests/test_dvc.py",)
pytest_plugins = ["tests.helpers.cpu_time"]

LONGEST_FIRST = ("tests/tracking/test_team_stack.py", "tests/ship/", "tests/test_dvc.py", "tests/demo/test_pipeline_workflow.py",
                 "tests/test_act.py",
                 "tests/test_template.py", "tests/test_tune.py", "tests/stages/test_optimize.py",
                 "tests/benchmarks/test_gpu.py", "tests/stages/test_train")  # fmt: skip
# Every `dvc` command would start a second interpreter to send its usage report (offline here): the suite runs hundreds.
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers' subprocesses share the cores: OpenMP threads that spin while waiting would take them from the other,
    # and a second thread per process mostly waits for a core the other workers hold (docs/ci.md: the same tests cost
    # less CPU and wall time with one). Every stage, runtime and server reads OMP_NUM_THREADS (usable_cpus).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole files to a worker, the Docker engine's tests as one."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(ENGINE_TESTS):
                return "docker-engine"
            if nodeid.startswith(ACT_TESTS):
                return "act"
            return nodeid if nodeid.startswith(ONE_BY_ONE) else nodeid.split("::", 1)[0]

    return ByFile(config, log)


def _file_of(item: pytest.Item) -> str:
    return str(Path(str(item.fspath)).relative_to(REPO))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = _file_of(item)
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: within a file, the file's own order


@pytest.fixture
def synthetic_images(tmp_path: Path) -> SyntheticImages:
    """The tests' data: a folder of class folders (train/, test/) and a CSV over the same files with boxes."""
    return write_synthetic_images(tmp_path / "raw")


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project directory as the working directory (stages write relative to it)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for variable in DATA_ROOT_ENVS:  # a source's other copy (CI's sample) is for the tests that ask for it
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return work


# The project's real sample (the template: the demo's, tests/helpers/demo.py): these skip where there is none.
@pytest.fixture(scope="session")
def real_sample_data() -> tuple[str, Path]:
    """(data.source, data.root) of a small real data set."""
    pytest.skip("no real sample data in this project")


@pytest.fixture(scope="session")
def real_sample_test_files() -> list[Path]:
    """The real sample's test image files, as users send them."""
    pytest.skip("no real sample data in this project")


@pytest.fixture(scope="session")
def real_photo_folder() -> Path:
    """A folder of real photos (class folders; JPEG and PNG, several sizes, some grey) made from the sample."""
    pytest.skip("no real sample data in this project")


@pytest.fixture(scope="session")
def real_sample_trained(real_sample_data: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder after the real prepare -> train (6 epochs, batch 64) on the real sample, made once for the
    tests that need a model of real images (copy it: `shutil.copytree(..., symlinks=True)`)."""
    source, root = real_sample_data

    def build(base: Path) -> None:
        import contextlib

        import yaml

        from pipeline.stages import prepare, train

        work = base / "project"
        work.mkdir()
        raw = yaml.safe_load((REPO / "params.yaml").read_text())
        raw["data"].update({"source": source, "root": str(root.resolve()), "download": False})
        # Two threads, however many the workers run: the thread count orders the sums, so it picks the model the
        # real-sample tests' figures and the drift test's blurred stream were measured on.
        raw["train"].update({"epochs": 6, "batch_size": 64, "checkpoint_every": 0, "threads": 2})
        raw["tracking"] = {"enabled": False}
        (work / "params.yaml").write_text(yaml.safe_dump(raw))
        with contextlib.chdir(work):
            prepare.run(parse_params(raw))
            train.run(parse_params(raw))

    return built_once(tmp_path_factory, "real-sample-trained", build) / "project"


@pytest.fixture(scope="session")
def real_sample_optimized(real_sample_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """real_sample_trained after the real optimize stage (no pruning, 256 calibration images; the default gate):
    fp32, its ONNX export, both int8 variants, judged on the real test files. Made once for the int8 test and the
    drift test (copy it before changing anything)."""

    def build(base: Path) -> None:
        import contextlib
        import shutil

        import yaml

        from pipeline.stages import optimize

        work = base / "project"
        shutil.copytree(real_sample_trained, work, symlinks=True)
        raw = yaml.safe_load((work / "params.yaml").read_text())
        raw["optimize"] = {"prune_amount": 0.0, "calibration_images": 256}
        (work / "params.yaml").write_text(yaml.safe_dump(raw))
        with contextlib.chdir(work):
            optimize.run(parse_params(raw))

    return built_once(tmp_path_factory, "real-sample-optimized", build) / "project"


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder after the real prepare -> train -> optimize stages on the tests' synthetic images:
    data/prepared, models/ (manifest + ONNX variants), as the server, benchmark and container consume. Shared by
    the workers: read it, or copy it."""

    def build(base: Path) -> None:
        import contextlib

        import yaml

        from pipeline.stages import optimize, prepare, train

        images = write_synthetic_images(base / "raw", groups_per_class=3, frames_per_group=3, test_per_class=3)
        work = base / "project"
        work.mkdir()
        # the CSV over the images: its boxes give a served crop and its groups a split by object, as real data has
        params = on_test_data(yaml.safe_load((REPO / "params.yaml").read_text()), images.csv, "csv")
        params.setdefault("model", {}).update({"name": "signnet", "width": 8})
        params.setdefault("train", {}).update({"epochs": 3, "batch_size": 64, "checkpoint_every": 0, "nproc": 1})
        # A tiny model: the gates are tested elsewhere. Every variant ships, whatever the CPU kind does to int8 (ONNX
        # Runtime's int8 kernels and weight range differ by instruction set, and a few gate images move in points).
        params.setdefault("optimize", {}).update(
            {"prune_amount": 0.0, "int8_torch": False, "calibration_images": 64, "max_accuracy_drop": 1.0}
        )
        params["evaluate"]["min_accuracy"] = 0.0
        params["tracking"] = {"enabled": False}
        (work / "params.yaml").write_text(yaml.safe_dump(params))
        parsed = parse_params(params)
        with contextlib.chdir(work):
            prepare.run(parsed)
            train.run(parsed)
            optimize.run(parsed)

    return built_once(tmp_path_factory, "tiny-project", build) / "project"


@pytest.fixture(scope="session")
def benchmarked_project(tiny_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_project after the real benchmark stage, briefly timed (models/serving.json, reports/benchmark/), the
    evaluate stage on the variant it chose (reports/evaluate/) and the card stage (reports/model_card.md). Shared
    by the workers: read it, or copy it."""

    def build(base: Path) -> None:
        import contextlib
        import shutil

        import yaml

        from pipeline.stages import benchmark, card, evaluate

        work = base / "project"
        shutil.copytree(tiny_project, work, symlinks=True)
        raw = yaml.safe_load((work / "params.yaml").read_text())
        raw["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1,
                            "backends": ["onnxruntime", "torch-eager"], "max_accuracy_drop": 0.05,
                            "headline_rounds": 2}  # fmt: skip
        (work / "params.yaml").write_text(yaml.safe_dump(raw))
        with contextlib.chdir(work):
            benchmark.run(parse_params(raw))
            evaluate.run(parse_params(raw))
            card.run(parse_params(raw))

    return built_once(tmp_path_factory, "benchmarked-project", build) / "project"


if (Path(__file__).parent / "helpers" / "demo.py").is_file():  # the template's demo data set: its real fixtures
    from tests.helpers.demo import *  # noqa: F403
