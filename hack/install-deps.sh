#!/usr/bin/env bash
# Install everything moeguard's demo and tests need on a fresh Debian machine:
#   - Debian packages: prometheus (2.42), openssl, curl, libucx0 (UCX 1.13.1: the worker's UCX drill
#     loads its real libucs through MOEGUARD_FAULT_LOAD_LIBRARY)
#   - the Python virtualenv (requirements.txt, cached by hash, linked as .venv)
#   - the Go-built control plane binaries (cached by version under ~/.cache/moeguard)
#   - g++ and the worker's stream kernel built with it (moeguard_runtime.model.stream_kernel)
# With --node, also what hack/install-node-deps.sh installs (the real node and the image builds), in the
# same apt-get call and the same wait: `make test` needs both.
# The venv (downloads: torch's CUDA build is several GB) is installed in the background while the Go
# builds use the CPUs, so a cold machine waits for the longer of the two, not their sum.
# Idempotent: a second run takes seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
node=0
[ "${1:-}" = --node ] && node=1
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
dpkg -s libucx0 >/dev/null 2>&1 || missing+=(libucx0)
command -v g++ >/dev/null || missing+=(g++)
if [ "$node" = 1 ]; then
  for p in containerd runc containernetworking-plugins buildah mmdebstrap iptables; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "[deps] apt-get install ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
venv_log=$(mktemp)
"$ROOT/hack/ensure-venv.sh" >"$venv_log" 2>&1 &
venv_pid=$!
built=0
if [ "$node" = 1 ]; then
  "$ROOT/hack/build-binaries.sh" etcd kwok helm lws kubernetes node || built=$?
else
  "$ROOT/hack/build-binaries.sh" || built=$?
fi
venv_rc=0
wait "$venv_pid" || venv_rc=$?
cat "$venv_log" >&2
rm -f "$venv_log"
[ "$venv_rc" -eq 0 ] || { echo "[deps] the Python venv failed (exit $venv_rc)" >&2; exit "$venv_rc"; }
# The worker's own few-row expert kernel (a C++ library, cached by source and compiler under
# ~/.cache/moeguard/native): built now, so no worker or unit test builds it; where it cannot run (no AVX2)
# this says why and the workers leave it out of their kernel choice.
PYTHONPATH="$ROOT/runtime:$ROOT/core" "$ROOT/.venv/bin/python" -m moeguard_runtime.model.stream_kernel >&2
exit "$built"
