#!/usr/bin/env bash
# Create (once) a virtualenv holding requirements.txt, in a cache outside the
# repository keyed by the file's hash, and link it as .venv. Reuses pip's cache.
# Each call marks the venv used (.last-used); venvs no checkout has used for
# MOEGUARD_VENV_KEEP_DAYS (14) days are removed (each holds torch: ~6 GB).
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
touch "$venv/.last-used"
keep_days=${MOEGUARD_VENV_KEEP_DAYS:-14}
for old in "$MOEGUARD_CACHE"/venvs/*/; do
  old=${old%/}
  [ "$old" = "$venv" ] && continue
  used=$old/.last-used
  [ -e "$used" ] || used=$old  # made before .last-used existed: the folder's own time
  if [ -n "$(find "$used" -maxdepth 0 -mtime +"$keep_days" 2>/dev/null)" ]; then
    echo "[venv] removing $old (unused for more than $keep_days days)" >&2
    rm -rf "$old"
  fi
done
