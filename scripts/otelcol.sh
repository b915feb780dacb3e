#!/usr/bin/env bash
# Build (once) and locate a minimal OpenTelemetry Collector (the OTLP receiver, gRPC and HTTP, and
# the contrib file exporter writing OTLP JSON lines), from the Go module proxy, into a
# version-keyed cache outside the repo:
#
#   scripts/otelcol.sh   # prints the path of the otelcol binary (building it when missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/otelcol-<OTELCOL_VERSION>/otelcol
# OTELCOL_BIN=/path/to/otelcol skips the build (the path is checked and printed as is; any
# collector with the `otlp` receiver and the `file` exporter will do). Progress goes to stderr;
# stdout carries only the path. See docs/testing.md.
#
# The collector's modules are released together: OTELCOL_VERSION (v0.x) names the core and contrib
# modules, OTELCOL_CORE_VERSION (v1.x) the stable core ones of the same release. v0.161.0 is the
# newest release whose contrib file exporter builds from the proxy.
set -euo pipefail

OTELCOL_VERSION="${OTELCOL_VERSION:-0.161.0}"
OTELCOL_VERSION="${OTELCOL_VERSION#v}"
OTELCOL_CORE_VERSION="${OTELCOL_CORE_VERSION:-1.67.0}"
OTELCOL_CORE_VERSION="${OTELCOL_CORE_VERSION#v}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/otelcol-${OTELCOL_VERSION}"
BIN="$CACHE_DIR/otelcol"

log() { printf '[otelcol] %s\n' "$*" >&2; }
die() { printf '[otelcol] error: %s\n' "$*" >&2; exit 1; }

if [[ -n "${OTELCOL_BIN:-}" ]]; then
  [[ -x "$OTELCOL_BIN" ]] || die "OTELCOL_BIN=$OTELCOL_BIN is not an executable file"
  printf '%s\n' "$OTELCOL_BIN"
  exit 0
fi

if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

GO="${GO:-$(command -v go || true)}"
[[ -z "$GO" && -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go
[[ -n "$GO" ]] || die "Go is required to build the OpenTelemetry Collector v${OTELCOL_VERSION} but was not found.
  Install Go >= 1.24 from https://go.dev/dl/ (e.g. on linux/amd64:
    curl -fsSL https://go.dev/dl/go1.26.0.linux-amd64.tar.gz | sudo tar -C /usr/local -xz
    export PATH=/usr/local/go/bin:\$PATH)
  or set GO=/path/to/go, or OTELCOL_BIN=/path/to/an/existing/otelcol."

mkdir -p "$CACHE_DIR"
# One build at a time; later callers wait and then find the binary.
exec 9>"$CACHE_DIR/.build.lock"
flock 9
if [[ -x "$BIN" ]]; then
  printf '%s\n' "$BIN"
  exit 0
fi

log "building otelcol v${OTELCOL_VERSION} with $("$GO" version) into $CACHE_DIR (several minutes, once)"
started=$SECONDS
# The main module and the output are a scratch folder, then one rename: a killed build never
# leaves a half binary.
staging="$(mktemp -d "$CACHE_DIR/.build.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
export GOWORK=off GO111MODULE=on CGO_ENABLED=0
export GOPATH="$CACHE_DIR/gopath" GOCACHE="$CACHE_DIR/gocache" GOFLAGS="-modcacherw -buildvcs=false"
cat >"$staging/main.go" <<GO
// A collector with only what the tests read: OTLP in, OTLP JSON lines out to a file.
package main

import (
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

func components() (otelcol.Factories, error) {
	receivers, err := otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	exporters, err := otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	return otelcol.Factories{
		Receivers: receivers,
		Exporters: exporters,
		Telemetry: otelconftelemetry.NewFactory(),
	}, nil
}

func main() {
	info := component.BuildInfo{
		Command:     "otelcol",
		Description: "Switchboard test collector (otlp receiver, file exporter)",
		Version:     "${OTELCOL_VERSION}",
	}
	settings := otelcol.CollectorSettings{
		BuildInfo: info,
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(), fileprovider.NewFactory(),
				},
				DefaultScheme: "env",
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
GO
(
  cd "$staging"
  "$GO" mod init switchboard.invalid/otelcol-build >&2
  "$GO" get \
    "go.opentelemetry.io/collector/otelcol@v${OTELCOL_VERSION}" \
    "go.opentelemetry.io/collector/receiver/otlpreceiver@v${OTELCOL_VERSION}" \
    "go.opentelemetry.io/collector/component@v${OTELCOL_CORE_VERSION}" \
    "go.opentelemetry.io/collector/confmap@v${OTELCOL_CORE_VERSION}" \
    "go.opentelemetry.io/collector/confmap/provider/envprovider@v${OTELCOL_CORE_VERSION}" \
    "go.opentelemetry.io/collector/confmap/provider/fileprovider@v${OTELCOL_CORE_VERSION}" \
    "go.opentelemetry.io/collector/exporter@v${OTELCOL_CORE_VERSION}" \
    "go.opentelemetry.io/collector/receiver@v${OTELCOL_CORE_VERSION}" \
    "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter@v${OTELCOL_VERSION}" >&2
  "$GO" mod tidy >&2
  "$GO" build -trimpath -ldflags "-s -w" -o "$staging/otelcol" . >&2
)
mv "$staging/otelcol" "$BIN"
log "built $BIN in $((SECONDS - started)) s"
printf '%s\n' "$BIN"
