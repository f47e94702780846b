#!/usr/bin/env bash
# Make sure a Docker engine answers: install Debian's engine (docker.io) if dockerd is missing, start it if
# it is not running, wait until `docker info` works. Prints the PID of the dockerd it started, or "running".
# Stop it later with `kill <pid>` (only that PID). DOCKERD_LOG names its log file (default: a temp file).
set -euo pipefail
if docker info >/dev/null 2>&1; then echo running; exit 0; fi
if ! command -v dockerd >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq docker.io >/dev/null
fi
log=${DOCKERD_LOG:-$(mktemp -t dockerd.XXXXXX.log)}
setsid dockerd >"$log" 2>&1 </dev/null &
pid=$!
for _ in $(seq 1 120); do
  if docker info >/dev/null 2>&1; then echo "$pid"; exit 0; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
echo "dockerd did not answer within 60 s; see $log" >&2
tail -5 "$log" >&2 || true
exit 1
