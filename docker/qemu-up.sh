#!/usr/bin/env bash
# Let this x86_64 machine run linux/arm64 binaries (image builds and `docker run --platform linux/arm64`)
# under qemu-user emulation: install qemu-user-static, mount binfmt_misc, enable the aarch64 handler.
set -euo pipefail
if [ "$(uname -m)" = aarch64 ]; then exit 0; fi
if ! dpkg -s qemu-user-static binfmt-support >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq qemu-user-static binfmt-support >/dev/null
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
grep -q '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
  || { echo "qemu-aarch64 is registered without the F flag: containers cannot use it" >&2; exit 1; }
