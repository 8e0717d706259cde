#!/usr/bin/env bash
# Create (once) a virtualenv holding requirements.txt, in a cache outside the
# repository keyed by the file's hash, and link it as .venv. Reuses pip's cache.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOEGUARD_CACHE=${MOEGUARD_CACHE:-$HOME/.cache/moeguard}
key=$( (cat "$ROOT/requirements.txt"; python3 --version) | sha256sum | cut -c1-16)
venv="$MOEGUARD_CACHE/venvs/$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[venv] installing requirements into $venv (torch is large: minutes on a cold cache)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$ROOT/requirements.txt" >&2
  touch "$venv/.complete"
fi
ln -sfn "$venv" "$ROOT/.venv"
