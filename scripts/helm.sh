#!/usr/bin/env bash
# Build (once) and locate helm, from the Go module proxy, into a version-keyed cache outside the
# repo:
#
#   scripts/helm.sh        # prints the path of the helm binary (building it when missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/helm/v<HELM_VERSION>/bin/helm
# HELM=/path/to/helm skips the build (the path is checked and printed as is).
# Progress goes to stderr; stdout carries only the path. See docs/kubernetes.md.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-3.22.0}"
HELM_VERSION="${HELM_VERSION#v}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/helm/v${HELM_VERSION}"
BIN="$CACHE_DIR/bin/helm"

log() { printf '[helm] %s\n' "$*" >&2; }
die() { printf '[helm] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${HELM:-}" ]]; then
  [[ -x "$HELM" ]] || die "HELM=$HELM is not an executable file"
  printf '%s\n' "$HELM"
  exit 0
fi

if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
[[ -n "$GO" ]] || die "Go is required to build helm v${HELM_VERSION} but was not found.
  Install Go >= 1.24 from https://go.dev/dl/ (e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH)
  or set GO=/path/to/go, or HELM=/path/to/an/existing/helm."

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binary.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

log "building helm v${HELM_VERSION} with $("$GO" version) into $CACHE_DIR (a few minutes, once)"
started=$SECONDS
# GOBIN is a scratch folder, then one rename: a killed build never leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.gobin.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
export GOWORK=off GO111MODULE=on CGO_ENABLED=0
# The version stamps helm's own Makefile sets: without them `helm version` says "v3.22" and
# `helm template`/`lint` assume Kubernetes v1.20 (failing any chart with a kubeVersion
# constraint). The Kubernetes version is that of the client-go helm is built with.
gomod="$("$GO" mod download -json "helm.sh/helm/v3@v${HELM_VERSION}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
client_go="$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$gomod")"
[[ -n "$client_go" ]] || die "cannot read the k8s.io/client-go version from $gomod"
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=v${HELM_VERSION}"
for pkg in pkg/lint/rules pkg/chartutil; do
  ldflags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$client_go"
done
GOBIN="$staging" "$GO" install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@v${HELM_VERSION}" >&2
mkdir -p "$(dirname "$BIN")"
mv "$staging/helm" "$BIN"
log "built $BIN in $((SECONDS - started)) s"
printf '%s\n' "$BIN"
