#!/usr/bin/env bash
# Install (once) and locate Apache Kafka (run in KRaft mode by the tests) from Maven Central into a
# version-keyed cache outside the repo:
#
#   scripts/kafka.sh   # prints the lib dir holding the broker's jars (installing them if missing)
#
# Cache: ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/kafka-<KAFKA_VERSION>/lib
# (complete once the marker file next to it exists; the test harness expects this version).
# KAFKA_LIB=/path/to/lib skips the install (the dir is checked and printed as is).
# log4j-slf4j-impl is the SLF4J 1.x binding Kafka's slf4j-api 1.7 needs (log4j-slf4j2-impl is not).
# Progress goes to stderr; stdout carries only the path. See docs/brokers.md.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/maven-jars.sh"

KAFKA_VERSION=4.4.0
LOG4J_VERSION=2.24.3
maven_jars kafka "$KAFKA_VERSION" 'kafka_2.13-*.jar' \
  "apt-get install -y --no-install-recommends openjdk-17-jre-headless maven" KAFKA_LIB \
  "org.apache.kafka:kafka_2.13:${KAFKA_VERSION}" \
  "org.apache.logging.log4j:log4j-slf4j-impl:${LOG4J_VERSION}" \
  "org.apache.logging.log4j:log4j-core:${LOG4J_VERSION}"
