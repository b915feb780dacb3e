#!/usr/bin/env bash
# Build (once) and locate Ory Hydra (an OAuth2 server issuing JWT access tokens), from the Go
# module proxy, into a version-keyed cache outside the repo:
#
#   scripts/hydra.sh   # prints the path of the hydra binary (building it when missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/hydra-<HYDRA_VERSION>/bin/hydra
# HYDRA_BIN=/path/to/hydra skips the build (the path is checked and printed as is).
# Progress goes to stderr; stdout carries only the path. See docs/brokers.md.
#
# `go install github.com/ory/hydra/v2@v2.3.0` is refused (Hydra's go.mod has replace
# directives), so the build goes through a throwaway wrapper module that requires Hydra as a
# tool (`go get -tool`) with Hydra's replace directives copied, then `go build` of that tool.
set -euo pipefail

HYDRA_VERSION="${HYDRA_VERSION:-2.3.0}"
HYDRA_VERSION="${HYDRA_VERSION#v}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/hydra-${HYDRA_VERSION}"
BIN="$CACHE_DIR/bin/hydra"

log() { printf '[hydra] %s\n' "$*" >&2; }
die() { printf '[hydra] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${HYDRA_BIN:-}" ]]; then
  [[ -x "$HYDRA_BIN" ]] || die "HYDRA_BIN=$HYDRA_BIN is not an executable file"
  printf '%s\n' "$HYDRA_BIN"
  exit 0
fi

if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
[[ -n "$GO" ]] || die "Go is required to build Ory Hydra v${HYDRA_VERSION} but was not found.
  Install Go >= 1.24 from https://go.dev/dl/ (e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH)
  or set GO=/path/to/go, or HYDRA_BIN=/path/to/an/existing/hydra."

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binary.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

log "building hydra v${HYDRA_VERSION} with $("$GO" version) into $CACHE_DIR (several minutes, once)"
started=$SECONDS
# The wrapper module and the output are scratch folders, then one rename: a killed build never
# leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.build.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
# `DSN=memory` is SQLite in memory: Hydra's SQLite driver (mattn/go-sqlite3) needs cgo and the
# `sqlite` build tag, as in Hydra's own release builds.
export GOWORK=off GO111MODULE=on CGO_ENABLED=1
export GOPATH="$CACHE_DIR/gopath" GOCACHE="$CACHE_DIR/gocache" GOFLAGS="-modcacherw -buildvcs=false"
(
  cd "$staging"
  "$GO" mod init switchboard.invalid/hydra-build >&2
  # Hydra's own replace directives (a fork of pop, its bundled API client) do not apply to a
  # module that requires it: the wrapper repeats them (local paths resolved in Hydra's source).
  hydra_dir="$("$GO" mod download -json "github.com/ory/hydra/v2@v${HYDRA_VERSION}" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -d "$hydra_dir" ]] || die "could not download github.com/ory/hydra/v2@v${HYDRA_VERSION}"
  "$GO" mod edit -json "$hydra_dir/go.mod" | python3 -c '
import json, os, sys
for r in json.load(sys.stdin).get("Replace") or []:
    new = r["New"]
    target = new["Path"] + ("@" + new["Version"] if new.get("Version") else "")
    if not new.get("Version"):
        # A nested module (its bundled API client) is not part of the module zip: the
        # required version from the proxy is used instead.
        target = os.path.normpath(os.path.join(sys.argv[1], target))
        if not os.path.isdir(target):
            continue
    print(r["Old"]["Path"] + "=" + target)
' "$hydra_dir" | while read -r replace; do
    "$GO" mod edit -replace "$replace"
  done
  "$GO" get -tool "github.com/ory/hydra/v2@v${HYDRA_VERSION}" >&2
  # The version `hydra version` prints.
  "$GO" build -trimpath -tags sqlite,sqlite_omit_load_extension -o "$staging/hydra" \
    -ldflags "-s -w -X github.com/ory/hydra/v2/driver/config.Version=v${HYDRA_VERSION}" \
    github.com/ory/hydra/v2 >&2
)
mkdir -p "$(dirname "$BIN")"
mv "$staging/hydra" "$BIN"
log "built $BIN in $((SECONDS - started)) s"
printf '%s\n' "$BIN"
