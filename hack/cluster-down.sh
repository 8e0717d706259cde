#!/usr/bin/env bash
# Stop everything hack/cluster-up.sh (and hack/pod_workers.py) started in the
# run dir: first by pid file (SIGTERM, then SIGKILL after 10 s), then any
# straggler whose command line points into the run dir. Removes the run dir
# unless --keep-data. Idempotent.
# Usage: hack/cluster-down.sh [--keep-data]
set -euo pipefail
RUN=${MOEGUARD_RUN_DIR:-/tmp/moeguard-run}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
keep=0
for a in "$@"; do
  case "$a" in
    --keep-data) keep=1 ;;
    *) echo "usage: $0 [--keep-data]" >&2; exit 2 ;;
  esac
done
log() { printf '[cluster-down] %s\n' "$*" >&2; }

# ours PID: a live process whose command line points into the run dir.
ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF "$RUN/"; }

# stop PID...: SIGTERM, wait up to 10 s, then SIGKILL what is left.
stop() {
  local p left
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 1 50); do
    left=""
    for p in "$@"; do kill -0 "$p" 2>/dev/null && left="$left $p"; done
    [ -z "$left" ] && return 0
    sleep 0.2
  done
  log "SIGKILL$left"
  # shellcheck disable=SC2086
  kill -KILL $left 2>/dev/null || true
}

# stop_named NAME...: stop, together, the processes of these pid files (globs allowed).
stop_named() {
  local n f pid pids=()
  for n in "$@"; do
    for f in "$RUN"/pids/$n.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f")
      if ours "$pid"; then log "stopping $(basename "$f" .pid) (pid $pid)"; pids+=("$pid"); fi
    done
  done
  stop "${pids[@]}"
  for n in "$@"; do rm -f "$RUN"/pids/$n.pid; done
}
# The real node first (hack/node-up.sh: its pods through the CRI, its mounts), while the API server runs.
if [ -d "$RUN/node" ]; then "$HERE/node-down.sh" || log "node-down failed: see above"; fi
# The worker harness first (it stops its workers), then the control plane top-down.
stop_named 'pod-workers*'
# Workers left behind by a harness that was killed: their KUBECONFIG is in the run dir.
for f in "$RUN"/workers*.json; do
  [ -f "$f" ] || continue
  for pid in $(grep -o '"pid": *[0-9]*' "$f" | grep -o '[0-9]*$'); do
    if [ -r "/proc/$pid/environ" ] && tr '\0' '\n' <"/proc/$pid/environ" | grep -q "^KUBECONFIG=$RUN/"; then
      log "stopping orphaned worker (pid $pid)"; stop "$pid"
    fi
  done
done
# Memory cgroups of the harness's workers (hack/pod_workers.py names them after the run dir); a harness
# stopped normally removed its own.
run_id=$(printf '%s' "$(realpath -m "$RUN")" | sha256sum | cut -c1-8)
for d in /sys/fs/cgroup/memory/moeguard-pods-"$run_id"-* /sys/fs/cgroup/unified/moeguard-pods-"$run_id"-* \
  /sys/fs/cgroup/moeguard-pods-"$run_id"-*; do
  [ -d "$d" ] || continue
  for p in $(cat "$d"/*/cgroup.procs 2>/dev/null); do log "stopping worker left in $d (pid $p)"; stop "$p"; done
  find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || log "could not remove cgroup $d"
done
stop_named lws-manager kwok kube-scheduler kube-controller-manager prometheus
stop_named kube-apiserver
stop_named etcd
# Stragglers: anything else still pointing into the run dir (not this script).
strays=()
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = $$ ] || [ "$p" = "$PPID" ] && continue
  ours "$p" && strays+=("$p")
done
if [ ${#strays[@]} -gt 0 ]; then
  log "stopping stragglers: ${strays[*]}"
  stop "${strays[@]}"
fi
if [ "$keep" = 0 ] && [ -d "$RUN" ]; then
  rm -rf "$RUN"
  log "removed $RUN"
fi
log "stopped"
