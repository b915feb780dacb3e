#!/usr/bin/env bash
# A worker for `switchboard-bench --worker` that records where its CPU goes: runs the worker
# ($PERF_WORKER, default the release build, which has the symbols and debug info the call graphs
# need) under `perf record -p` with DWARF call graphs into $PERF_DIR/worker-<pid>.data, and passes
# the bench's SIGTERM on, so the bench runs as without it. scripts/perf-groups.py sums a profile
# into µs of CPU per message by part of the message path (docs/PERFORMANCE.md, "Where the
# worker's CPU goes"). The bench's client CPU column then measures this script, not the worker.
set -uo pipefail
worker=${PERF_WORKER:-${CARGO_TARGET_DIR:-target}/release/switchboard-worker}
dir=${PERF_DIR:-/tmp/switchboard-perf}
mkdir -p "$dir"
"$worker" "$@" &
pid=$!
perf record -F "${PERF_FREQ:-1999}" --call-graph dwarf,32768 -o "$dir/worker-$pid.data" \
  -p "$pid" 2>/dev/null &
perf_pid=$!
trap 'kill -TERM "$pid"' TERM INT
# A trapped signal ends the first wait early; the second returns the worker's own status.
wait "$pid"
wait "$pid"
status=$?
kill -INT "$perf_pid"
wait "$perf_pid"
exit "$status"
