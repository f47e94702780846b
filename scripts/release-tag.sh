#!/usr/bin/env bash
# Tag the release commit of pyproject.toml's version (its subject "release: vX.Y.Z", on this branch) as vX.Y.Z,
# unless that tag exists: what .github/workflows/tag.yml runs on the default branch, so that a clone has the tags
# `copier update --vcs-ref vX.Y.Z` needs. PUSH=1 pushes the tag to origin.
set -euo pipefail
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
tag="v$version"
if git rev-parse -q --verify "refs/tags/$tag" >/dev/null; then
  echo "$tag exists: nothing to tag"
  exit 0
fi
commit=$(git log --format=%H -n 1 --grep="^release: $tag\$" HEAD)
if [ -z "$commit" ]; then
  echo "no commit \"release: $tag\" on this branch yet: nothing to tag"
  exit 0
fi
git tag -a "$tag" -m "$tag" "$commit"
echo "tagged $(git rev-parse --short "$commit") as $tag"
if [ "${PUSH:-}" = 1 ]; then
  git push origin "refs/tags/$tag"
fi
