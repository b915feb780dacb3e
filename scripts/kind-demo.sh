#!/usr/bin/env bash
# `make kind-demo` (after `make kind-up`): apply examples/orders-stream.yaml, wait until the
# QueueAdapter is Ready, push messages into the Redis stream, and show the todos they became.
source "$(dirname "$0")/kind-env.sh"

MESSAGES="${MESSAGES:-10}"
need kubectl "https://kubernetes.io/docs/tasks/tools/"

say "QueueAdapter default/orders"
run kubectl apply --server-side -f examples/orders-stream.yaml
run kubectl -n default wait queueadapter/orders --for=condition=Ready --timeout=180s
run kubectl -n default get qa orders -o wide

say "$MESSAGES messages into the Redis stream 'orders'"
run kubectl -n "$DEV_NAMESPACE" exec deployment/redis -- sh -c \
  "for i in \$(seq 1 $MESSAGES); do redis-cli XADD orders '*' body \"{\\\"order\\\": \$i}\" >/dev/null; done"

say "waiting for $MESSAGES todos in queue 'orders'"
psql() { run kubectl -n "$DEV_NAMESPACE" exec statefulset/postgres -- psql -U switchboard -d switchboard -Atc "$1"; }
if [[ -z "${KIND_DRY_RUN:-}" ]]; then
  deadline=$((SECONDS + 120))
  until [[ "$(psql "select count(*) from todos where queue = 'orders'")" -ge "$MESSAGES" ]]; do
    (( SECONDS < deadline )) || { echo "error: todos did not arrive within 120 s" >&2; exit 1; }
    sleep 1
  done
fi
psql "select id, queue, idempotency_key, status, payload from todos where queue = 'orders' order by id"

say "next: kubectl get qa -A -w | metrics: see docs/kubernetes.md | dead letters: redis-cli XRANGE orders.dlq - +"
