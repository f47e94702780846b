"""The containerize stage: build the inference server image with the chosen ONNX variant.

Reads models/manifest.json (+ serving.json, the benchmark's choice) and the variant file, docker/Dockerfile,
docker/requirements-serve.in and uv.lock. Stages a build context (wheels for each target platform, the
package source, params.yaml, the model) in a temporary folder, builds one image per platform, tags it
with the git commit and the model version, and writes reports/containerize/image.json (image id, size,
tags, build time). Without a reachable Docker engine it stops with one clear line, or records a skipped
build when `containerize.skip_without_engine` is set.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pipeline.artifacts import MODELS_DIR, REPORTS_DIR
from pipeline.artifacts import gate as gate_file
from pipeline.artifacts import image as image_file
from pipeline.config import ContainerizeConfig, Params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.ship import context as ctx
from pipeline.ship import docker_engine as eng

REPORT_DIR = REPORTS_DIR / "containerize"
REPO_ROOT = ctx.REPO_ROOT


def git_revision(root: Path = REPO_ROOT) -> tuple[str, bool]:
    """(commit, dirty): the checkout's HEAD, and whether tracked files differ from it."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown", False
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head.stdout.strip(), bool(dirty.stdout.strip())


def source_url(config: ContainerizeConfig, root: Path = REPO_ROOT) -> str:
    """The OCI source label: the param, else the `origin` remote as an https URL, else empty."""
    if config.source_url:
        return config.source_url
    proc = subprocess.run(
        ["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True, check=False
    )
    url = proc.stdout.strip()
    if url.startswith("git@") and ":" in url:
        host, path = url[4:].split(":", 1)
        url = f"https://{host}/{path}"
    if url.endswith(".git"):
        url = url[:-4]
    return url if url.startswith("https://") else ""


def platform_arch(name: str) -> str:
    arch = name.split("/")[1] if name.count("/") >= 1 else name
    if arch not in ("amd64", "arm64"):
        raise StageError(f"containerize.platforms: {name!r} is not supported (use linux/amd64 or linux/arm64)")
    return arch


def base_for(config: ContainerizeConfig, arch: str, native: bool) -> str:
    """A registry base is multi-arch (`--platform` picks); a local debootstrap base has one tag per arch."""
    if native or not config.base_image.startswith("local/"):
        return config.base_image
    return f"{config.base_image}-{arch}"


def skipped(reason: str) -> None:
    image_file.write(image_file.ImageRecord(skipped=True, reason=reason))
    # DVC declares the metrics file an output: a skipped build writes one too, or `dvc repro` fails here.
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "metrics.json").write_text(json.dumps({"skipped": True}, indent=2) + "\n")
    log(f"containerize: skipped ({reason})")


def run(params: Params) -> None:
    config = params.containerize
    if ":" in config.image.rsplit("/", 1)[-1]:
        raise StageError(f"containerize.image {config.image!r}: give the repository only; the stage sets the tags")
    model = None
    if (MODELS_DIR / "manifest.json").is_file():  # nothing is built (or skipped) that evaluate's gate did not pass
        model = ctx.choose_model(MODELS_DIR, config.variant)
        gate_file.require_passed(model.variant, model.sha256)
    try:
        engine = eng.find_engine("containerize.skip_without_engine")
    except eng.NoEngine as exc:
        if eng.skips_without_engine(config.skip_without_engine):
            skipped(str(exc))
            return
        raise
    if model is None:
        model = ctx.choose_model(MODELS_DIR, config.variant)  # says what is missing
    revision, dirty = git_revision()
    short = revision[:12] + ("-dirty" if dirty else "")
    label_source = source_url(config)
    tags = [f"{config.image}:{short}", f"{config.image}:model-{model.version}", f"{config.image}:latest"]
    builds = [
        _build_platform(params, engine, model, platform_name, tags, revision, label_source)
        for platform_name in dict.fromkeys(config.platforms)
    ]
    native_build = next((b for b in builds if b["platform"] == engine.native_platform), builds[0])
    report = image_file.ImageRecord(
        skipped=False,
        image=config.image,
        tag=native_build["tags"][0],
        id=native_build["id"],
        size_bytes=native_build["size_bytes"],
        size_mb=native_build["size_mb"],
        build_seconds=native_build["build_seconds"],
        variant=model.variant,
        model_version=model.version,
        model_accuracy=model.accuracy,
        revision=revision,
        dirty=dirty,
        source=label_source,
        engine=engine.server_version,
        builds=builds,
    )
    image_file.write(report)
    (REPORT_DIR / "metrics.json").write_text(
        json.dumps({"image_size_mb": native_build["size_mb"], "build_seconds": native_build["build_seconds"]}, indent=2)
        + "\n"
    )
    _track(params, report)


