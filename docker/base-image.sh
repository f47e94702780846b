#!/usr/bin/env bash
# Build a slim Debian bookworm base image with python3 (3.11) and venv (ensurepip's wheels, no system pip)
# from the configured Debian mirror, for machines that cannot pull python:3.11-slim-bookworm from a registry.
# Like the official slim images it drops manual pages, docs (keeping copyright files) and translations.
#   docker/base-image.sh [TAG] [ARCH]      ARCH: amd64 (default) or arm64 (needs qemu-user-static)
# Default TAG: local/python:3.11-slim-bookworm (arm64: local/python:3.11-slim-bookworm-arm64). Needs a running
# Docker engine (docker/engine-up.sh). Inside, python is /usr/bin/python3.
set -euo pipefail
arch=${2:-amd64}
default_tag=local/python:3.11-slim-bookworm
[ "$arch" = amd64 ] || default_tag="$default_tag-$arch"
tag=${1:-$default_tag}
if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag exists"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
need=(debootstrap)
[ "$arch" = amd64 ] || need+=(qemu-user-static binfmt-support)
missing=()
for pkg in "${need[@]}"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq >/dev/null
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ "$arch" != amd64 ]; then
  "$(dirname "$0")/qemu-up.sh"
fi
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --arch="$arch" --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
rootfs="$work/rootfs"
rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"* "$rootfs/var/log/"*.log \
  "$rootfs/usr/share/man/"* "$rootfs/usr/share/info/"* "$rootfs/usr/share/locale/"* "$rootfs/usr/share/lintian"
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
tar -C "$work/rootfs" -c . | docker import \
  -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["python3"]' - "$tag" >/dev/null
if [ "$arch" != amd64 ]; then
  # dockerd 20.10 labels every imported image with the host's architecture: fix the config through save/load.
  "$(dirname "$0")/relabel.sh" "$tag" "$arch"
fi
echo "$tag built"
