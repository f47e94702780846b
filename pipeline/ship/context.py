"""The build context of the server image: a wheelhouse for the target platform, the package source,
the serve settings and the chosen model variant. Staged into a folder of its own, so the image gets
exactly these files whatever else lies in the checkout (no .dockerignore to keep in step).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import REPORTS_DIR, drift_reference, model_card
from pipeline.console import log
from pipeline.errors import StageError

# Inputs from the checkout this package lives in (the models and params come from the working directory).
REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
REQUIREMENTS_IN = DOCKER_DIR / "requirements-serve.in"
LOCK_FILE = REPO_ROOT / "uv.lock"
# The package source goes in whole (training modules are small; their torch imports never run).
PACKAGE_DIR = REPO_ROOT / "pipeline"


def wheel_cache_dir() -> Path:
    """Downloaded wheels persist here between builds ($PIPELINE_WHEEL_CACHE, else the user's cache)."""
    env = os.environ.get("PIPELINE_WHEEL_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "image-pipeline" / "wheels"


def read_requirements(path: Path = REQUIREMENTS_IN) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def target_environment(platform_name: str = "linux/amd64") -> dict[str, str]:
    """PEP 508 marker values of the image's interpreter (Debian bookworm's CPython 3.11 on Linux)."""
    machine = "aarch64" if platform_name.startswith("linux/arm64") else "x86_64"
    return {
        "python_version": "3.11",
        "python_full_version": "3.11.2",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "extra": "",
    }


def locked_versions(lock: Path = LOCK_FILE, platform_name: str = "linux/amd64") -> dict[str, str]:
    """name -> version of every package uv.lock resolves for the image's interpreter (pip constraints).

    uv.lock may hold several versions of one package, each for some interpreters (`resolution-markers`):
    the one whose markers match the image's CPython 3.11 on Linux wins."""
    from packaging.markers import InvalidMarker, Marker

    try:
        data = tomllib.loads(lock.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise StageError(f"cannot read {lock}: {exc}") from None
    env = target_environment(platform_name)
    versions: dict[str, str] = {}
    for package in data.get("package", []):
        source = package.get("source", {})
        if "version" not in package or "editable" in source or "virtual" in source:
            continue
        markers = package.get("resolution-markers") or []
        try:
            applies = not markers or any(Marker(m).evaluate(env) for m in markers)
        except InvalidMarker:
            applies = True
        if applies:
            versions[str(package["name"])] = str(package["version"])
    return versions


def pip_command() -> list[str]:
    """A pip that can download: this interpreter's, the system python3's, or uv's tool runner."""
    candidates: list[list[str]] = [[sys.executable, "-m", "pip"]]
    python3 = shutil.which("python3")
    if python3:
        candidates.append([python3, "-m", "pip"])
    for cmd in candidates:
        if subprocess.run([*cmd, "--version"], capture_output=True, check=False).returncode == 0:
            return cmd
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        return [uv, "tool", "run", "--from", "pip", "pip"]
    raise StageError("no pip found to download the serving wheels (install python3-pip or uv)")


def platform_tags(platform_name: str) -> list[str]:
    """pip --platform values for linux/amd64 or linux/arm64: manylinux 2.17..2.36 (bookworm has glibc 2.36)."""
    machine = {"linux/amd64": "x86_64", "linux/arm64": "aarch64", "linux/arm64/v8": "aarch64"}.get(platform_name)
    if machine is None:
        raise StageError(f"unsupported platform {platform_name!r} (use linux/amd64 or linux/arm64)")
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(36, 16, -1)]
    return [*tags, f"manylinux2014_{machine}"]


def download_wheels(platform_name: str, dest: Path, requirements_in: Path = REQUIREMENTS_IN) -> Path:
    """Wheels of an image's requirements (default: the server's; pinned to uv.lock) for `platform_name`,
    CPython 3.11, into `dest` (a persistent cache: files already there are not downloaded again). Writes
    dest/requirements.txt."""
    requirements = read_requirements(requirements_in)
    versions = locked_versions(platform_name=platform_name)
    missing = [name for name in requirements if _normalise(name) not in {_normalise(k) for k in versions}]
    if missing:
        raise StageError(f"{requirements_in}: not in {LOCK_FILE}: {', '.join(missing)}")
    dest.mkdir(parents=True, exist_ok=True)
    constraints = dest / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(versions.items())))
    pinned = [f"{name}=={versions[_match(name, versions)]}" for name in requirements]
    (dest / "requirements.txt").write_text("".join(f"{line}\n" for line in pinned))
    # The same pins as last time: the wheels are all there already (and this works offline).
    stamp = dest / "complete.sha256"
    key = hashlib.sha256((constraints.read_text() + "\n" + "\n".join(pinned)).encode()).hexdigest()
    if stamp.is_file() and stamp.read_text().strip() == key:
        return dest
    cmd = [*pip_command(), "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:"]
    for tag in platform_tags(platform_name):
        cmd += ["--platform", tag]
    cmd += ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3"]
    cmd += ["--abi", "none", "-c", str(constraints), "-r", str(dest / "requirements.txt"), "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise StageError(f"downloading the wheels of {requirements_in.name} for {platform_name} failed:\n{tail}")
    stamp.write_text(key + "\n")
    return dest


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _match(name: str, versions: dict[str, str]) -> str:
    wanted = _normalise(name)
    return next(key for key in versions if _normalise(key) == wanted)


@dataclass(frozen=True)
class ModelChoice:
    variant: str
    version: str  # the first 12 hex digits of the variant file's SHA-256 (what the server reports)
    files: list[Path]  # relative to the models folder
    accuracy: float | None  # the variant's test accuracy as the optimize stage recorded it, when it did
    sha256: str = ""  # the variant file's SHA-256 (what evaluate's gate record names)


def choose_model(models_dir: Path, wanted: str) -> ModelChoice:
    """The ONNX variant to ship: `wanted`, or for `auto` the benchmark's choice (a StageError when there is none)."""
    from pipeline.artifacts.variants import read_manifest

    if not (models_dir / "manifest.json").is_file():
        raise StageError(
            f"no model to ship: {models_dir / 'manifest.json'} is missing; run the pipeline up to the optimize "
            "stage first (dvc repro optimize)"
        )
    manifest = read_manifest(models_dir)
    accepted = {v.name: v for v in manifest.variants if v.accepted}
    variant = wanted
    if wanted == "auto":
        from pipeline.artifacts import serving as serving_file

        choice = serving_file.read(models_dir)
        if choice is None:  # never guess: an interrupted benchmark must not ship another variant silently
            raise StageError(serving_file.missing_choice(models_dir, "containerize.variant"))
        variant = choice.variant
        if variant in accepted:
            choice.check_against(variant, accepted[variant].sha256, models_dir, "containerize.variant")
    # Any accepted ONNX file ships (fp32-onnx, int8-onnx, the student's or the pruned model's): the image runs
    # ONNX Runtime only.
    onnx = sorted(name for name, v in accepted.items() if v.format == "onnx")
    if variant not in onnx:
        known = any(v.name == variant for v in manifest.variants)
        why = "is not an ONNX file" if variant in accepted else "is not accepted" if known else "is not in the manifest"
        raise StageError(
            f"containerize.variant {variant!r} {why} ({models_dir / 'manifest.json'}): the server image runs ONNX "
            f"Runtime only; use one of {', '.join(onnx) or 'none (rerun optimize)'} (or auto)"
        )
    entry = accepted[variant]
    files = [Path(entry.file)]
    for rel in files:
        if not (models_dir / rel).is_file():
            raise StageError(f"{models_dir / rel} (variant {variant}) is missing")
    return ModelChoice(
        variant=variant, version=entry.sha256[:12], files=files, accuracy=entry.accuracy, sha256=entry.sha256
    )


def resolved_params_yaml(params_file: Path) -> str:
    """params.yaml as the server in the image reads it: every key resolved (the recipe applied, the names made), so
    a recipe file of the project's (`recipe: path/to/yours.yaml`) need not travel with it."""
    import yaml

    from pipeline.config import load_params

    resolved = load_params(params_file).model_dump(mode="json")
    resolved["recipe"] = "auto"  # every key is set: a recipe adds nothing now
    return yaml.safe_dump(resolved, sort_keys=False)


def stage_context(
    context: Path,
    models_dir: Path,
    model: ModelChoice,
    wheels: Path,
    params_file: Path,
    platform_name: str,
    reports_dir: Path = REPORTS_DIR,
) -> str:
    """Fill `context` (emptied first) with what docker/Dockerfile copies; returns a digest of its contents."""
    if context.exists():
        shutil.rmtree(context)
    (context / "app" / "models").mkdir(parents=True)
    stage_wheels(wheels, context / "wheels", platform_name)
    shutil.copytree(
        PACKAGE_DIR,
        context / "app" / "pipeline",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache"),
    )
    (context / "app" / "params.yaml").write_text(resolved_params_yaml(params_file))
    shutil.copy2(models_dir / "manifest.json", context / "app" / "models" / "manifest.json")
    # The model card, when one describes the shipped variant: the server shows it at /v1/model-card.
    (context / "app" / "reports").mkdir()
    gate = reports_dir / "evaluate" / "gate.json"
    if gate.is_file():  # evaluate's verdict travels with the variant: the server in the image checks it too
        (context / "app" / "reports" / "evaluate").mkdir()
        shutil.copy2(gate, context / "app" / "reports" / "evaluate" / "gate.json")
    card = model_card.read_markdown_for(model.variant, reports_dir)
    if card is not None:
        (context / "app" / "reports" / model_card.CARD_PATH.name).write_text(card)
        shutil.copy2(reports_dir / model_card.FACTS_PATH.name, context / "app" / "reports" / model_card.FACTS_PATH.name)
    else:
        log(
            f"containerize: no model card of {model.variant} in {reports_dir}: the image has none (run `pipeline card`)"
        )
    # The drift reference counted on the shipped variant: /v1/drift-reference, `pipeline monitor --drift`.
    reference = drift_reference.read_for(model.variant, reports_dir)
    if reference is not None:
        drift_reference.write(reference, context / "app" / drift_reference.REFERENCE_PATH)
    else:
        log(f"containerize: no drift reference of {model.variant} in {reports_dir}: run `pipeline evaluate`")
    for rel in model.files:
        target = context / "app" / "models" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(models_dir / rel, target)
    shutil.copy2(DOCKERFILE, context / "Dockerfile")
    digest = hashlib.sha256()
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(context)).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    log(f"containerize: build context staged in {context} ({sum(1 for _ in context.rglob('*'))} entries)")
    return digest.hexdigest()


def stage_wheels(wheels: Path, dest: Path, platform_name: str) -> None:
    """The locked wheels of a download_wheels cache and its requirements.txt, into a build context's `dest`:
    hard links when the cache is on the same filesystem (no copy per build)."""
    dest.mkdir(parents=True, exist_ok=True)
    versions = {_normalise(k): v for k, v in locked_versions(platform_name=platform_name).items()}
    wanted = [p.name for p in wheels.glob("*.whl") if _wheel_is_locked(p.name, versions)]
    for name in sorted(wanted):
        _link_or_copy(wheels / name, dest / name)
    shutil.copy2(wheels / "requirements.txt", dest / "requirements.txt")


def _wheel_is_locked(filename: str, versions: dict[str, str]) -> bool:
    """Keep only the wheels of the locked versions (the cache may hold older ones)."""
    name, version = filename.split("-")[:2]
    return versions.get(_normalise(name)) == version


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
