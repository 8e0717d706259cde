# Shared shell helpers for hack/ scripts. Source after versions.env.
MOEGUARD_CACHE=${MOEGUARD_CACHE:-$HOME/.cache/moeguard}
# bin_dir COMPONENT -> the cache folder of that component's pinned version.
bin_dir() {
  case "$1" in
    etcd) echo "$MOEGUARD_CACHE/bin/etcd-$ETCD_VERSION" ;;
    kwok) echo "$MOEGUARD_CACHE/bin/kwok-$KWOK_VERSION" ;;
    helm) echo "$MOEGUARD_CACHE/bin/helm-$HELM_VERSION" ;;
    lws) echo "$MOEGUARD_CACHE/bin/lws-$LWS_VERSION" ;;
    kubernetes) echo "$MOEGUARD_CACHE/bin/kubernetes-$KUBERNETES_VERSION" ;;
    node) echo "$MOEGUARD_CACHE/bin/node-$KUBERNETES_VERSION" ;;
    *) echo "unknown component $1" >&2; return 1 ;;
  esac
}
# tools_path -> a PATH prefix holding every pinned binary.
tools_path() {
  local p="" c
  for c in kubernetes etcd kwok helm; do p="$p$(bin_dir "$c"):"; done
  echo "${p%:}"
}

# --- daemons of a run dir: the calling script sets RUN and defines log and die ---
# alive NAME: its pid file names a live process whose command line points into
# the run dir (so a recycled pid is not mistaken for ours).
alive() {
  local f="$RUN/pids/$1.pid" pid
  [ -f "$f" ] && pid=$(cat "$f") && ours "$pid"
}

# ours PID: the process's command line points into the run dir. No pipe into grep -q: under
# pipefail, tr killed by SIGPIPE when grep quits early made a live daemon look dead.
ours() {
  local cmd
  [ -r "/proc/$1/cmdline" ] || return 1
  cmd=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null) || return 1
  [[ "$cmd" == *"$RUN/"* ]]
}

# start NAME CMD...: start CMD in its own session unless NAME is alive.
start() {
  local name=$1; shift
  if alive "$name"; then log "$name already running (pid $(cat "$RUN/pids/$name.pid"))"; return 0; fi
  printf '\n=== %s start %s\n' "$(date -Is)" "$name" >>"$RUN/logs/$name.log"
  (
    # The daemon keeps no descriptor of ours but 0-2: under `flock LOCK hack/cluster-up.sh` it would
    # otherwise hold LOCK for as long as the cluster runs.
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ]; then eval "exec $fd>&-"; fi
    done
    exec setsid "$@"
  ) >>"$RUN/logs/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$RUN/pids/$name.pid"
  # Until the subshell has exec'd, its command line is this script's, not the daemon's, and alive
  # would call it dead (wait_for then failed "exited before it was healthy" on a loaded machine):
  # wait for the exec (or the death) before anyone asks.
  for _ in $(seq 1 100); do
    alive "$name" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  log "started $name (pid $pid, log $RUN/logs/$name.log)"
}

# wait_for NAME TIMEOUT_S CHECK...: poll CHECK; fail early if NAME's process died.
wait_for() {
  local name=$1 timeout=$2; shift 2
  local deadline=$(($(date +%s) + timeout))
  until "$@"; do
    if ! alive "$name"; then
      tail -n 20 "$RUN/logs/$name.log" >&2 || true
      die "$name exited before it was healthy; see $RUN/logs/$name.log"
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -n 20 "$RUN/logs/$name.log" >&2 || true
      die "$name not healthy after ${timeout}s ($*); see $RUN/logs/$name.log"
    fi
    sleep 0.2
  done
  log "$name healthy"
}