def _build_platform(
    params: Params, engine: Any, model: Any, platform_name: str, tags: list[str], revision: str, label_source: str
) -> dict[str, Any]:
    """One platform's image: its base, the staged context (wheels of that platform), the build, what it made."""
    config = params.containerize
    arch = platform_arch(platform_name)
    native = f"linux/{arch}" == engine.native_platform
    base = base_for(config, arch, native)
    eng.ensure_base_image(engine, base, arch, "containerize: ")
    if not native:
        _ensure_emulation()
    wheels = ctx.download_wheels(f"linux/{arch}", ctx.wheel_cache_dir() / arch)
    context_dir = Path(tempfile.mkdtemp(prefix=f"server-image-{arch}-"))
    digest = ctx.stage_context(context_dir, MODELS_DIR, model, wheels, Path("params.yaml"), f"linux/{arch}")
    platform_tags = tags if native else [f"{t}-{arch}" for t in tags]
    log(f"containerize: building {platform_tags[0]} for linux/{arch} from {base} ...")
    build_args = {
        "BASE_IMAGE": base,
        "SOURCE_URL": label_source,
        "REVISION": revision,
        "MODEL_VERSION": model.version,
        "MODEL_VARIANT": model.variant,
        "IMAGE_TITLE": config.image.rsplit("/", 1)[-1],
        "IMAGE_DESCRIPTION": params.serve.title,
    }
    try:
        seconds = eng.build(
            engine,
            context_dir,
            context_dir / "Dockerfile",
            platform_tags,
            build_args,
            platform_name=None if native else f"linux/{arch}",
            buildkit=config.buildkit,
            log_path=REPORT_DIR / f"build-{arch}.log",
        )
    finally:
        shutil.rmtree(context_dir, ignore_errors=True)
    info = eng.inspect_image(engine, platform_tags[0])
    log(
        f"containerize: {platform_tags[0]} ({eng.image_platform(info)}) id {info['Id'][7:19]}, "
        f"{int(info['Size']) / 1e6:.0f} MB, built in {seconds:.0f} s"
    )
    return {
        "platform": f"linux/{arch}",
        "image_platform": eng.image_platform(info),
        "id": info["Id"],
        "tags": platform_tags,
        "size_bytes": int(info["Size"]),
        "size_mb": round(int(info["Size"]) / 1e6, 1),
        "build_seconds": round(seconds, 1),
        "base_image": base,
        "context_digest": digest,
    }


def _ensure_emulation() -> None:
    script = REPO_ROOT / "docker" / "qemu-up.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StageError(
            f"cannot build for another architecture: qemu emulation is not available ({proc.stderr.strip()[-500:]})"
        )


def _track(params: Params, report: image_file.ImageRecord) -> None:
    if not params.tracking.enabled:
        return
    from pipeline.tracking import stage_run

    with stage_run("containerize", params, {"containerize": params.containerize.model_dump()}) as mlrun:
        mlrun.log_metrics({"image_size_mb": report.size_mb, "build_seconds": report.build_seconds})
        mlrun.set_tags({"image": report.tag, "image_id": report.id, "model_version": report.model_version})
