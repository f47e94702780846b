#!/usr/bin/env bash
# Start a local, auth-free Docker registry (Debian's docker-registry) on ADDR (default 127.0.0.1:5000), for
# testing "push, then pull by digest and run". Prints its PID, or "running" when one already answers.
# Stop it later with `kill <pid>`. Storage goes to REGISTRY_DIR (default: a new temp folder).
set -euo pipefail
addr=${1:-127.0.0.1:5000}
if python3 - "$addr" <<'PY' 2>/dev/null; then echo running; exit 0; fi
import sys, urllib.request
urllib.request.urlopen(f"http://{sys.argv[1]}/v2/", timeout=2)
PY
# Something else on that port (an MLflow UI, another service): say so, rather than a registry that dies at once.
if ! python3 - "$addr" <<'PY'; then exit 2; fi
import socket, sys
host, _, port = sys.argv[1].rpartition(":")
with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host or "127.0.0.1", int(port)))
    except OSError as exc:
        sys.exit(f"error: port {port} on {host} is already in use ({exc.strerror}) and is not a registry: "
                 "stop what listens there, or pass another ADDR here and set deploy.registry to it")
PY
if ! command -v docker-registry >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq docker-registry >/dev/null
fi
dir=${REGISTRY_DIR:-$(mktemp -d -t registry.XXXXXX)}
mkdir -p "$dir/storage"
cat >"$dir/config.yml" <<YAML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $dir/storage
  delete:
    enabled: true
http:
  addr: $addr
YAML
setsid docker-registry serve "$dir/config.yml" >"$dir/registry.log" 2>&1 </dev/null &
pid=$!
for _ in $(seq 1 60); do
  if python3 - "$addr" <<'PY' 2>/dev/null; then echo "$pid"; exit 0; fi
import sys, urllib.request
urllib.request.urlopen(f"http://{sys.argv[1]}/v2/", timeout=2)
PY
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
echo "registry did not answer on $addr; see $dir/registry.log" >&2
tail -5 "$dir/registry.log" >&2 || true
exit 1
