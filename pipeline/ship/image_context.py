"""Stage the server image's build context for several platforms at once, for a multi-platform
`docker buildx build --platform linux/amd64,linux/arm64` (release.yml).

`pipeline containerize` builds one platform at a time on the local engine; this stages the same context
(pipeline/ship/context.py: the package, params.yaml, the chosen ONNX variant, docker/Dockerfile) with the
serving wheels of every platform in one wheelhouse, from which pip in the build picks its own. Prints
`key=value` lines (for $GITHUB_OUTPUT): dir, variant, model_version, model_accuracy, registry_version, revision, and the project's
image_name and title (params.yaml's, resolved).

    pipeline image-context OUT [--platform linux/amd64 --platform linux/arm64] [--variant auto] [--champion-only]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts import gate as gate_file
from pipeline.config import ConfigError, load_params
from pipeline.errors import StageError
from pipeline.ship import context as ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--platform", action="append", dest="platforms")
    parser.add_argument(
        "--variant",
        default="auto",
        help="an accepted ONNX variant (fp32-onnx, int8-onnx, student-int8-onnx, ...) | auto (the benchmark's choice)",
    )
    parser.add_argument(
        "--champion-only",
        action="store_true",
        help="only a file whose passed gate made it the registry's champion (the release's rule)",
    )
    args = parser.parse_args(argv)
    platforms = args.platforms or ["linux/amd64", "linux/arm64"]
    try:
        params = load_params(Path("params.yaml"))
        model = ctx.choose_model(MODELS_DIR, args.variant)
        gate = gate_file.require_passed(model.variant, model.sha256)
        if args.champion_only and not gate.promoted_version:
            raise StageError(
                f"{model.variant} (sha256 {model.sha256[:12]}) passed its gate but did not become the champion "
                f"({gate.not_promoted or 'not promoted'}): the release ships only the champion's file"
            )
        requirements: set[str] = set()
        for i, platform_name in enumerate(platforms):
            wheels = ctx.download_wheels(platform_name, ctx.wheel_cache_dir() / platform_name.split("/")[1])
            staged = args.out if i == 0 else Path(tempfile.mkdtemp(prefix="image-context-"))
            ctx.stage_context(staged, MODELS_DIR, model, wheels, Path("params.yaml"), platform_name)
            requirements.add((staged / "wheels" / "requirements.txt").read_text())
            if staged != args.out:
                for wheel in (staged / "wheels").glob("*.whl"):
                    if not (args.out / "wheels" / wheel.name).exists():
                        shutil.copy2(wheel, args.out / "wheels" / wheel.name)
                shutil.rmtree(staged)
        if len(requirements) != 1:
            raise StageError("the platforms lock different serving requirements: build them one at a time")
    except (StageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"dir={args.out}")
    print(f"variant={model.variant}")
    print(f"model_version={model.version}")
    print(f"model_accuracy={model.accuracy if model.accuracy is not None else ''}")
    print(f"registry_version={gate.promoted_version}")
    print(f"revision={revision}")
    print(f"image_name={params.containerize.image.rsplit('/', 1)[-1].split(':')[0]}")
    print(f"title={params.serve.title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
