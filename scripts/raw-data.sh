#!/usr/bin/env bash
# Put the raw data where dvc.yaml tracks it (prepare depends on ${data.root}, data/raw by default), so that adding,
# removing or changing an image makes `dvc status` report prepare changed and `dvc repro` re-run it.
#   GTSRB_ROOT set:  data/raw becomes a link to that copy (DVC hashes what the link points at)
#   otherwise:       data/raw is created empty when missing (prepare downloads GTSRB into it: data.download)
# A data.root of your own (data.source folder | csv) is left alone: it is yours, tracked where it is.
set -euo pipefail
cd "$(dirname "$0")/.."
raw=data/raw
if [ -n "${GTSRB_ROOT:-}" ]; then
  target="$(cd "$GTSRB_ROOT" && pwd -P)"
  if [ -e "$raw" ] && [ ! -L "$raw" ]; then
    if [ "$(cd "$raw" && pwd -P)" = "$target" ]; then exit 0; fi
    echo "raw-data: $raw is a folder of its own (a download?); move it away to use GTSRB_ROOT=$GTSRB_ROOT" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$raw")"
  ln -sfn "$target" "$raw"
else
  if [ -L "$raw" ] && [ ! -e "$raw" ]; then
    echo "raw-data: $raw links to $(readlink "$raw"), which is gone; set GTSRB_ROOT or remove the link" >&2
    exit 1
  fi
  mkdir -p "$raw"
fi
