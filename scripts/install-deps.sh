#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo need, when they are missing.
# As root it runs apt-get; otherwise it prints the command and fails.
set -euo pipefail

missing=()
have_postgres() { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || [ -n "${PG_BIN:-}" ]; }
have_postgres || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
# ElasticMQ (the SQS-compatible server of the tests) runs on Java and is installed with Maven.
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
# RabbitMQ (the AMQP tests) from Debian: the tests run /usr/lib/rabbitmq/bin/rabbitmq-server themselves.
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || missing+=(rabbitmq-server)
# The real-cluster tier (tests/tests/cluster.rs, docs/cluster.md): containerd + runc run the pods,
# the CNI plugins wire them, buildah builds the images, kube-proxy writes iptables rules (all of
# the cluster's networking lives in a network namespace of its own), gcc builds the pause image.
command -v containerd >/dev/null 2>&1 || missing+=(containerd)
command -v runc >/dev/null 2>&1 || missing+=(runc)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v gcc >/dev/null 2>&1 || missing+=(gcc libc6-dev)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${missing[*]}; install them with: sudo apt-get update && sudo $cmd" >&2
  exit 1
fi
echo "installing ${missing[*]} ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$cmd >/dev/null
# The Debian packages start system-wide services; the project starts its own servers instead.
for service in postgresql redis-server rabbitmq-server epmd containerd; do
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now "$service" >/dev/null 2>&1 || true; fi
done
