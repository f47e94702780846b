"""download-artifact stand-in: copy artifacts back from $ACT_ARTIFACT_DIR, laid out as the real action does."""

import fnmatch
import os
import shutil
import sys
from pathlib import Path

store = Path(os.environ.get("ACT_ARTIFACT_DIR") or sys.exit("::error::ACT_ARTIFACT_DIR is not set; use scripts/act.sh"))
name = os.environ.get("INPUT_NAME", "")
destination = Path(os.path.expanduser(os.environ.get("INPUT_PATH") or "."))
available = sorted(p.name for p in store.iterdir() if p.is_dir()) if store.is_dir() else []
if name:
    if name not in available:
        sys.exit(f"::error::download-artifact (act stand-in): no artifact {name!r} (this run has: {available or 'none'})")
    chosen = {name: destination}
else:
    merge = os.environ.get("INPUT_MERGE_MULTIPLE") == "true"
    names = [n for n in available if fnmatch.fnmatch(n, os.environ.get("INPUT_PATTERN") or "*")]
    chosen = {n: destination if merge else destination / n for n in names}
for artifact, target in chosen.items():
    shutil.copytree(store / artifact, target, dirs_exist_ok=True)
    print(f"download-artifact (act stand-in): {artifact} -> {target}")
if not chosen:
    print("download-artifact (act stand-in): no artifact matched")
with open(os.environ["GITHUB_OUTPUT"], "a") as out:
    out.write(f"download-path={destination.resolve()}\n")
