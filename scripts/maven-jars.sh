#!/usr/bin/env bash
# Shared by the scripts that install a Java server's jars from Maven Central (elasticmq.sh, kafka.sh):
# source it, then call
#
#   maven_jars NAME VERSION JAR_GLOB APT_HINT ENV_OVERRIDE group:artifact:version...
#
# It prints the lib dir holding the jars, installing them once into
# ${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/NAME-VERSION/lib (complete once the marker file next
# to it exists). ENV_OVERRIDE names an env var which, when set, is a lib dir used as is (checked for
# JAR_GLOB). Progress goes to stderr; stdout carries only the path.

maven_jars() {
  local name=$1 version=$2 jar_glob=$3 apt=$4 override=$5
  shift 5
  local cache_dir="${SWITCHBOARD_CACHE:-$HOME/.cache/switchboard}/${name}-${version}"
  local lib="$cache_dir/lib" marker="$cache_dir/.complete"
  log() { printf '[%s] %s\n' "$name" "$*" >&2; }
  die() { printf '[%s] error: %s\n' "$name" "$*" >&2; exit 1; }
  has_jar() { compgen -G "$1/$jar_glob" >/dev/null; }

  # The tests run the server with java, so it is needed even when the jars are cached.
  command -v java >/dev/null 2>&1 || die "java is required to run ${name} but was not found.
  Install it with: $apt"

  if [[ -n "${!override:-}" ]]; then
    has_jar "${!override}" || die "${override}=${!override} holds no $jar_glob"
    printf '%s\n' "${!override}"
    return 0
  fi
  if [[ -f "$marker" ]]; then
    printf '%s\n' "$lib"
    return 0
  fi
  command -v mvn >/dev/null 2>&1 || die "mvn is required to fetch ${name} ${version} but was not found.
  Install it with: $apt
  or set ${override}=/path/to/a/lib/dir/with/the/${name}/jars."

  mkdir -p "$cache_dir"
  # One install at a time; later callers wait and then find the marker.
  exec 9>"$cache_dir/.install.lock"
  flock 9
  if [[ -f "$marker" ]]; then
    printf '%s\n' "$lib"
    return 0
  fi

  log "fetching $* and their runtime dependencies from Maven Central into $cache_dir (once)"
  local started=$SECONDS deps="" coord g a v
  for coord in "$@"; do
    IFS=: read -r g a v <<<"$coord"
    deps+="    <dependency><groupId>$g</groupId><artifactId>$a</artifactId><version>$v</version></dependency>
"
  done
  # A throwaway project with the dependencies; the jars land in a scratch folder, then one rename:
  # a killed install never leaves a half lib dir behind the marker.
  local staging
  staging="$(mktemp -d "$cache_dir/.staging.XXXXXX")"
  # shellcheck disable=SC2064 # expand now: the trap outlives this function's locals
  trap "rm -rf '$staging'" EXIT
  cat >"$staging/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>switchboard.local</groupId>
  <artifactId>${name}-install</artifactId>
  <version>0</version>
  <packaging>pom</packaging>
  <dependencies>
${deps}  </dependencies>
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
POM
  (cd "$staging" && mvn -B -q -Dmaven.repo.local="$cache_dir/m2" dependency:copy-dependencies \
    -DoutputDirectory="$staging/lib" -DincludeScope=runtime) >&2 || die "mvn could not fetch $*"
  has_jar "$staging/lib" || die "mvn left no $jar_glob in $staging/lib"
  rm -rf "$lib"
  mv "$staging/lib" "$lib"
  touch "$marker"
  log "installed $(find "$lib" -name '*.jar' | wc -l) jars ($(du -sh "$lib" | cut -f1)) into $lib in $((SECONDS - started)) s"
  printf '%s\n' "$lib"
}
