#!/usr/bin/env bash
# Build (once) and locate nats-server, from the Go module proxy, into a version-keyed cache outside
# the repo:
#
#   scripts/nats-server.sh   # prints the path of the nats-server binary (building it when missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/nats-server-<NATS_SERVER_VERSION>/bin/nats-server
# (Debian's nats-server is 2.9, too old for the consumer features the tests use.)
# NATS_SERVER_BIN=/path/to/nats-server skips the build (the path is checked and printed as is).
# Progress goes to stderr; stdout carries only the path. See docs/brokers.md.
set -euo pipefail

NATS_SERVER_VERSION=2.15.2
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/nats-server-${NATS_SERVER_VERSION}"
BIN="$CACHE_DIR/bin/nats-server"

log() { printf '[nats-server] %s\n' "$*" >&2; }
die() { printf '[nats-server] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${NATS_SERVER_BIN:-}" ]]; then
  [[ -x "$NATS_SERVER_BIN" ]] || die "NATS_SERVER_BIN=$NATS_SERVER_BIN is not an executable file"
  printf '%s\n' "$NATS_SERVER_BIN"
  exit 0
fi

if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
[[ -n "$GO" ]] || die "Go is required to build nats-server v${NATS_SERVER_VERSION} but was not found.
  Install Go >= 1.24 from https://go.dev/dl/ (e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH)
  or set GO=/path/to/go, or NATS_SERVER_BIN=/path/to/an/existing/nats-server."

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binary.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

log "building nats-server v${NATS_SERVER_VERSION} with $("$GO" version) into $CACHE_DIR (a few minutes, once)"
started=$SECONDS
# GOBIN is a scratch folder, then one rename: a killed build never leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.gobin.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
export GOWORK=off GO111MODULE=on CGO_ENABLED=0
GOPATH="$CACHE_DIR/gopath" GOCACHE="$CACHE_DIR/gocache" GOFLAGS=-modcacherw GOBIN="$staging" \
  "$GO" install -trimpath "github.com/nats-io/nats-server/v2@v${NATS_SERVER_VERSION}" >&2
mkdir -p "$(dirname "$BIN")"
mv "$staging/nats-server" "$BIN"
log "built $BIN in $((SECONDS - started)) s"
printf '%s\n' "$BIN"
