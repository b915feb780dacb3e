#!/usr/bin/env bash
# Build (once) and locate KEDA's operator (the part that reads each ScaledObject's triggers and
# scales a Deployment between zero and one; the HPA does the rest), from the Go module proxy, into
# a version-keyed cache outside the repo, for the scale-to-zero test:
#
#   scripts/keda-operator.sh   # prints the path of the keda-operator binary (building it when missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/keda-<KEDA_VERSION>/keda-operator, built
# from github.com/kedacore/keda/v2@v<KEDA_VERSION>'s own go.mod (the module scripts/keda-crds.sh
# takes the CRDs from). KEDA_OPERATOR_BIN=/path skips the build. Progress goes to stderr; stdout
# carries only the path. See docs/testing.md.
set -euo pipefail

KEDA_VERSION="${KEDA_VERSION:-2.21.0}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/keda-${KEDA_VERSION}"
BIN="$CACHE_DIR/keda-operator"

log() { printf '[keda-operator] %s\n' "$*" >&2; }
die() { printf '[keda-operator] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${KEDA_OPERATOR_BIN:-}" ]]; then
  [[ -x "$KEDA_OPERATOR_BIN" ]] || die "KEDA_OPERATOR_BIN=$KEDA_OPERATOR_BIN is not an executable file"
  printf '%s\n' "$KEDA_OPERATOR_BIN"
  exit 0
fi
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -n "$GO" ]] || die "Go is required to build KEDA v${KEDA_VERSION}'s operator (install Go >= 1.26), or set KEDA_OPERATOR_BIN=/path"

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binary.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

crds="$(KEDA_VERSION="$KEDA_VERSION" KEDA_CRDS= "$(dirname "$0")/keda-crds.sh")"
module="${crds%/config/crd/bases}"
log "building keda-operator v${KEDA_VERSION} with $("$GO" version) into $CACHE_DIR (about 10 minutes, once)"
started=$SECONDS
# Written aside, then one rename: a killed build never leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.build.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
(
  cd "$module"
  GOWORK=off GO111MODULE=on CGO_ENABLED=0 GOFLAGS="-modcacherw -buildvcs=false" \
    "$GO" build -trimpath -ldflags "-s -w" -o "$staging/keda-operator" ./cmd/operator >&2
)
mv "$staging/keda-operator" "$BIN"
log "built $BIN in $((SECONDS - started)) s"
printf '%s\n' "$BIN"
