#!/usr/bin/env bash
# Build (once) and locate Prometheus and promtool, from the Go module proxy, into a
# version-keyed cache outside the repo:
#
#   scripts/prometheus.sh   # prints the directory holding `prometheus` and `promtool`
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/prometheus-<PROMETHEUS_VERSION>/bin
# PROMETHEUS_BIN_DIR=/path/to/dir skips the build (the directory must hold both executables; it is
# printed as is). Progress goes to stderr; stdout carries only the path. See docs/kubernetes.md.
#
# The Go module's tags are v0.3xx.y for Prometheus 3.xx.y: v0.316.0 is Prometheus 3.16.0.
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-0.316.0}"
PROMETHEUS_VERSION="${PROMETHEUS_VERSION#v}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/prometheus-${PROMETHEUS_VERSION}"
BIN_DIR="$CACHE_DIR/bin"
BINARIES=(prometheus promtool)

log() { printf '[prometheus] %s\n' "$*" >&2; }
die() { printf '[prometheus] error: %s\n' "$*" >&2; exit 1; }

complete() {
  local binary
  for binary in "${BINARIES[@]}"; do
    [[ -x "$1/$binary" ]] || return 1
  done
}

if [[ -n "${PROMETHEUS_BIN_DIR:-}" ]]; then
  complete "$PROMETHEUS_BIN_DIR" \
    || die "PROMETHEUS_BIN_DIR=$PROMETHEUS_BIN_DIR does not hold executable ${BINARIES[*]}"
  printf '%s\n' "$PROMETHEUS_BIN_DIR"
  exit 0
fi

if complete "$BIN_DIR"; then
  printf '%s\n' "$BIN_DIR"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
[[ -n "$GO" ]] || die "Go is required to build Prometheus v${PROMETHEUS_VERSION} but was not found.
  Install Go >= 1.26 from https://go.dev/dl/ (e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH)
  or set GO=/path/to/go, or PROMETHEUS_BIN_DIR=/path/to/a/dir/with/prometheus/and/promtool."

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binaries.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if complete "$BIN_DIR"; then
  printf '%s\n' "$BIN_DIR"
  exit 0
fi

log "building prometheus and promtool v${PROMETHEUS_VERSION} with $("$GO" version) into $CACHE_DIR (several minutes, once)"
started=$SECONDS
# GOBIN is a scratch folder, then one rename: a killed build never leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.gobin.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
export GOWORK=off GO111MODULE=on CGO_ENABLED=0
# The version stamp of Prometheus' own build (promu): `prometheus --version` says 3.x.y. Built
# for the tests: `remove_all_sd` leaves out every service discovery but static and file configs
# (the cloud SDKs are most of the build), and without the `builtinassets` tag the web UI is not
# embedded; the HTTP API and the rule engine are complete.
IFS=. read -r _ module_minor patch <<<"$PROMETHEUS_VERSION"
release="$((10#$module_minor / 100)).$((10#$module_minor % 100)).${patch}"
ldflags="-s -w -X github.com/prometheus/common/version.Version=${release}"
packages=()
for binary in "${BINARIES[@]}"; do
  packages+=("github.com/prometheus/prometheus/cmd/${binary}@v${PROMETHEUS_VERSION}")
done
GOBIN="$staging" "$GO" install -trimpath -tags remove_all_sd -ldflags "$ldflags" "${packages[@]}" >&2
mkdir -p "$BIN_DIR"
for binary in "${BINARIES[@]}"; do
  mv "$staging/$binary" "$BIN_DIR/$binary"
done
log "built ${BINARIES[*]} (Prometheus ${release}) in $BIN_DIR in $((SECONDS - started)) s"
printf '%s\n' "$BIN_DIR"
