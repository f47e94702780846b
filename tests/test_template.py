"""The repository as a copier template (copier.yml, .copier/template_names.py): `copier copy` with other names and a
folder data set writes a project whose names are its own, whose own tests and `dvc repro` run, and `copier update`
merges a later template commit into a project its users changed. Template-only: not copied into projects."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.project import GIT_IDENTITY

ANSWERS = {
    "project_name": "acme-vision",
    "model_name": "acme",
    "image_name": "acme-server",
    "registry": "ghcr.io/acme",
    "registered_model_name": "acme-classifier",
    "experiment": "acme-runs",
    "api_title": "Acme part classifier",
    "description": "Acme parts from camera images to a served model",
    "data_source": "folder",
}

# A project without the demo (folder or CSV data) holds no demo file, test, CI step or passage of the manual: no file
# says "gtsrb" (the manual's demo blocks and measured-results pages are left out: .copier/template_names.py).
MEASURED = ["docs/results.md", "docs/results-history.md"]
# The demo's names themselves (not the data source's), named where a generated project still holds one.
DEMO_NAMES = re.compile(
    r"gtsrb-(server|classifier|pipeline|platform|train|checkpoints)|/models/gtsrb\b|model_name: gtsrb\b|"
    r"experiment: gtsrb\b|GTSRB traffic-sign classifier|GTSRB MLOps",
    re.IGNORECASE,
)
TEMPLATE_ONLY = [
    ".ci/run",
    "copier.yml",
    ".copier/template_names.py",
    "tests/test_template.py",
    "CHANGELOG.md",
    "tests/test_release.py",
]


def git(*args: str, cwd: Path) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_IDENTITY}, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def copier(*args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COPIER_")} | GIT_IDENTITY
    result = subprocess.run([sys.executable, "-m", "copier", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def template_repo(dest: Path, tag: str = "v0.0.1") -> Path:
    """The template as a git repository with one tagged commit: the files git knows here (tracked, and new ones
    not ignored), as they are on disk, so that uncommitted edits are what is tested."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    git("init", "-q", "-b", "main", cwd=dest)
    git("add", "-A", cwd=dest)
    git("commit", "-q", "-m", "template", cwd=dest)
    git("tag", tag, cwd=dest)
    return dest


def generate(template: Path, dest: Path, ref: str, **answers: str) -> Path:
    data = [arg for key, value in answers.items() for arg in ("--data", f"{key}={value}")]
    copier(
        "copy", "--trust", "--defaults", "--quiet", "--vcs-ref", ref, *data, str(template), str(dest), cwd=dest.parent
    )
    return dest


def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return template_repo(tmp_path_factory.mktemp("template"))


