#!/usr/bin/env bash
# Install everything moeguard's demo and tests need on a fresh Debian machine:
#   - Debian packages: prometheus (2.42), openssl, curl, libucx0 (UCX 1.13.1: the worker's UCX drill
#     loads its real libucs through MOEGUARD_FAULT_LOAD_LIBRARY)
#   - the Python virtualenv (requirements.txt, cached by hash, linked as .venv)
#   - the Go-built control plane binaries (cached by version under ~/.cache/moeguard)
# Idempotent: a second run takes seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
dpkg -s libucx0 >/dev/null 2>&1 || missing+=(libucx0)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[deps] apt-get install ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$ROOT/hack/ensure-venv.sh"
"$ROOT/hack/build-binaries.sh"
