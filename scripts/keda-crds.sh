#!/usr/bin/env bash
# Locate (downloading once) KEDA's CRDs from the Go module proxy, for the autoscaling tests:
#
#   scripts/keda-crds.sh     # prints the directory holding keda.sh_scaledobjects.yaml etc.
#
# The module github.com/kedacore/keda/v2@v<KEDA_VERSION> lands in the Go module cache
# ($GOMODCACHE, read-only files); KEDA_CRDS=/dir skips the download. stdout carries only the path.
set -euo pipefail

KEDA_VERSION="${KEDA_VERSION:-2.21.0}"
die() { printf '[keda-crds] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${KEDA_CRDS:-}" ]]; then
  [[ -f "$KEDA_CRDS/keda.sh_scaledobjects.yaml" ]] || die "KEDA_CRDS=$KEDA_CRDS has no keda.sh_scaledobjects.yaml"
  printf '%s\n' "$KEDA_CRDS"
  exit 0
fi
GO="${GO:-$(command -v go || true)}"
[[ -n "$GO" ]] || die "Go is required to download KEDA v${KEDA_VERSION}'s CRDs (install Go >= 1.24), or set KEDA_CRDS=/dir"
dir="$(GOFLAGS=-modcacherw "$GO" mod download -json "github.com/kedacore/keda/v2@v${KEDA_VERSION}" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -n "$dir" && -f "$dir/config/crd/bases/keda.sh_scaledobjects.yaml" ]] \
  || die "go mod download github.com/kedacore/keda/v2@v${KEDA_VERSION} gave no CRDs (dir: ${dir:-none})"
printf '%s\n' "$dir/config/crd/bases"