def test_a_generated_project_has_its_own_names(template: Path, tmp_path: Path) -> None:
    """Other names and a folder data set: every name is the project's, the demo is gone ("gtsrb" is left only in the
    template's manual), params.yaml validates with the generated package, and the project's own config, layout,
    prepare and data-source tests pass."""
    project = generate(template, tmp_path / "acme", "v0.0.1", **ANSWERS, data_root="data/parts")
    files = files_of(project)
    assert not set(TEMPLATE_ONLY) & set(files) and not any("{{" in name for name in files)
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] == "v0.0.1" and answers["_src_path"] == str(template)
    assert {k: answers[k] for k in ANSWERS} == ANSWERS and answers["data_root"] == "data/parts"

    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["data"] == params["data"] | {"source": "folder", "root": "data/parts", "download": False}
    assert params["serve"]["model_name"] == "acme"
    assert params["containerize"]["image"] == "acme-server" and params["deploy"]["container_name"] == "acme-server"
    assert params["deploy"]["registry"] == "ghcr.io/acme"
    assert params["tracking"] == params["tracking"] | {
        "experiment": "acme-runs",
        "registered_model_name": "acme-classifier",
    }
    assert 'description = "Acme parts from camera images to a served model"' in (project / "pyproject.toml").read_text()
    assert '  title: "Acme part classifier"' in (project / "params.yaml").read_text()
    assert (project / "README.md").read_text().startswith("# acme-vision\n")
    assert "name: acme-server\n" in (project / "deploy/k8s/deployment.yaml").read_text()
    assert "kubectl set image deployment/acme-server" in (project / ".github/workflows/release.yml").read_text()
    # The measurement lab is the template's: a project asks for it (copier's `lab` question).
    assert not any(name.startswith(("benchmarks/", "tests/benchmarks/")) for name in files)
    assert "name: acme-classifier\n" in (project / "deploy/kserve/inferenceservice.yaml").read_text()

    # Nothing says "gtsrb", the manual included: its demo passages are gone with their markers, its measured-results
    # pages with their navigation, and it builds strict (no link or anchor into what went).
    assert not set(MEASURED) & set(files) and "results.md" not in (project / "mkdocs.yml").read_text()
    names_left, word_left, markers_left = [], [], []
    for name in files:
        text = (project / name).read_text(errors="replace")
        if found := DEMO_NAMES.search(text):
            names_left.append(f"{name}: {found.group(0)}")
        if "gtsrb" in text.lower():
            word_left.append(name)
        if name.startswith("docs/") and ("<!-- demo -->" in text or "<!-- /demo -->" in text):
            markers_left.append(name)
    assert (names_left, word_left, markers_left) == ([], [], [])
    if importlib.util.find_spec("mkdocs") or os.environ.get("CI"):  # the docs dependency group (`.ci/run` has it)
        site = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                              cwd=project, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert site.returncode == 0 and "WARNING" not in site.stderr, site.stdout + site.stderr

    # The generated package reads its params.yaml; its own config and layout tests pass (the whole suite is a copy
    # of this one: docs/getting-started.md gives its run time).
    env = {**os.environ, "PYTHONPATH": str(project)}
    check = (
        "from pathlib import Path; import pipeline.config as c; p = c.load_params(Path('params.yaml')); "
        "print(Path(c.__file__).parent.parent, p.serve.model_name, p.data.source, p.tracking.registered_model_name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == [str(project), "acme", "folder", "acme-classifier"], out.stderr
    # Without the demo: its source, recipe, tests and scripts are gone, and the project's own tests run on the tests'
    # synthetic images (a folder and a CSV), not on the demo's layout.
    assert not {"pipeline/data/gtsrb.py", "pipeline/recipes/gtsrb.yaml", "scripts/raw-data.sh"} & set(files)
    assert not any(name.startswith(("tests/demo/", "tests/helpers/demo")) for name in files)
    own_tests = ["tests/test_config.py", "tests/test_layout.py", "tests/stages/test_prepare.py", "tests/data"]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *own_tests], cwd=project,
                           env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-3000:]
    assert " passed" in tests.stdout and " skipped" not in tests.stdout, tests.stdout[-2000:]


def test_the_manuals_demo_blocks_lines_and_spans_go_without_the_demo() -> None:
    """template_names.drop_demo_blocks(): a block between marker lines, a line ending with the marker, a span inside a
    line, markers included; one blank line stays where a block stood between two; a marker out of place stops."""
    spec = importlib.util.spec_from_file_location("template_names", REPO / ".copier" / "template_names.py")
    names = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(names)  # type: ignore[union-attr]
    page = (
        "# Data\n\nAny data works<!-- demo --> (GTSRB is the demo)<!-- /demo -->.\n\n<!-- demo -->\nThe demo's data:\n"
        "```bash\nGTSRB_ROOT=/copy make pipeline\n```\n<!-- /demo -->\n\n| recipe | for |\n|---|---|\n"
        "| `gtsrb` | the demo | <!-- demo -->\n| `photos` | folders |\n"
    )
    assert (
        names.drop_demo_blocks(page)
        == "# Data\n\nAny data works.\n\n| recipe | for |\n|---|---|\n| `photos` | folders |\n"
    )
    assert names.drop_demo_blocks("a\n<!-- demo -->\nb\n<!-- /demo -->\nc\n") == "a\nc\n"
    for wrong in ("<!-- demo -->\nb\n", "b\n<!-- /demo -->\n", "<!-- demo -->\n<!-- demo -->\n", "a <!-- demo --> b\n",
                  "<!-- demo -->b<!-- /demo --> c\n"):  # fmt: skip
        with pytest.raises(SystemExit, match=r"page\.md:"):
            names.drop_demo_blocks(wrong, "page.md")


def test_the_default_answers_reproduce_the_demo(template: Path, tmp_path: Path) -> None:
    """The demo stays the template's default: `copier copy --defaults` writes the repository's files unchanged."""
    project = generate(template, tmp_path / "demo", "v0.0.1")
    expected = [name for name in files_of(template) if name not in TEMPLATE_ONLY and "{{" not in name]
    assert files_of(project) == sorted([*expected, ".copier-answers.yml"])
    changed = [name for name in expected if (project / name).read_bytes() != (template / name).read_bytes()]
    assert changed == []


