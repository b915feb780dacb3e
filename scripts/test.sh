#!/usr/bin/env bash
# Every test of the workspace, in two lanes at once: the contract suite (14 tests × 8 brokers,
# mostly waiting on brokers) followed by a few long suites, and everything else (the dead-letter
# suite, the longest, first). The lanes are balanced by the time each took (2026-12-06, warm:
# contract 1,613 s + amqp 231 + operator_autoscaling 100 + gateway 90; dlq 1,004 + the rest
# 1,030). Both lanes run the same compiled binaries (built once first); each lane's output is
# printed whole when it ends, then one closing line sums both. Exits non-zero when a lane failed.
#
# The second lane names every `tests/tests/*.rs` not in the first, so a new test file is in it
# without a change here.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo=${CARGO:-cargo}
log_dir=${CARGO_TARGET_DIR:?}/test-logs
mkdir -p "$log_dir"
rm -f "$log_dir"/*.log

"$cargo" test --workspace --no-run || exit 101

first_lane=(contract amqp operator_autoscaling gateway)
first=()
for name in "${first_lane[@]}"; do
    first+=(--test "$name")
done
others=(--lib --bins --test dlq)
for file in tests/tests/*.rs; do
    name=$(basename "$file" .rs)
    [[ " ${first_lane[*]} dlq " == *" $name "* ]] || others+=(--test "$name")
done

lane() {
    local name=$1
    shift
    local started=$SECONDS
    "$@" >"$log_dir/$name.log" 2>&1
    local status=$?
    echo "== lane $name: exit $status after $((SECONDS - started)) s" >>"$log_dir/$name.log"
    cat "$log_dir/$name.log"
    return "$status"
}

# --show-output: the chaos tests print the figures the closing notes quote.
lane contract "$cargo" test -p switchboard-tests "${first[@]}" --no-fail-fast -- --show-output &
contract=$!
lane others "$cargo" test --workspace --no-fail-fast "${others[@]}" &
rest=$!
status=0
wait "$rest" || status=$?
wait "$contract" || status=$?
# Doc tests last: they cannot be selected with the targets above.
lane doc "$cargo" test --workspace --doc || status=$?

cat "$log_dir"/*.log >"$log_dir/all.log"
scripts/test-summary.sh "$log_dir/all.log"
exit "$status"
