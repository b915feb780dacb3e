# The README's commands. Heavy caches live outside the clone, keyed by version.
SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/switchboard/target
CARGO ?= cargo

.PHONY: rust-side servers-side demo demo-k8s demo-cluster control-plane cluster-bins image test deps build lint bench helm prometheus sqs-server nats-server kafka-server hydra otelcol keda-operator kind-up kind-demo kind-down

## make demo: the whole pipeline locally (ephemeral PostgreSQL + Redis, 20,000 messages, a kill -9 mid-way),
## then the Kubernetes path (make demo-k8s)
demo: deps build control-plane sqs-server
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo-k8s

## make demo-k8s: local etcd + kube-apiserver + operator; kubectl apply examples/orders-stream.yaml;
## the rendered worker pod run as a kubelet would; messages → todos; kubectl get qa
demo-k8s: deps build control-plane
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo-k8s

## make demo-cluster: the same on a real single-node cluster (containerd + kubelet + kube-proxy, all
## networking in a network namespace): helm install of the chart with the locally built image, the
## example QueueAdapter, a real worker pod, messages → todos; kubectl get pods,qa (docs/cluster.md)
demo-cluster: deps build helm cluster-bins
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo-cluster

## make test: formatting, lints and every test against real servers (tests/tests/cluster.rs on a
## real cluster: needs root, containerd, runc, buildah; see docs/cluster.md), in two lanes balanced by
## time, the contract suite's and the rest (scripts/test.sh; logs in $CARGO_TARGET_DIR/test-logs); without
## incremental compilation (a one-shot build: faster, and 13 GB less on disk)
test: export CARGO_INCREMENTAL ?= 0
test: deps
	$(MAKE) --no-print-directory -j2 --output-sync=recurse rust-side servers-side
	CARGO=$(CARGO) scripts/test.sh

# The two halves of what the tests need, built side by side (each half in order): the Rust side
# (lints, binaries, test binaries) and the servers (mostly Go builds and downloads), so that one
# half's downloads and single-threaded links overlap the other's compiles.
rust-side:
	$(MAKE) --no-print-directory -j1 lint build
	$(CARGO) test --workspace --no-run

servers-side:
	$(MAKE) --no-print-directory -j1 helm prometheus control-plane cluster-bins sqs-server nats-server kafka-server hydra otelcol keda-operator

deps:
	scripts/install-deps.sh

## etcd, kube-apiserver and kubectl for the operator tests: built once from the Go module proxy
## into ~/.cache/switchboard/control-plane (or taken from KUBEBUILDER_ASSETS); docs/control-plane.md;
## and KEDA's CRDs (the Go module cache) for the autoscaling tests
control-plane:
	scripts/control-plane.sh bin-dir >/dev/null
	scripts/keda-crds.sh >/dev/null

## kubelet, kube-controller-manager, kube-scheduler and kube-proxy for the real-cluster tests, built
## once from the same Go module (and build cache) as kube-apiserver into the same cache folder
## (~12 min cold on 2 cores; or taken from KUBEBUILDER_ASSETS); docs/cluster.md
cluster-bins:
	scripts/control-plane.sh cluster-bin-dir >/dev/null

## make image: the operator/worker image from the dist binaries (release + fat LTO) with buildah (FROM scratch + the
## binaries + the libraries they link, user 65532) and the pause image, as oci-archives in
## ~/.cache/switchboard/cluster-images (import: ctr -n k8s.io images import <archive>); docs/cluster.md
image: deps
	$(CARGO) build --profile dist -p switchboard-worker -p switchboard-operator --bins
	scripts/cluster-image.sh $(CARGO_TARGET_DIR)/dist

## helm for the chart tests, built once from the Go module proxy into ~/.cache/switchboard/helm
helm:
	scripts/helm.sh >/dev/null

## prometheus and promtool for the alert-rule and dashboard tests, built once from the Go module
## proxy into ~/.cache/switchboard/prometheus-<version> (or taken from PROMETHEUS_BIN_DIR)
prometheus:
	scripts/prometheus.sh >/dev/null

## make sqs-server: ElasticMQ (an SQS-compatible server) for the SQS tests, its jars fetched once from
## Maven Central into ~/.cache/switchboard/elasticmq-<version> (or taken from ELASTICMQ_LIB), and
## moto (credential and region checks) from PyPI into ~/.cache/switchboard/moto-<version>; docs/brokers.md
sqs-server:
	scripts/elasticmq.sh >/dev/null
	scripts/moto.sh >/dev/null

## make nats-server: nats-server (JetStream) for the NATS tests, built once from the Go module proxy into
## ~/.cache/switchboard/nats-server-<version> (or taken from NATS_SERVER_BIN); docs/brokers.md
nats-server:
	scripts/nats-server.sh >/dev/null

## make kafka-server: Apache Kafka (run by the tests as a single KRaft node) for the Kafka tests, its
## jars fetched once from Maven Central into ~/.cache/switchboard/kafka-<version> (or taken from
## KAFKA_LIB); docs/brokers.md
kafka-server:
	scripts/kafka.sh >/dev/null

## make hydra: Ory Hydra (the OAuth2 server issuing the gateway tests' JWT access tokens), built once
## from the Go module proxy into ~/.cache/switchboard/hydra-<version> (or taken from HYDRA_BIN);
## docs/brokers.md
hydra:
	scripts/hydra.sh >/dev/null

## make keda-operator: KEDA's operator (scale to zero and back) for the autoscaling test, built once
## from the Go module proxy (the KEDA module the CRDs come from) into ~/.cache/switchboard/keda-<version>
keda-operator:
	scripts/keda-operator.sh >/dev/null

## make otelcol: a minimal OpenTelemetry Collector (OTLP receiver, file exporter writing OTLP JSON)
## for the trace tests, built once from the Go module proxy into ~/.cache/switchboard/otelcol-<version>
## (or taken from OTELCOL_BIN); docs/testing.md
otelcol:
	scripts/otelcol.sh >/dev/null

## make kind-up / kind-demo / kind-down: the kind path for people with Docker (docs/kubernetes.md)
kind-up:
	scripts/kind-up.sh

kind-demo: kind-up
	scripts/kind-demo.sh

kind-down:
	scripts/kind-down.sh

## make bench: worker throughput, CPU, latency and memory vs the raw PostgreSQL, Redis, SQS
## (ElasticMQ), NATS JetStream, RabbitMQ and Kafka limits, against real servers, every phase 3 times, median and spread
## (docs/PERFORMANCE.md); the worker as shipped (dist profile), the bench in release; fails if any entry
## is not stored exactly once
bench: deps sqs-server nats-server kafka-server otelcol
	$(CARGO) build --release -p switchboard-tests --bin switchboard-bench
	$(CARGO) build --profile dist -p switchboard-worker --bins
	$(CARGO) run --quiet --release -p switchboard-tests --bin switchboard-bench -- \
		--worker $(CARGO_TARGET_DIR)/dist/switchboard-worker $(BENCH_ARGS)

build:
	$(CARGO) build --workspace --bins

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