@pytest.mark.slow
def test_a_generated_project_runs_on_its_own_folder_of_images_through_deploy(template: Path, tmp_path: Path) -> None:
    """A project generated for a folder data set (scikit-learn's handwritten digits as PNGs: a second real data set,
    not the demo's) runs its own `dvc repro` to deploy with the project's package (containerize and deploy run where
    a Docker engine answers, as in CI): the served accuracy on held-out original files through the API, and the
    class names the data gave, everywhere."""
    import httpx
    import numpy as np

    from pipeline.artifacts.prepared import read_split
    from pipeline.serve.client import predict_files
    from tests.helpers.digits import write_digits_folder
    from tests.helpers.params import TEST_RECIPE
    from tests.helpers.server import serve_project

    digits = write_digits_folder(tmp_path / "digits")
    project = generate(template, tmp_path / "acme", "v0.0.1", **ANSWERS, data_root=str(digits))
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["data"]["root"] == str(digits)
    params["recipe"] = str(TEST_RECIPE)  # the small-network recipe, not the photos one
    params["data"]["image_size"] = 16  # the digits are 8 px: 16 keeps every pixel at a quarter of 32 px's cost
    params["model"].update({"width": 16, "members": 1})
    params["train"].update({"epochs": 10, "batch_size": 64, "nproc": 1, "checkpoint_every": 0})
    params["evaluate"]["min_accuracy"] = 0.95  # the gate, on the held-out files as served
    params["optimize"].update({"prune_amount": 0.0, "int8_torch": False, "calibration_images": 256})
    params["benchmark"].update({"threads": [0], "min_seconds": 0.1, "latency_calls": 20, "warmup": 2, "headline_rounds": 1,
                                "backends": ["onnxruntime"], "profile": False})  # fmt: skip
    params["tracking"]["enabled"] = False
    params["containerize"].update({"image": "digits-server-test", "skip_without_engine": True,
                                   "base_image": os.environ.get("PIPELINE_TEST_BASE_IMAGE",
                                                                params["containerize"]["base_image"])})  # fmt: skip
    params["deploy"].update({"skip_without_engine": True, "container_name": f"digits-test-{os.getpid()}"})
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    env = {k: v for k, v in os.environ.items() if k not in ("GTSRB_ROOT", "MLFLOW_TRACKING_URI")}
    env |= {"PYTHONPATH": str(project), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    git("init", "-q", cwd=project)  # a DVC project already (.dvc/ came with the template), in a git repository
    result = subprocess.run([sys.executable, "-m", "dvc", "repro", "deploy"], cwd=project, env=env,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    classes = [str(d) for d in range(10)]
    prepared = yaml.safe_load((project / "data/prepared/manifest.json").read_text())
    assert prepared["dataset"] == "digits" and prepared["classes"] == classes
    assert yaml.safe_load((project / "models/manifest.json").read_text())["classes"] == classes
    evaluation = yaml.safe_load((project / "reports/evaluate/metrics.json").read_text())
    assert evaluation["measured_on"] == "original files, whole" and evaluation["accuracy"] >= 0.95
    assert "10 classes of `digits`" in (project / "reports/model_card.md").read_text()
    deployed = yaml.safe_load((project / "reports/deploy/metrics.json").read_text())
    if os.environ.get("PIPELINE_REQUIRE_DOCKER"):
        assert not deployed.get("skipped"), "CI has an engine: deploy must have run"
    if not deployed.get("skipped"):  # the container's API on every held-out original file
        for path in ("png", "oip_bytes", "jpeg"):
            assert deployed[f"served_accuracy_{path}"] >= 0.95, (path, deployed)
        smoke = yaml.safe_load((project / "reports/deploy/smoke.json").read_text())
        assert smoke["per_image_mismatches"] == {"fp32_tensor": [], "oip_bytes": [], "png": []}

    # And the project's own server (its package, its params: its names), asked with the held-out files by a plain
    # HTTP client.
    server = serve_project(project, env)
    try:
        metadata = httpx.get(f"{server.url}/v2/models/{ANSWERS['model_name']}").json()
        assert metadata["parameters"]["classes"] == classes
        files = [(project / "data/prepared" / name) for name in prepared["test_files"]]
        labels = [int(label) for label in read_split("test", project / "data/prepared").labels]
        answers = predict_files(server.url, [f.read_bytes() for f in files], "png")
        accuracy = float(np.mean(np.asarray(answers) == np.asarray(labels)))
        assert len(files) >= 300 and accuracy >= 0.95, accuracy
        # evaluate measured the file this server serves: its headline is this client's figure, file for file
        evaluated = yaml.safe_load((project / "reports/evaluate/predictions.json").read_text())
        assert evaluated["served_predicted"] == answers and evaluation["accuracy"] == accuracy
        named = httpx.post(f"{server.url}/v1/predict", files={"files": ("x.png", files[0].read_bytes())}).json()
        assert named["predictions"][0]["top_k"][0]["name"] in classes
    finally:
        server.stop()
    print(f"digits: served accuracy {evaluation['accuracy']:.4f} (evaluate), {accuracy:.4f} through the server "
          f"on {len(files)} held-out files; deploy: {deployed}")  # fmt: skip


@pytest.mark.slow
def test_copier_update_merges_a_later_template_commit_into_an_edited_project(template: Path, tmp_path: Path) -> None:
    """A project generated from v0.0.1 and changed by its users (committed) takes the template's next release, tagged
    as tag.yml tags it, with `copier update --vcs-ref <that tag>`: the template's change arrives renamed, the users'
    edits stay, nothing conflicts."""
    base = tmp_path / "template"
    shutil.copytree(template, base)  # its own history: this test adds a commit
    project = generate(base, tmp_path / "acme", "v0.0.1", **ANSWERS, data_root="data/parts")
    git("init", "-q", "-b", "main", cwd=project)
    git("add", "-A", cwd=project)
    git("commit", "-q", "-m", "generated", cwd=project)
    # The users' edits: a setting, and a line of their own in a renamed file.
    params = (project / "params.yaml").read_text()
    assert re.search(r"^  epochs: ~ .*$", params, re.M)
    (project / "params.yaml").write_text(re.sub(r"^  epochs: ~ .*$", "  epochs: 30", params, count=1, flags=re.M))
    with (project / "deploy/k8s/service.yaml").open("a") as f:
        f.write("# ours: the service behind the acme gateway\n")
    git("commit", "-q", "-am", "our settings", cwd=project)

    # The template's later commit: a file the users did not edit, holding a name the task rewrites.
    hpa = base / "deploy/k8s/hpa.yaml"
    text = hpa.read_text()
    assert "  name: gtsrb-server\n" in text
    hpa.write_text(
        text.replace("  name: gtsrb-server\n", "  name: gtsrb-server  # scales the server's Deployment\n", 1)
    )
    # ... and a line the task rewrites, in a file the users edited elsewhere (a 3-way merge of renamed text).
    params = (base / "params.yaml").read_text()
    assert '  model_name: ""' in params
    (base / "params.yaml").write_text(
        re.sub(r'^  model_name: "" .*$', '  model_name: ""  # /v2/models/<name>', params, count=1, flags=re.M)
    )
    # ... released as the template releases: a "release: vX.Y.Z" commit of pyproject's version, tagged by the
    # script tag.yml runs on the default branch.
    version = re.search(r'^version = "([^"]+)"', (base / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    git("commit", "-q", "-am", f"release: v{version}", cwd=base)
    tagged = subprocess.run(["scripts/release-tag.sh"], cwd=base, capture_output=True, text=True, timeout=60,
                            env={**os.environ, **GIT_IDENTITY})  # fmt: skip
    assert tagged.returncode == 0 and f"as v{version}" in tagged.stdout, tagged.stdout + tagged.stderr

    out = copier("update", "--trust", "--defaults", "--vcs-ref", f"v{version}", cwd=project)
    # the task ran in each render: the old version's, the project's and the new version's
    assert out.count("template_names: ") == 3, out
    status = git("status", "--porcelain", cwd=project)
    changed = sorted(line[3:] for line in status.splitlines())
    assert changed == [".copier-answers.yml", "deploy/k8s/hpa.yaml", "params.yaml"], status
    assert "  name: acme-server  # scales the server's Deployment\n" in (project / "deploy/k8s/hpa.yaml").read_text()
    params = (project / "params.yaml").read_text()
    assert "  epochs: 30\n" in params and "  model_name: acme  # /v2/models/<name>\n" in params
    assert "# ours: the service behind the acme gateway\n" in (project / "deploy/k8s/service.yaml").read_text()
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] == f"v{version}" and answers["model_name"] == "acme"
    for name in files_of(project):
        text = (project / name).read_text(errors="replace")
        markers = [line for line in text.splitlines() if line.startswith(("<<<<<<< ", ">>>>>>> "))]
        assert not markers and not name.endswith(".rej"), name
    assert "gtsrb" not in (project / "deploy/k8s/hpa.yaml").read_text().lower()
