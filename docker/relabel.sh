#!/usr/bin/env bash
# Set the architecture recorded in a local image's config (dockerd 20.10 labels every `docker import`ed
# image with the host's architecture). Usage: docker/relabel.sh TAG ARCH   (ARCH: arm64, amd64, ...)
set -euo pipefail
tag=${1:?TAG}; arch=${2:?ARCH}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
docker save "$tag" | tar -C "$work" -x
python3 - "$work" "$arch" <<'PY'
import hashlib, json, os, sys
root, arch = sys.argv[1], sys.argv[2]
manifest = json.load(open(os.path.join(root, "manifest.json")))
for entry in manifest:
    path = os.path.join(root, entry["Config"])
    config = json.load(open(path))
    config["architecture"] = arch
    if arch == "arm64":
        config["variant"] = "v8"
    else:
        config.pop("variant", None)
    data = json.dumps(config, separators=(",", ":")).encode()
    name = hashlib.sha256(data).hexdigest() + ".json"
    os.remove(path)
    open(os.path.join(root, name), "wb").write(data)
    entry["Config"] = name
json.dump(manifest, open(os.path.join(root, "manifest.json"), "w"))
PY
docker rmi "$tag" >/dev/null
tar -C "$work" -c . | docker load >/dev/null
echo "$tag relabelled as linux/$arch"
