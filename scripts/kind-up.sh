#!/usr/bin/env bash
# `make kind-up`: a kind cluster with PostgreSQL, Redis and the Switchboard operator (needs Docker,
# kind, kubectl; helm from PATH or built by scripts/helm.sh). Idempotent. See docs/kubernetes.md.
source "$(dirname "$0")/kind-env.sh"

need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
HELM_BIN="$(helm_binary)"

say "cluster $KIND_CLUSTER"
if [[ -z "${KIND_DRY_RUN:-}" ]] && kind get clusters | grep -qx "$KIND_CLUSTER"; then
  echo "kind cluster $KIND_CLUSTER exists" >&2
else
  run kind create cluster --name "$KIND_CLUSTER" --config kind-config.yaml --wait 120s
fi
run kubectl config use-context "kind-$KIND_CLUSTER"

say "image $IMAGE (both binaries; see Dockerfile)"
run docker build --tag "$IMAGE" --file Dockerfile .
run kind load docker-image "$IMAGE" --name "$KIND_CLUSTER"

say "PostgreSQL and Redis in namespace $DEV_NAMESPACE, and the Secrets pointing at them"
run kubectl apply --server-side -f examples/dev/namespaces.yaml
run kubectl apply --server-side -f examples/dev/postgres.yaml -f examples/dev/redis.yaml -f examples/dev/secrets.yaml
run kubectl -n "$DEV_NAMESPACE" rollout status statefulset/postgres --timeout=180s
run kubectl -n "$DEV_NAMESPACE" rollout status deployment/redis --timeout=180s

say "the operator (helm release $RELEASE in namespace $OPERATOR_NAMESPACE)"
run "$HELM_BIN" upgrade --install "$RELEASE" charts/switchboard --namespace "$OPERATOR_NAMESPACE" --wait --timeout 180s
run kubectl -n "$OPERATOR_NAMESPACE" get pods -o wide
