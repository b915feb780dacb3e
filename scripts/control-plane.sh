#!/usr/bin/env bash
# Build (once) and locate a real etcd + kube-apiserver + kubectl for local, Docker-free
# integration tests (the "envtest" shape: no kubelet, just the API server and its store).
#
#   scripts/control-plane.sh bin-dir           # prints a directory holding etcd, kube-apiserver, kubectl
#   scripts/control-plane.sh cluster-bin-dir   # … plus kubelet, kube-controller-manager,
#                                              # kube-scheduler and kube-proxy (the real-cluster tier)
#
# Binaries are built from the Go module proxy into a version-keyed cache outside the repo:
#   ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/control-plane/k8s-v<K8S>-etcd-v<ETCD>/bin
# If KUBEBUILDER_ASSETS names a folder holding etcd and kube-apiserver, that folder is used and
# nothing is built (except kubectl, when the folder lacks it). For cluster-bin-dir it is used when
# it holds all seven binaries. The cluster binaries share the wrapper module and Go build cache of
# kube-apiserver, so their common packages compile once.
#
# Progress goes to stderr; stdout carries only the resulting path. See docs/control-plane.md.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
K8S_VERSION="${K8S_VERSION#v}"
ETCD_VERSION="${ETCD_VERSION#v}"

CACHE_ROOT="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/control-plane"
CACHE_DIR="$CACHE_ROOT/k8s-v${K8S_VERSION}-etcd-v${ETCD_VERSION}"
BIN_DIR="$CACHE_DIR/bin"

log() { printf '[control-plane] %s\n' "$*" >&2; }
die() { printf '[control-plane] error: %s\n' "$*" >&2; exit 1; }

usage() {
  cat >&2 <<EOF
usage: $0 bin-dir | cluster-bin-dir

  bin-dir          print a directory containing etcd, kube-apiserver and kubectl
                   (building them into the cache if missing; ~6-25 min cold, 2 cores)
  cluster-bin-dir  the same directory, also holding kubelet, kube-controller-manager,
                   kube-scheduler and kube-proxy (docs/cluster.md)

environment:
  K8S_VERSION        Kubernetes version to build        (default 1.34.4)
  ETCD_VERSION       etcd version to build              (default 3.6.16)
  SWITCHBOARD_CACHE  cache root                         (default \$HOME/.cache/switchboard)
  KUBEBUILDER_ASSETS folder with prebuilt etcd + kube-apiserver (+ kubectl); skips the build
  GO                 go binary to use                   (default: go on PATH, /usr/local/go/bin/go)
EOF
}

# The binaries built from k8s.io/kubernetes (one wrapper module, one Go build cache).
K8S_BINARIES=(kube-apiserver kubectl kubelet kube-controller-manager kube-scheduler kube-proxy)
CLUSTER_BINARIES=(etcd "${K8S_BINARIES[@]}")

# Staging modules are versioned v0.<minor>.<patch> alongside k8s.io/kubernetes v1.<minor>.<patch>.
STAGING_VERSION="v0.${K8S_VERSION#*.}"

have_exe() { [[ -f "$1" && -x "$1" && -s "$1" ]]; }

