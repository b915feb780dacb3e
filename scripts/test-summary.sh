#!/usr/bin/env bash
# Sums every `test result:` line of a cargo test log into one closing line and, before it, prints
# what each failed test printed (its `---- name stdout ----` block under `failures:`, without its
# stack backtrace), so the end of the output says why a run failed.
set -euo pipefail
awk '
/^failures:$/ { in_failures = !in_failures; printing = 0; next }
in_failures && /^---- / { printing = 1; lines = 0; backtrace = 0 }
/^Stack backtrace:$/ { backtrace = 1 }
!NF { backtrace = 0 }
printing && NF && !backtrace && lines < 40 { print; lines++ }
/^test result:/ {
  in_failures = 0; printing = 0
  for (i = 1; i <= NF; i++) {
    if ($(i + 1) ~ /^passed;?$/) passed += $i
    if ($(i + 1) ~ /^failed;?$/) failed += $i
    if ($(i + 1) ~ /^ignored;?$/) ignored += $i
  }
}
END { printf "tests: %d passed, %d failed, %d skipped\n", passed, failed, ignored }' "$1"
