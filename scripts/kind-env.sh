# Sourced by scripts/kind-{up,demo,down}.sh: names shared by the kind path (docs/kubernetes.md).
#
#   KIND_CLUSTER   cluster name                          (default: switchboard)
#   IMAGE          image built and `kind load`ed         (default: the chart's default image,
#                  ghcr.io/switchboard/switchboard:<workspace version>)
#   HELM           helm binary                           (default: helm on PATH, else scripts/helm.sh)
#   KIND_DRY_RUN=1 print the commands that change something instead of running them
#                  (the tests check the kind path this way; there is no Docker on CI)
# shellcheck shell=bash
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

KIND_CLUSTER="${KIND_CLUSTER:-switchboard}"
# The workspace version ([workspace.package] in Cargo.toml) is the chart's appVersion, hence the
# tag its Deployment and the operator's worker default use.
VERSION="$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)"
IMAGE="${IMAGE:-ghcr.io/switchboard/switchboard:${VERSION}}"
OPERATOR_NAMESPACE=switchboard
DEV_NAMESPACE=switchboard-dev
RELEASE=switchboard

say() { printf '\n==> %s\n' "$*" >&2; }

# Runs a command, or prints it under KIND_DRY_RUN=1.
run() {
  if [[ -n "${KIND_DRY_RUN:-}" ]]; then
    printf '+ %s\n' "$*"
  else
    "$@"
  fi
}

need() {
  [[ -n "${KIND_DRY_RUN:-}" ]] && return 0
  command -v "$1" >/dev/null 2>&1 || {
    printf 'error: %s is required for the kind path: %s\n' "$1" "$2" >&2
    exit 1
  }
}

helm_binary() {
  if [[ -n "${HELM:-}" ]]; then printf '%s\n' "$HELM"
  elif [[ -n "${KIND_DRY_RUN:-}" ]] || command -v helm >/dev/null 2>&1; then printf 'helm\n'
  else scripts/helm.sh
  fi
}
