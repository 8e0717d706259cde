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
