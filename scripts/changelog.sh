#!/usr/bin/env bash
# CHANGELOG.md for a release: the version's section from the commits since the last tag (git-cliff, cliff.toml)
# takes the place of the hand-kept "## Unreleased" notes, a fresh empty "## Unreleased" goes on top, and
# pyproject.toml gets the version. Then commit as "release: vX.Y.Z": .github/workflows/tag.yml tags that commit.
#   scripts/changelog.sh X.Y.Z        (make changelog VERSION=X.Y.Z also relocks uv.lock)
set -euo pipefail
version=${1:-}
if ! [[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: make changelog VERSION=X.Y.Z" >&2
  exit 2
fi
cliff=${GIT_CLIFF:-git-cliff}
# the Unreleased notes give way to the version's section (written from the same commits)
sed -i '/^## Unreleased/,/^## [0-9]/{/^## [0-9]/!d}' CHANGELOG.md
"$cliff" --config cliff.toml --unreleased --tag "v$version" --prepend CHANGELOG.md
sed -i '0,/^## [0-9]/{s/^\(## [0-9]\)/## Unreleased\n\n\1/}' CHANGELOG.md
sed -i "s/^version = \".*\"/version = \"$version\"/" pyproject.toml
echo "CHANGELOG.md has $version; commit it as \"release: v$version\""
