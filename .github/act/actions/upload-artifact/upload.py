"""upload-artifact stand-in: copy the matched files below their common folder into $ACT_ARTIFACT_DIR/<name>/."""

import fnmatch
import glob
import os
import shutil
import sys
from pathlib import Path

store = os.environ.get("ACT_ARTIFACT_DIR")
if not store:
    sys.exit("::error::upload-artifact (act stand-in): ACT_ARTIFACT_DIR is not set; run the workflow with scripts/act.sh")
name = os.environ["INPUT_NAME"]
lines = [line.strip() for line in os.environ["INPUT_PATH"].splitlines() if line.strip()]
include = [line for line in lines if not line.startswith("!")]
exclude = [line[1:].strip().rstrip("/") for line in lines if line.startswith("!")]


def excluded(path: Path) -> bool:
    rel = os.path.relpath(path)
    return any(rel == e or rel.startswith(e + "/") or fnmatch.fnmatch(rel, e) for e in exclude)


files: list[Path] = []
for pattern in include:
    for match in glob.glob(os.path.expanduser(pattern), recursive=True):
        found = [Path(match)] if os.path.isfile(match) else [p for p in Path(match).rglob("*") if p.is_file()]
        files += [p for p in found if not excluded(p)]
files = sorted({p.resolve() for p in files})
if not files:
    message = f"upload-artifact (act stand-in): no files found for {name!r} in: {', '.join(include)}"
    mode = os.environ.get("INPUT_IF_NO_FILES_FOUND", "warn")
    if mode == "error":
        sys.exit(f"::error::{message}")
    print(f"::warning::{message}" if mode == "warn" else message)
    sys.exit(0)
root = Path(os.path.commonpath([p.parent for p in files]))
target = Path(store) / name
if target.exists():
    shutil.rmtree(target)
for path in files:
    destination = target / path.relative_to(root)
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, destination)
size = sum(p.stat().st_size for p in files)
print(f"upload-artifact (act stand-in): {name}: {len(files)} files, {size / 1e6:.1f} MB -> {target}")