find_go() {
  if [[ -n "${GO:-}" ]]; then
    command -v "$GO" >/dev/null 2>&1 || die "GO=$GO is not an executable"
    return
  fi
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"; return; fi
  if [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go; return; fi
  die "Go is required to build etcd/kube-apiserver/kubectl but was not found.
  Install Go (etcd v3.6.16 needs Go >= 1.26; an older Go >= 1.21 fetches the needed toolchain
  itself via GOTOOLCHAIN=auto) from https://go.dev/dl/ , e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH
  or set GO=/path/to/go. Alternatively point KUBEBUILDER_ASSETS at a folder holding
  prebuilt etcd and kube-apiserver binaries."
}

# Run go with a clean, predictable environment: no workspace, module mode on.
gocmd() { GOWORK=off GO111MODULE=on "$GO" "$@"; }

# Serialise builds across concurrent callers. The lock is held until the script exits.
take_lock() {
  mkdir -p "$CACHE_DIR"
  local lock="$CACHE_DIR/.build.lock"
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$lock"
    if ! flock -n 9; then
      log "another build holds $lock; waiting..."
      flock 9
    fi
  else
    # Fallback (e.g. macOS): mkdir is atomic. A stale lock dir must be removed by hand.
    until mkdir "$lock.d" 2>/dev/null; do
      log "waiting for $lock.d (remove it if no build is running)"; sleep 5
    done
    trap 'rmdir "$CACHE_DIR/.build.lock.d" 2>/dev/null || true' EXIT
  fi
}

# Wrapper module for k8s.io/kubernetes: require it and map every staging module
# (derived from the `=> ./staging/src/` lines of its go.mod) to its published v0.x version.
prepare_k8s_wrapper() {
  local dir="$CACHE_DIR/src/kubernetes" gomod_path
  mkdir -p "$dir"
  log "resolving k8s.io/kubernetes@v${K8S_VERSION} (downloads the module on first use)"
  gomod_path="$(cd "$CACHE_DIR" && gocmd mod download -json "k8s.io/kubernetes@v${K8S_VERSION}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -n "$gomod_path" && -f "$gomod_path" ]] || die "could not locate go.mod of k8s.io/kubernetes@v${K8S_VERSION}"

  local go_line staging
  go_line="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod_path" | head -n1)"
  staging="$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$gomod_path" | sort -u)"
  [[ -n "$staging" ]] || die "no staging replace lines found in $gomod_path"
  log "$(wc -l <<<"$staging" | tr -d ' ') staging modules -> ${STAGING_VERSION}"

  {
    echo "// Generated by scripts/control-plane.sh; do not edit."
    echo "module switchboard.local/control-plane/kubernetes"
    echo
    echo "go ${go_line:-1.24.0}"
    echo
    echo "require k8s.io/kubernetes v${K8S_VERSION}"
    echo
    echo "replace ("
    while read -r m; do echo "	$m => $m ${STAGING_VERSION}"; done <<<"$staging"
    echo ")"
  } >"$dir/go.mod.tmp"
  mv -f "$dir/go.mod.tmp" "$dir/go.mod"
  rm -f "$dir/go.sum"
  # Resolve the full module graph (adds requirements and go.sum entries for these packages).
  log "resolving dependencies of ${K8S_BINARIES[*]}"
  local packages=() name
  for name in "${K8S_BINARIES[@]}"; do packages+=("k8s.io/kubernetes/cmd/$name@v${K8S_VERSION}"); done
  (cd "$dir" && gocmd get "${packages[@]}") >&2
}

# Build one main package of the wrapper module into $BIN_DIR/<name>, atomically.
build_into_bin() { # <module dir> <package> <name> [extra ldflags]
  local dir="$1" pkg="$2" name="$3" ldflags="-s -w ${4:-}" tmp start
  tmp="$BIN_DIR/.${name}.tmp.$$"
  start=$SECONDS
  log "building $name from $pkg (this can take a while)"
  (cd "$dir" && CGO_ENABLED=0 gocmd build -mod=mod -trimpath -ldflags="$ldflags" -o "$tmp" "$pkg") >&2 \
    || { rm -f "$tmp"; die "go build of $pkg failed"; }
  chmod +x "$tmp"
  mv -f "$tmp" "$BIN_DIR/$name"
  log "built $BIN_DIR/$name in $((SECONDS - start))s ($(du -h "$BIN_DIR/$name" | cut -f1))"
}

build_k8s() { # <names...> out of kube-apiserver kubectl
  prepare_k8s_wrapper
  # Stamp the version like hack/lib/version.sh does; otherwise /version and `kubectl version`
  # report v0.0.0-master+$Format:%H$. The commit is not known from the module proxy.
  local minor="${K8S_VERSION#*.}" x="" kv key val name
  minor="${minor%%.*}"
  for kv in "gitVersion=v${K8S_VERSION}" "gitMajor=${K8S_VERSION%%.*}" "gitMinor=${minor}" \
            "gitTreeState=clean" "buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; do
    key="${kv%%=*}" val="${kv#*=}"
    x+=" -X k8s.io/component-base/version.${key}=${val} -X k8s.io/client-go/pkg/version.${key}=${val}"
  done
  for name in "$@"; do
    build_into_bin "$CACHE_DIR/src/kubernetes" "k8s.io/kubernetes/cmd/$name" "$name" "$x"
  done
}

