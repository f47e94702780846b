"""The containerize stage: build context and wheelhouse (fast, no engine), the stage without an engine
(one clear line, or skipped by param), and the real image (marked `docker`: built once per session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, parse_params
from pipeline.errors import StageError
from pipeline.ship import context as ctx
from pipeline.ship.docker_engine import NoEngine, find_engine
from tests.helpers import REPO
from tests.ship.conftest import TEST_IMAGE, Image, docker

MAX_IMAGE_MB = 400


# ---- no engine needed --------------------------------------------------------------------------------


def test_params_have_safe_defaults_and_refuse_typos() -> None:
    params = parse_params({})
    assert params.containerize.platforms == ["linux/amd64"]
    assert params.containerize.skip_without_engine == params.deploy.skip_without_engine == "auto"
    assert params.deploy.target == "local"
    with pytest.raises(ConfigError, match=r"containerize\.platfroms: unknown key"):
        parse_params({"containerize": {"platfroms": ["linux/arm64"]}})
    with pytest.raises(ConfigError, match=r"deploy\.target"):
        parse_params({"deploy": {"target": "cloud"}})


def test_serving_requirements_are_locked_and_exclude_torch() -> None:
    wanted = ctx.read_requirements()
    locked = ctx.locked_versions(REPO / "uv.lock")
    assert "onnxruntime" in wanted and "fastapi" in wanted
    assert not {"torch", "torchvision", "torchao", "mlflow", "dvc"} & set(wanted)
    assert all(name in locked for name in wanted)


def test_locked_versions_pick_the_one_for_the_image_interpreter(tmp_path: Path) -> None:
    lock = tmp_path / "uv.lock"
    lock.write_text(
        """
version = 1
requires-python = ">=3.11"

[[package]]
name = "numpy"
version = "2.4.6"
source = { registry = "https://pypi.org/simple" }
resolution-markers = ["python_full_version < '3.12'"]

[[package]]
name = "numpy"
version = "2.5.5"
source = { registry = "https://pypi.org/simple" }
resolution-markers = ["python_full_version >= '3.12'"]

