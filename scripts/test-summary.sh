#!/usr/bin/env bash
# Sums every `test result:` line of a cargo test log into one closing line.
set -euo pipefail
awk '/^test result:/ {
  for (i = 1; i <= NF; i++) {
    if ($(i + 1) ~ /^passed;?$/) passed += $i
    if ($(i + 1) ~ /^failed;?$/) failed += $i
    if ($(i + 1) ~ /^ignored;?$/) ignored += $i
  }
}
END { printf "tests: %d passed, %d failed, %d skipped\n", passed, failed, ignored }' "$1"
