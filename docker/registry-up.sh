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
