#!/usr/bin/env bash
# Builds the images of the real-cluster tier without Docker or a registry, with buildah:
#   - localhost/switchboard/switchboard:<hash>  FROM scratch + switchboard-operator and
#     switchboard-worker in /usr/local/bin + exactly the shared libraries `ldd` lists for them,
#     user 65532:65532, nothing else (no shell, no CA bundle, no /etc/passwd);
#   - localhost/switchboard/pause:<hash>        FROM scratch + scripts/cluster-pause.c built
#     with `gcc -static` (the sandbox image of containerd).
# Each is exported as an oci-archive into a cache keyed by the hash of its contents:
#   ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/cluster-images/<name>-<hash>.tar
# and printed on stdout as `<image ref> <archive>`, one line per image (switchboard first).
#
#   scripts/cluster-image.sh <folder holding switchboard-operator and switchboard-worker>
#
# `make image` passes the dist binaries (release + fat LTO); the tests pass the binaries of their own profile.
# buildah runs with its own storage (vfs: no mounts) in a temporary folder; the files it creates
# on the host (/var/lib/containers/cache, /etc/cni/net.d/cni.lock) are removed again when they
# were not there before. See docs/cluster.md.
set -euo pipefail

log() { printf '[cluster-image] %s\n' "$*" >&2; }
die() { printf '[cluster-image] error: %s\n' "$*" >&2; exit 1; }

BIN_DIR="${1:-}"
[[ -n "$BIN_DIR" ]] || die "usage: $0 <folder holding switchboard-operator and switchboard-worker>"
BINARIES=(switchboard-operator switchboard-worker)
for b in "${BINARIES[@]}"; do
  [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b is missing: build it first (cargo build --bins)"
done
for tool in buildah gcc ldd sha256sum; do
  command -v "$tool" >/dev/null 2>&1 \
    || die "$tool is missing; install the real-cluster packages with: make deps (scripts/install-deps.sh)"
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/cluster-images"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

# Host paths buildah may create; removed at exit unless they existed before.
HOST_PATHS=(/var/lib/containers /etc/cni/net.d/cni.lock /etc/cni/net.d /etc/cni)
existing=()
for p in "${HOST_PATHS[@]}"; do [[ -e "$p" ]] && existing+=("$p"); done
WORK="$(mktemp -d "${TMPDIR:-/tmp}/switchboard-image.XXXXXX")"
cleanup() {
  buildah --root "$WORK/root" --runroot "$WORK/runroot" --storage-driver vfs rm --all >/dev/null 2>&1 || true
  rm -rf "$WORK"
  local p e keep
  for p in "${HOST_PATHS[@]}"; do
    keep=0
    for e in "${existing[@]}"; do [[ "$e" == "$p" ]] && keep=1; done
    ((keep)) || rm -rf "$p" 2>/dev/null || rmdir "$p" 2>/dev/null || true
  done
}
trap cleanup EXIT

bah() { buildah --root "$WORK/root" --runroot "$WORK/runroot" --storage-driver vfs "$@"; }

# build <name> <user> <entrypoint> <rootfs>: a scratch image holding the folder <rootfs> as /.
build() {
  local name="$1" user="$2" entrypoint="$3" rootfs="$4" hash ref archive ctr
  hash="$( (printf '%s\n' "$user" "$entrypoint"; cd "$rootfs" && find . -type f | LC_ALL=C sort \
    | xargs sha256sum) | sha256sum | cut -c1-12)"
  ref="localhost/switchboard/$name:$hash"
  archive="$CACHE/$name-$hash.tar"
  if [[ ! -s "$archive" ]]; then
    local start=$SECONDS
    ctr="$(bah from --name "$name-$hash-$$" scratch)"
    bah copy "$ctr" "$rootfs/." / >/dev/null
    bah config --user "$user" --entrypoint "[\"$entrypoint\"]" --cmd '' \
      --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    bah commit --quiet "$ctr" "$ref" >/dev/null
    bah push --quiet "$ref" "oci-archive:$archive.tmp:$ref" >/dev/null
    mv -f "$archive.tmp" "$archive"
    # Keep the three newest archives of each image (every rebuild of the binaries adds one).
    ls -t "$CACHE/$name"-*.tar | tail -n +4 | xargs -r rm -f
    log "built $ref in $((SECONDS - start))s ($(du -h "$archive" | cut -f1))"
  fi
  echo "$ref $archive"
}

# The binaries at /usr/local/bin (like the Dockerfile) and every library they link, at its path.
ROOTFS="$WORK/switchboard"
mkdir -p "$ROOTFS/usr/local/bin"
for b in "${BINARIES[@]}"; do cp "$BIN_DIR/$b" "$ROOTFS/usr/local/bin/$b"; done
for lib in $(ldd "${BINARIES[@]/#/$BIN_DIR/}" \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*[^:]$/ {print $1}' | sort -u); do
  mkdir -p "$ROOTFS$(dirname "$lib")"
  cp -L "$lib" "$ROOTFS$lib"
done
build switchboard 65532:65532 /usr/local/bin/switchboard-operator "$ROOTFS"

mkdir -p "$WORK/pause"
gcc -static -O2 -s -o "$WORK/pause/pause" "$HERE/cluster-pause.c"
build pause 65535:65535 /pause "$WORK/pause"
