#!/usr/bin/env bash
# Install (once) and locate moto's server, a second SQS-compatible server the tests use where
# ElasticMQ cannot help (it accepts any credentials and has one region), from PyPI into a
# version-keyed virtualenv outside the repo:
#
#   scripts/moto.sh   # prints the path of moto_server (installing it if missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/moto-<MOTO_VERSION>/venv
# MOTO_SERVER=/path/to/moto_server skips the install (checked and printed as is).
set -euo pipefail

MOTO_VERSION=5.2.5
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/moto-${MOTO_VERSION}"
VENV="$CACHE_DIR/venv"
MARKER="$CACHE_DIR/.complete"

log() { printf '[moto] %s\n' "$*" >&2; }
die() { printf '[moto] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${MOTO_SERVER:-}" ]]; then
  [[ -x "$MOTO_SERVER" ]] || die "MOTO_SERVER=$MOTO_SERVER is not an executable"
  printf '%s\n' "$MOTO_SERVER"
  exit 0
fi
if [[ -f "$MARKER" ]]; then
  printf '%s\n' "$VENV/bin/moto_server"
  exit 0
fi
command -v python3 >/dev/null 2>&1 || die "python3 is required for moto; install it with: apt-get install -y python3 python3-venv"
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.lock"
flock 9
if [[ ! -f "$MARKER" ]]; then
  log "installing moto[server]==${MOTO_VERSION} into $VENV ..."
  rm -rf "$VENV"
  python3 -m venv "$VENV" || die "python3 -m venv failed; install it with: apt-get install -y python3-venv"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "moto[server]==${MOTO_VERSION}" >&2
  "$VENV/bin/moto_server" --help >/dev/null
  touch "$MARKER"
fi
printf '%s\n' "$VENV/bin/moto_server"
