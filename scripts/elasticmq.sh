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

ELASTICMQ_VERSION=1.7.1
ARTIFACT="org.elasticmq:elasticmq-server_2.13:${ELASTICMQ_VERSION}"
CACHE_DIR="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/elasticmq-${ELASTICMQ_VERSION}"
LIB="$CACHE_DIR/lib"
MARKER="$CACHE_DIR/.complete"
APT="apt-get install -y --no-install-recommends openjdk-17-jre-headless maven"

log() { printf '[elasticmq] %s\n' "$*" >&2; }
die() { printf '[elasticmq] error: %s\n' "$*" >&2; exit 1; }

has_server_jar() { compgen -G "$1/elasticmq-server_2.13-*.jar" >/dev/null; }

# The tests run the server with java, so it is needed even when the jars are cached.
command -v java >/dev/null 2>&1 || die "java is required to run ElasticMQ but was not found.
  Install it with: $APT"

if [[ -n "${ELASTICMQ_LIB:-}" ]]; then
  has_server_jar "$ELASTICMQ_LIB" || die "ELASTICMQ_LIB=$ELASTICMQ_LIB holds no elasticmq-server_2.13-*.jar"
  printf '%s\n' "$ELASTICMQ_LIB"
  exit 0
fi

if [[ -f "$MARKER" ]]; then
  printf '%s\n' "$LIB"
  exit 0
fi

command -v mvn >/dev/null 2>&1 || die "mvn is required to fetch ElasticMQ ${ELASTICMQ_VERSION} but was not found.
  Install it with: $APT
  or set ELASTICMQ_LIB=/path/to/a/lib/dir/with/the/elasticmq-server/jars."

mkdir -p "$CACHE_DIR"
# One install at a time; later callers wait and then find the marker.
exec 9>"$CACHE_DIR/.install.lock"
flock 9
if [[ -f "$MARKER" ]]; then
  printf '%s\n' "$LIB"
  exit 0
fi

log "fetching ${ARTIFACT} and its runtime dependencies from Maven Central into $CACHE_DIR (once)"
started=$SECONDS
# A throwaway project with one dependency; the jars land in a scratch folder, then one rename:
# a killed install never leaves a half lib dir behind the marker.
staging="$(mktemp -d "$CACHE_DIR/.staging.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
cat >"$staging/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>switchboard.local</groupId>
  <artifactId>elasticmq-install</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.elasticmq</groupId>
      <artifactId>elasticmq-server_2.13</artifactId>
      <version>${ELASTICMQ_VERSION}</version>
    </dependency>
  </dependencies>
  <build>
    <plugins>
      <plugin>
        <groupId>org.apache.maven.plugins</groupId>
        <artifactId>maven-dependency-plugin</artifactId>
        <version>3.8.1</version>
      </plugin>
    </plugins>
  </build>
</project>
EOF
(cd "$staging" && mvn -B -q -Dmaven.repo.local="$CACHE_DIR/m2" dependency:copy-dependencies \
  -DoutputDirectory="$staging/lib" -DincludeScope=runtime) >&2 || die "mvn could not fetch ${ARTIFACT}"
has_server_jar "$staging/lib" || die "mvn left no elasticmq-server jar in $staging/lib"
rm -rf "$LIB"
mv "$staging/lib" "$LIB"
touch "$MARKER"
log "installed $(find "$LIB" -name '*.jar' | wc -l) jars ($(du -sh "$LIB" | cut -f1)) into $LIB in $((SECONDS - started)) s"
printf '%s\n' "$LIB"
