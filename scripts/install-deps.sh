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
for service in postgresql redis-server rabbitmq-server epmd; do
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now "$service" >/dev/null 2>&1 || true; fi
done