[[package]]
name = "pipeline"
version = "0.1.0"
source = { editable = "." }
"""
    )
    assert ctx.locked_versions(lock) == {"numpy": "2.4.6"}


def test_platform_tags() -> None:
    assert "manylinux_2_28_x86_64" in ctx.platform_tags("linux/amd64")
    assert "manylinux2014_aarch64" in ctx.platform_tags("linux/arm64")
    with pytest.raises(StageError, match="unsupported platform"):
        ctx.platform_tags("linux/s390x")


def test_staged_context_holds_only_what_the_image_needs(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "manifest.json").write_text("{}")
    (models / "fp32-onnx.onnx").write_bytes(b"onnx")
    (models / "model.pt").write_bytes(b"torch weights: not shipped")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    numpy_version = ctx.locked_versions(REPO / "uv.lock")["numpy"]
    (wheels / f"numpy-{numpy_version}-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"w")
    (wheels / "numpy-0.0.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"old")
    (wheels / "requirements.txt").write_text(f"numpy=={numpy_version}\n")
    params_file = tmp_path / "params.yaml"
    params_file.write_text("{}\n")
    model = ctx.ModelChoice("fp32-onnx", "abc", [Path("fp32-onnx.onnx")], 0.5)
    context = tmp_path / "context"
    digest = ctx.stage_context(context, models, model, wheels, params_file, "linux/amd64", tmp_path / "reports")
    files = {str(p.relative_to(context)) for p in context.rglob("*") if p.is_file()}
    assert "Dockerfile" in files and "app/params.yaml" in files
    assert {"app/models/manifest.json", "app/models/fp32-onnx.onnx"} <= files
    assert "app/models/model.pt" not in files
    assert f"wheels/numpy-{numpy_version}-cp311-cp311-manylinux_2_28_x86_64.whl" in files
    assert not any("numpy-0.0.1" in f for f in files)
    assert "app/pipeline/serve/app.py" in files and not any("__pycache__" in f for f in files)
    assert not any(f.startswith("app/benchmarks") or "/bench/" in f for f in files)  # the lab stays out of the image
    # Staging the same inputs again gives the same digest (the build cache depends on it).
    assert ctx.stage_context(context, models, model, wheels, params_file, "linux/amd64", tmp_path / "reports") == digest


def test_the_image_reads_the_resolved_params_without_the_projects_recipe_file(tmp_path: Path) -> None:
    """A recipe of the project's own (`recipe: path/to/yours.yaml`) is applied before the params go into the image:
    the server there reads the same values with no such file beside it."""
    from pipeline.config import load_params, parse_params

    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  image_size: 48\nmodel:\n  members: 3\n")
    params_file = tmp_path / "params.yaml"
    params_file.write_text(f"recipe: {mine}\ndata:\n  source: folder\n  root: pets\n")
    expected = load_params(params_file)
    staged = ctx.resolved_params_yaml(params_file)
    mine.unlink()
    served = parse_params(yaml.safe_load(staged))
    assert (served.data.image_size, served.model.members, served.name) == (48, 3, "pets")
    assert served.model_dump(exclude={"recipe"}) == expected.model_dump(exclude={"recipe"})


def test_the_context_carries_the_model_card_of_the_shipped_variant_only(
    benchmarked_project: Path, tmp_path: Path
) -> None:
    import json

    models, reports = benchmarked_project / "models", benchmarked_project / "reports"
    shipped = json.loads((models / "serving.json").read_text())["variant"]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("")
    card_in = Path("app/reports/model_card.md")
    for variant, expected in ((shipped, True), ("some-other-variant", False)):
        model = ctx.ModelChoice(variant, "abc", [Path("manifest.json")], None)
        context = tmp_path / f"context-{variant}"
        ctx.stage_context(context, models, model, wheels, REPO / "params.yaml", "linux/amd64", reports)
        assert (context / card_in).is_file() is expected
        if expected:
            assert (context / card_in).read_text() == (reports / "model_card.md").read_text()


def _no_engine_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose docker CLI reaches no engine (a socket path where nothing listens)."""
    return {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock", "CI": "true"}


def test_without_an_engine_the_stage_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(NoEngine, match="no Docker engine"):
        find_engine()
    (tmp_path / "params.yaml").write_text("tracking:\n  enabled: false\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "containerize"],
        cwd=tmp_path,
        env=_no_engine_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: no Docker engine") and "skip_without_engine" in proc.stderr


def test_without_an_engine_a_developers_run_skips_in_one_line_and_ci_fails(tmp_path: Path) -> None:
    """skip_without_engine `auto` (the default): on a developer's machine the two stages record a skip, each in one
    line, so the README's one command finishes without a Docker engine; where CI=true the same run fails."""
    (tmp_path / "params.yaml").write_text("tracking: {enabled: false}\n")
    here = {k: v for k, v in _no_engine_env(tmp_path).items() if k != "CI"}
    for stage in ("containerize", "deploy"):
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", stage], cwd=tmp_path, env=here,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        said = [line for line in proc.stderr.splitlines() if "skipped" in line]
        assert len(said) == 1 and f"{stage}: skipped (" in said[0] and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "reports" / "deploy" / "smoke.json").read_text())["skipped"] is True
    ci = subprocess.run([sys.executable, "-m", "pipeline.cli", "containerize"], cwd=tmp_path,
                        env=_no_engine_env(tmp_path), capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert ci.returncode == 2 and ci.stderr.startswith("error: no Docker engine"), ci.stderr


def test_without_an_engine_the_stages_can_be_skipped(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text(
        "tracking: {enabled: false}\ncontainerize: {skip_without_engine: true}\ndeploy: {skip_without_engine: true}\n"
    )
    for stage in ("containerize", "deploy"):
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", stage],
            cwd=tmp_path,
            env=_no_engine_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
    image = json.loads((tmp_path / "reports" / "containerize" / "image.json").read_text())
    assert image["skipped"] is True and "no Docker engine" in image["reason"]
    assert json.loads((tmp_path / "reports" / "deploy" / "smoke.json").read_text())["skipped"] is True


# ---- the real image ----------------------------------------------------------------------------------


def _inspect(ref: str) -> dict:
    return json.loads(docker("image", "inspect", ref).stdout)[0]


@pytest.mark.docker
def test_image_is_small_labelled_non_root_and_stops_on_sigint(built_image: Image) -> None:
    report = built_image.report
    assert report["size_mb"] <= MAX_IMAGE_MB, f"image is {report['size_mb']} MB"
    info = _inspect(built_image.ref)
    config = info["Config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.revision"] == report["revision"]
    assert labels["org.opencontainers.image.version"] == report["model_version"]
    assert "org.opencontainers.image.source" in labels
    assert labels["org.opencontainers.image.title"] == TEST_IMAGE  # the project's names, not the demo's
    assert labels["org.opencontainers.image.description"].startswith(built_image.params.serve.title + ":")
    assert labels["pipeline.model.variant"] == report["variant"]
    assert config["User"] == "10001:10001"
    assert config["StopSignal"] == "SIGINT"
    assert "/v2/health/ready" in " ".join(config["Healthcheck"]["Test"])
    tags = set(info["RepoTags"])
    assert f"{TEST_IMAGE}:{report['revision'][:12]}{'-dirty' if report['dirty'] else ''}" in tags
    assert f"{TEST_IMAGE}:model-{report['model_version']}" in tags


@pytest.mark.docker
def test_image_has_no_training_stack_and_no_compilers(built_image: Image) -> None:
    script = (
        "import importlib.util as u, shutil;"
        "print(sorted(m for m in ('torch','torchvision','mlflow','dvc','onnx') if u.find_spec(m)));"
        "print(sorted(c for c in ('gcc','cc','g++','make','pip') if shutil.which(c)));"
        "import onnxruntime, fastapi, pipeline.serve.app; print('ok')"
    )
    out = docker("run", "--rm", "--entrypoint", "python3", built_image.ref, "-c", script).stdout.split("\n")
    assert out[:3] == ["[]", "[]", "ok"]


@pytest.mark.docker
def test_rebuild_with_nothing_changed_is_fully_cached(built_image: Image) -> None:
    from pipeline.stages import containerize
    from tests.ship.conftest import chdir

    with chdir(built_image.project):
        containerize.run(built_image.params)
    report = json.loads((built_image.project / "reports" / "containerize" / "image.json").read_text())
    arch = report["builds"][0]["platform"].split("/")[1]
    log = (built_image.project / "reports" / "containerize" / f"build-{arch}.log").read_text()
    assert report["id"] == built_image.report["id"]
    assert "Running in" not in log and "Using cache" in log
