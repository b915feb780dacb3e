# The README's commands. Heavy caches live outside the clone, keyed by version.
SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/switchboard/target
CARGO ?= cargo

.PHONY: demo demo-k8s control-plane test deps build lint bench helm prometheus sqs-server nats-server kafka-server hydra kind-up kind-demo kind-down

## make demo: the whole pipeline locally (ephemeral PostgreSQL + Redis, 20,000 messages, a kill -9 mid-way),
## then the Kubernetes path (make demo-k8s)
demo: deps build control-plane sqs-server
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo-k8s

## make demo-k8s: local etcd + kube-apiserver + operator; kubectl apply examples/orders-stream.yaml;
## the rendered worker pod run as a kubelet would; messages → todos; kubectl get qa
demo-k8s: deps build control-plane
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo-k8s

## make test: formatting, lints and every test against real servers
test: deps lint build helm prometheus control-plane sqs-server nats-server kafka-server hydra
	@set -o pipefail; $(CARGO) test --workspace --no-fail-fast 2>&1 | tee $(CARGO_TARGET_DIR)/test.log; \
		status=$$?; scripts/test-summary.sh $(CARGO_TARGET_DIR)/test.log; exit $$status

deps:
	scripts/install-deps.sh

## etcd, kube-apiserver and kubectl for the operator tests: built once from the Go module proxy
## into ~/.cache/switchboard/control-plane (or taken from KUBEBUILDER_ASSETS); docs/control-plane.md;
## and KEDA's CRDs (the Go module cache) for the autoscaling tests
control-plane:
	scripts/control-plane.sh bin-dir >/dev/null
	scripts/keda-crds.sh >/dev/null

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

## make kind-up / kind-demo / kind-down: the kind path for people with Docker (docs/kubernetes.md)
kind-up:
	scripts/kind-up.sh

kind-demo: kind-up
	scripts/kind-demo.sh

kind-down:
	scripts/kind-down.sh

## make bench: worker throughput, CPU, latency and memory vs the raw PostgreSQL, Redis, SQS
## (ElasticMQ), NATS JetStream, RabbitMQ and Kafka limits, in release, against real servers, every phase 3 times, median and spread
## (docs/PERFORMANCE.md); fails if any entry is not stored exactly once
bench: deps sqs-server nats-server kafka-server
	$(CARGO) build --release --workspace --bins
	$(CARGO) run --quiet --release -p switchboard-tests --bin switchboard-bench -- \
		--worker $(CARGO_TARGET_DIR)/release/switchboard-worker $(BENCH_ARGS)

build:
	$(CARGO) build --workspace --bins

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
