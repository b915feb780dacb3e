# syntax=docker/dockerfile:1
# One image, both binaries: `switchboard-operator` (the chart's Deployment runs it) and
# `switchboard-worker` (the operator's worker Deployments run it, with the operator's own image as
# their default). One image means one tag to build, scan, sign and `kind load`, and the operator
# and its workers always run the same release.
#
#   docker build -t ghcr.io/switchboard/switchboard:0.1.0 .
#
# There is no Docker engine on the project's CI machines: this file is checked statically by
# tests/tests/chart.rs (files it copies exist, the binaries are the ones cargo builds, the user is
# the one the pod security contexts run as). See docs/kubernetes.md.

# --- build: the release binaries, with the toolchain of rust-toolchain.toml ---
FROM docker.io/library/rust:1.95.0-slim-bookworm AS build
WORKDIR /src
# Every workspace member's manifest and sources (cargo loads the whole workspace), the lock file,
# and the migrations the store embeds at compile time.
COPY Cargo.toml Cargo.lock rust-toolchain.toml ./
COPY api api
COPY store store
COPY telemetry telemetry
COPY worker worker
COPY operator operator
COPY tests tests
COPY vendor vendor
COPY migrations migrations
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked -p switchboard-worker -p switchboard-operator --bins \
 && mkdir -p /out \
 && cp target/dist/switchboard-worker target/dist/switchboard-operator /out/

# --- runtime: glibc + CA certificates, no shell, no package manager ---
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="switchboard" \
      org.opencontainers.image.description="Switchboard queue adapters: operator and worker" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/switchboard-worker /out/switchboard-operator /usr/local/bin/
# distroless's "nonroot" user; the chart and the operator's worker pods run as this uid/gid.
USER 65532:65532
# The chart and the operator set `command` explicitly; without one, show the operator's help.
ENTRYPOINT ["/usr/local/bin/switchboard-operator"]
CMD ["--help"]
