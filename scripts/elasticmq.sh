#!/usr/bin/env bash
# Install (once) and locate ElasticMQ, an SQS-compatible server made for tests, from Maven Central
# into a version-keyed cache outside the repo:
#
#   scripts/elasticmq.sh   # prints the lib dir holding the server's jars (installing them if missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/elasticmq-<ELASTICMQ_VERSION>/lib
# (complete once the marker file next to it exists; the test harness expects this version).
# ELASTICMQ_LIB=/path/to/lib skips the install (the dir is checked and printed as is).
# Progress goes to stderr; stdout carries only the path. See docs/brokers.md.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/maven-jars.sh"

ELASTICMQ_VERSION=1.7.1
maven_jars elasticmq "$ELASTICMQ_VERSION" 'elasticmq-server_2.13-*.jar' \
  "apt-get install -y --no-install-recommends openjdk-17-jre-headless maven" ELASTICMQ_LIB \
  "org.elasticmq:elasticmq-server_2.13:${ELASTICMQ_VERSION}"
