#!/usr/bin/env bash
# `make kind-down`: delete the kind cluster (and everything in it).
source "$(dirname "$0")/kind-env.sh"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
run kind delete cluster --name "$KIND_CLUSTER"
