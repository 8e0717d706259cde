#!/usr/bin/env bash
# What the real node (hack/node-up.sh) and the local image builds (hack/build-images.sh) need on a
# Debian machine: containerd, runc, the CNI plugins, buildah, mmdebstrap and iptables from Debian, and
# the kubelet, pause, crictl and the GPU device plugin from Go (hack/build-binaries.sh node, cached).
# Idempotent: a second run takes seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
missing=()
for p in containerd runc containernetworking-plugins buildah mmdebstrap iptables; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[node-deps] apt-get install ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
"$ROOT/hack/build-binaries.sh" node