build_etcd() {
  local dir="$CACHE_DIR/src/etcd"
  mkdir -p "$dir"
  {
    echo "// Generated by scripts/control-plane.sh; do not edit."
    echo "module switchboard.local/control-plane/etcd"
    echo
    echo "go 1.24.0"
    echo
    echo "require go.etcd.io/etcd/server/v3 v${ETCD_VERSION}"
  } >"$dir/go.mod.tmp"
  mv -f "$dir/go.mod.tmp" "$dir/go.mod"
  rm -f "$dir/go.sum"
  log "resolving go.etcd.io/etcd/server/v3@v${ETCD_VERSION}"
  (cd "$dir" && gocmd get "go.etcd.io/etcd/server/v3@v${ETCD_VERSION}") >&2
  build_into_bin "$dir" go.etcd.io/etcd/server/v3 etcd
}

ensure_built() { # <names...>: build whichever of them is missing from $BIN_DIR
  local missing=() n
  for n in "$@"; do have_exe "$BIN_DIR/$n" || missing+=("$n"); done
  ((${#missing[@]})) || return 0

  find_go
  take_lock
  # Re-check under the lock: a concurrent caller may have built them meanwhile.
  missing=()
  for n in "$@"; do have_exe "$BIN_DIR/$n" || missing+=("$n"); done
  ((${#missing[@]})) || return 0
  mkdir -p "$BIN_DIR"
  rm -f "$BIN_DIR"/.*.tmp.* 2>/dev/null || true   # leftovers of killed builds (we hold the lock)
  log "cache: $CACHE_DIR; building: ${missing[*]} (go: $("$GO" version))"

  local k8s=()
  for n in "${missing[@]}"; do
    case "$n" in
      etcd) build_etcd ;;
      kube-apiserver | kubectl | kubelet | kube-controller-manager | kube-scheduler | kube-proxy)
        k8s+=("$n") ;;
      *) die "unknown binary $n" ;;
    esac
  done
  ((${#k8s[@]} == 0)) || build_k8s "${k8s[@]}"
}

cmd_bin_dir() {
  if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
    local assets
    assets="$(cd "$KUBEBUILDER_ASSETS" 2>/dev/null && pwd)" \
      || die "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS is not a directory"
    if have_exe "$assets/etcd" && have_exe "$assets/kube-apiserver"; then
      if have_exe "$assets/kubectl"; then
        log "using KUBEBUILDER_ASSETS=$assets"
        echo "$assets"
        return
      fi
      # Combine the given etcd/apiserver with a cached kubectl in a folder of symlinks.
      log "KUBEBUILDER_ASSETS=$assets has no kubectl; using a cached kubectl v${K8S_VERSION}"
      ensure_built kubectl
      local combo
      combo="$CACHE_ROOT/assets-$(printf '%s' "$assets" | sha256sum | cut -c1-12)-k8s-v${K8S_VERSION}"
      mkdir -p "$combo"
      ln -sfn "$assets/etcd" "$combo/etcd"
      ln -sfn "$assets/kube-apiserver" "$combo/kube-apiserver"
      ln -sfn "$BIN_DIR/kubectl" "$combo/kubectl"
      echo "$combo"
      return
    fi
    log "KUBEBUILDER_ASSETS=$assets lacks etcd or kube-apiserver; ignoring it"
  fi
  ensure_built etcd kube-apiserver kubectl
  echo "$BIN_DIR"
}

cmd_cluster_bin_dir() {
  if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
    local assets n complete=1
    assets="$(cd "$KUBEBUILDER_ASSETS" 2>/dev/null && pwd)" \
      || die "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS is not a directory"
    for n in "${CLUSTER_BINARIES[@]}"; do have_exe "$assets/$n" || complete=0; done
    if ((complete)); then
      log "using KUBEBUILDER_ASSETS=$assets"
      echo "$assets"
      return
    fi
    log "KUBEBUILDER_ASSETS=$assets lacks one of ${CLUSTER_BINARIES[*]}; ignoring it"
  fi
  ensure_built "${CLUSTER_BINARIES[@]}"
  echo "$BIN_DIR"
}

case "${1:-}" in
  bin-dir) cmd_bin_dir ;;
  cluster-bin-dir) cmd_cluster_bin_dir ;;
  -h | --help | help) usage ;;
  *) usage; exit 2 ;;
esac
