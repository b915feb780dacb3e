//! The operator against a real etcd + kube-apiserver (no kubelet: Deployment status is patched by
//! the test), real PostgreSQL and Redis. Every operator here runs with the least-privilege token
//! bound by `charts/switchboard/files/operator-rules.yaml`.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::ApiResource;
use switchboard_api::QueueAdapter;
use switchboard_operator::build::{CONFIG_HASH_ANNOTATION, MANIFEST_KEY};
use switchboard_operator::controller::FINALIZER;
use switchboard_tests::control_plane;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest, pairs, pod_template, quantities,
};
use switchboard_tests::wait::wait_for;

static ORDERS: LazyLock<String> = LazyLock::new(|| {
    adapter_manifest(
        "orders",
        "  delivery: {batchSize: 200, maxDeliveries: 5, claimIdleSeconds: 10}\n\
         \x20 workload:\n\
         \x20   replicas: 2\n\
         \x20   resources: {requests: {cpu: 50m, memory: 64Mi}, limits: {memory: 128Mi}}\n",
    )
});

/// `(status, reason)` of the adapter's condition of type `type_`.
fn condition<'a>(adapter: &'a QueueAdapter, type_: &str) -> Option<(&'a str, &'a str)> {
    control_plane::condition(adapter, type_).map(|c| (c.status.as_str(), c.reason.as_str()))
}

/// Waits until adapter `name` reports that it cannot run for `reason`: Reconciled=False and
/// Degraded=True with that reason.
async fn wait_blocked(env: &OperatorEnv, name: &str, reason: &str) -> Result<QueueAdapter> {
    let adapter = env
        .wait_adapter(name, &format!("Reconciled=False {reason}"), |a| {
            condition(a, "Reconciled") == Some(("False", reason))
        })
        .await?;
    ensure!(
        condition(&adapter, "Degraded") == Some(("True", reason)),
        "Degraded=True {reason}: {:?}",
        adapter.status
    );
    Ok(adapter)
}

/// Waits for an Event of `type_` and `reason` about the adapter `orders`.
async fn wait_event(env: &OperatorEnv, type_: &str, reason: &str) -> Result<()> {
    let events: Api<Event> = Api::namespaced(env.admin.clone(), OperatorEnv::NAMESPACE);
    wait_for(
        OPERATOR_TIMEOUT,
        &format!("a {type_} event {reason} about the adapter"),
        || async {
            Ok(events
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .any(|e| {
                    e.type_.as_deref() == Some(type_)
                        && e.reason.as_deref() == Some(reason)
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("orders")
                }))
        },
    )
    .await
}

/// Starts an operator and applies ORDERS; returns once its worker Deployment has 2 replicas.
async fn running_orders(env: &OperatorEnv) -> Result<control_plane::OperatorProcess> {
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    env.wait_deployment("orders-worker", "2 replicas", |d| replicas(d) == Some(2))
        .await?;
    Ok(operator)
}

fn is_ready(adapter: &QueueAdapter) -> bool {
    condition(adapter, "Ready").is_some_and(|(status, _)| status == "True")
        && adapter.status.as_ref().and_then(|s| s.observed_generation)
            == adapter.metadata.generation
}

fn config_hash(deployment: &Deployment) -> Option<String> {
    deployment
        .spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(CONFIG_HASH_ANNOTATION)
        .cloned()
}

fn replicas(deployment: &Deployment) -> Option<i32> {
    deployment.spec.as_ref()?.replicas
}

/// The operator's `applied` reconciliations so far.
async fn applied(operator: &switchboard_tests::control_plane::OperatorProcess) -> Result<f64> {
    operator
        .metric_sum(r#"switchboard_operator_reconciliations_total{outcome="applied"}"#)
        .await
}

#[tokio::test]
async fn crd_is_established_and_kubectl_explains_the_fields() -> Result<()> {
    let env = OperatorEnv::start().await?;
    println!("control plane ready in {:?}", env.plane.started_in);
    let mut explained = String::new();
    wait_for(
        OPERATOR_TIMEOUT,
        "kubectl explain knows queueadapter.spec.delivery",
        || {
            let output = env
                .plane
                .kubectl(&["explain", "queueadapter.spec.delivery"]);
            let done = match output {
                Ok(output) if output.status.success() => {
                    explained = String::from_utf8_lossy(&output.stdout).into_owned();
                    true
                }
                _ => false,
            };
            async move { Ok(done) }
        },
    )
    .await?;
    for text in [
        "Batching, redelivery and dead-letter settings.",
        "batchSize",
        "The most messages read in one call and stored in one database transaction.",
        "maxDeliveries",
        "claimIdleSeconds",
    ] {
        ensure!(
            explained.contains(text),
            "explain lacks {text:?}:\n{explained}"
        );
    }
    let top = env.plane.kubectl_ok(&["explain", "qa"])?;
    ensure!(top.contains("store-then-ack"), "explain qa:\n{top}");
    // The worker pod template, each field saying that it replaces the operator's default.
    let workload = env
        .plane
        .kubectl_ok(&["explain", "queueadapter.spec.workload"])?;
    for field in [
        "imagePullSecrets",
        "serviceAccountName",
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "podAnnotations",
        "podLabels",
        "worker.resources",
    ] {
        ensure!(
            workload.contains(field),
            "explain lacks {field}:\n{workload}"
        );
    }
    Ok(())
}

/// (manifest edit, text the API server's message must contain)
fn invalid_manifests() -> Vec<(String, &'static str)> {
    let edit = |from: &str, to: &str| {
        assert!(ORDERS.contains(from), "{from}");
        ORDERS.replace(from, to)
    };
    let long_queue = format!("target: {{queue: {}}}", "q".repeat(201));
    vec![
        (
            edit(
                "redis: {mode: stream, stream: orders, urlSecretRef: {name: redis, key: url}}",
                "{}",
            ),
            "spec.source",
        ),
        (
            edit("mode: stream, stream: orders,", "mode: stream,"),
            "spec.source.redis.stream",
        ),
        (
            edit("mode: stream, stream: orders,", "mode: list,"),
            "spec.source.redis.list",
        ),
        (
            edit("mode: stream, stream: orders,", "mode: pubsub,"),
            "spec.source.redis.channel",
        ),
        (
            edit("mode: stream,", "mode: firehose,"),
            "spec.source.redis.mode",
        ),
        (
            edit("batchSize: 200", "batchSize: 0"),
            "spec.delivery.batchSize",
        ),
        (
            edit("batchSize: 200", "batchSize: 10001"),
            "spec.delivery.batchSize",
        ),
        (
            edit("maxDeliveries: 5", "maxDeliveries: 0"),
            "spec.delivery.maxDeliveries",
        ),
        (
            edit("claimIdleSeconds: 10", "claimIdleSeconds: 0"),
            "spec.delivery.claimIdleSeconds",
        ),
        (
            edit("replicas: 2", "replicas: 101"),
            "spec.workload.replicas",
        ),
        (
            edit("replicas: 2", "replicas: -1"),
            "spec.workload.replicas",
        ),
        (
            edit(
                "replicas: 2",
                "autoscaling: {maxReplicas: 2, triggerAuthenticationRef: k, pollingIntervalSeconds: 0}",
            ),
            "spec.workload.autoscaling.pollingIntervalSeconds",
        ),
        (
            edit(
                "replicas: 2",
                "autoscaling: {maxReplicas: 2, triggerAuthenticationRef: k, cooldownSeconds: 86401}",
            ),
            "spec.workload.autoscaling.cooldownSeconds",
        ),
        (
            edit("target: {queue: orders}", "target: {queue: ''}"),
            "spec.target.queue",
        ),
        (
            edit("target: {queue: orders}", &long_queue),
            "spec.target.queue",
        ),
        (
            edit("target: {queue: orders}", "target: {}"),
            "spec.target.queue",
        ),
        (
            edit(
                "urlSecretRef: {name: redis, key: url}",
                "urlSecretRef: {name: redis}",
            ),
            "spec.source.redis.urlSecretRef.key",
        ),
        (
            edit("name: orders,", &format!("name: {},", "o".repeat(64))),
            "metadata.name",
        ),
        (
            edit(
                "  workload:\n",
                "  database:\n    urlSecretRef: {name: db, key: url}\n    \
                 caSecretRef: {name: pg-ca, key: ca.crt}\n    \
                 caConfigMapRef: {name: pg-ca, key: ca.crt}\n  workload:\n",
            ),
            "spec.database",
        ),
    ]
}

/// The local loader (`switchboard-worker run --file`, `make demo`) and `switchboard-worker
/// lint` give the API server's verdicts: every manifest the API server rejects above is rejected, naming the same field,
/// and the manifest they start from is accepted. One list for both, so their bounds (the
/// schema's and the loader's checks) cannot drift apart unseen.
#[test]
fn local_loader_and_lint_reject_the_api_servers_invalid_manifests_naming_the_same_field()
-> Result<()> {
    switchboard_api::load_manifest(&ORDERS).context("the valid manifest is accepted")?;
    for (yaml, field) in invalid_manifests() {
        let err = switchboard_api::load_manifest(&yaml)
            .err()
            .with_context(|| {
                format!("the loader accepted a manifest that must name {field}:\n{yaml}")
            })?;
        let message = format!("{:#}", anyhow::Error::new(err));
        ensure!(
            message.contains(field),
            "the loader's rejection does not name {field}: {message}"
        );
    }
    lint_gives_the_same_verdicts()
}

/// `switchboard-worker lint` over the same manifests: the valid one is valid, each invalid one
/// is refused on its own line naming the same field, and the exit code says one was invalid.
fn lint_gives_the_same_verdicts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let valid = dir.path().join("valid.yaml");
    std::fs::write(&valid, &*ORDERS)?;
    let mut lint = std::process::Command::new(switchboard_tests::worker::worker_binary()?);
    lint.env_clear().arg("lint").arg("--file").arg(&valid);
    let cases = invalid_manifests();
    for (index, (yaml, _)) in cases.iter().enumerate() {
        let file = dir.path().join(format!("invalid-{index}.yaml"));
        std::fs::write(&file, yaml)?;
        lint.arg("--file").arg(file);
    }
    let output = lint.output()?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    ensure!(
        output.status.code() == Some(1),
        "{:?}: {stderr}",
        output.status
    );
    ensure!(stdout.contains("valid.yaml: valid: "), "{stdout}");
    for (index, (_, field)) in cases.iter().enumerate() {
        let name = format!("invalid-{index}.yaml: ");
        let line = stderr
            .lines()
            .find(|line| line.contains(&name))
            .with_context(|| format!("lint says nothing of case {index}: {stderr}"))?;
        ensure!(
            line.contains(field),
            "lint's verdict does not name {field}: {line}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn api_server_rejects_invalid_manifests_naming_the_field() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let resource = ApiResource::erase::<QueueAdapter>(&());
    let api: Api<DynamicObject> =
        Api::namespaced_with(env.admin.clone(), OperatorEnv::NAMESPACE, &resource);
    let cases = invalid_manifests();
    ensure!(cases.len() >= 10);
    for (yaml, field) in &cases {
        let object: DynamicObject = serde_yaml_ng::from_str(yaml)?;
        let err = api
            .create(&PostParams::default(), &object)
            .await
            .err()
            .with_context(|| format!("accepted a manifest that must name {field}:\n{yaml}"))?;
        let message = err.to_string();
        ensure!(
            message.contains(field),
            "rejection does not name {field}: {message}"
        );
    }

    // Transition rule: the source mode cannot change after creation.
    env.apply_adapter(&ORDERS).await?;
    let changed = ORDERS.replace("mode: stream, stream: orders,", "mode: list, list: orders,");
    let err = env
        .apply_adapter(&changed)
        .await
        .err()
        .context("changing the source mode must be rejected")?;
    ensure!(
        err.to_string()
            .contains("spec.source.redis.mode is immutable"),
        "{err}"
    );
    // …nor the stream: entry ids of another stream would be taken for redeliveries.
    let renamed = ORDERS.replace("stream: orders,", "stream: orders-v2,");
    let err = env
        .apply_adapter(&renamed)
        .await
        .err()
        .context("changing the stream must be rejected")?;
    ensure!(
        err.to_string()
            .contains("spec.source.redis.stream is immutable"),
        "{err}"
    );
    println!(
        "{} invalid manifests + 2 invalid updates rejected",
        cases.len()
    );
    Ok(())
}

#[tokio::test]
async fn created_adapter_gets_a_restricted_worker_deployment_and_an_adapters_row() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator("operator-a", &["--worker-image-pull-policy", "Always"])?;
    let adapter = env.apply_adapter(&ORDERS).await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;

    let owner = &deployment
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default()[0];
    ensure!(owner.kind == "QueueAdapter" && owner.name == "orders");
    ensure!(owner.controller == Some(true) && Some(&owner.uid) == adapter.metadata.uid.as_ref());
    let labels = deployment.metadata.labels.clone().unwrap_or_default();
    for (key, value) in [
        ("app.kubernetes.io/name", "switchboard-worker"),
        ("app.kubernetes.io/instance", "orders"),
        ("app.kubernetes.io/component", "queue-adapter"),
        ("app.kubernetes.io/part-of", "switchboard"),
        ("app.kubernetes.io/managed-by", "switchboard-operator"),
    ] {
        ensure!(
            labels.get(key).map(String::as_str) == Some(value),
            "label {key}: {labels:?}"
        );
    }
    ensure!(replicas(&deployment) == Some(2));
    ensure!(config_hash(&deployment).is_some_and(|h| h.len() == 64));
    let (pod, worker) = pod_template(&deployment)?;
    ensure!(pod.termination_grace_period_seconds.is_some_and(|s| s > 25));
    ensure!(pod.automount_service_account_token == Some(false));
    let pod_security = pod.security_context.clone().unwrap_or_default();
    ensure!(pod_security.run_as_non_root == Some(true));
    ensure!(pod_security.seccomp_profile.map(|p| p.type_) == Some("RuntimeDefault".into()));

    ensure!(worker.image.as_deref() == Some("switchboard:test"));
    ensure!(worker.image_pull_policy.as_deref() == Some("Always"));
    ensure!(
        worker.args.clone().unwrap_or_default()
            == ["run", "--file", "/etc/switchboard/adapter.yaml"]
    );
    let env_vars: BTreeMap<&str, _> = worker
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    for (name, secret) in [("REDIS_URL", "redis"), ("DATABASE_URL", "switchboard-db")] {
        let from = env_vars
            .get(name)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.secret_key_ref.as_ref())
            .with_context(|| format!("{name} from a secretKeyRef"))?;
        ensure!(from.name == secret && from.key == "url" && env_vars[name].value.is_none());
    }
    let hostname = env_vars
        .get("HOSTNAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .context("HOSTNAME from the downward API")?;
    ensure!(hostname.field_path == "metadata.name");
    let port = &worker.ports.clone().unwrap_or_default()[0];
    ensure!(port.name.as_deref() == Some("metrics") && port.container_port == 9090);
    for (probe, path) in [
        (&worker.liveness_probe, "/healthz"),
        (&worker.readiness_probe, "/readyz"),
    ] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.clone())
            .context("HTTP probe")?;
        ensure!(
            get.path.as_deref() == Some(path) && get.port == IntOrString::String("metrics".into())
        );
    }
    let security = worker.security_context.clone().unwrap_or_default();
    ensure!(security.run_as_non_root == Some(true));
    ensure!(security.read_only_root_filesystem == Some(true));
    ensure!(security.allow_privilege_escalation == Some(false));
    ensure!(security.capabilities.and_then(|c| c.drop) == Some(vec!["ALL".to_owned()]));
    let resources = worker.resources.clone().unwrap_or_default();
    ensure!(resources.requests.unwrap_or_default()["cpu"].0 == "50m");
    ensure!(resources.limits.unwrap_or_default()["memory"].0 == "128Mi");

    let config_map = env.config_maps().get("orders-worker").await?;
    ensure!(config_map.metadata.owner_references.unwrap_or_default()[0].name == "orders");
    let manifest = config_map.data.unwrap_or_default()[MANIFEST_KEY].clone();
    ensure!(switchboard_api::load_manifest(&manifest)?.adapter_name() == "shop/orders");
    ensure!(
        !manifest.contains(&env.fixture.redis.url()),
        "no secret in the ConfigMap"
    );

    let row = env.adapter_row("orders").await?.context("adapters row")?;
    ensure!(row.family == "queue" && row.trust_mode == "connection" && row.enabled);
    ensure!(row.generation == adapter.metadata.generation.unwrap_or_default());
    ensure!(row.config["target"]["queue"] == "orders");
    let config = row.config.to_string();
    ensure!(
        !config.contains("redis://")
            && !config.contains("postgres://")
            && !config.contains("urlSecretRef")
    );

    let adapter = env
        .wait_adapter("orders", "status is reported", |a| {
            condition(a, "Reconciled").is_some()
        })
        .await?;
    ensure!(adapter.metadata.finalizers.clone().unwrap_or_default() == [FINALIZER]);
    let status = adapter.status.clone().unwrap_or_default();
    ensure!(status.delivery_guarantee.as_deref() == Some("at-least-once"));
    ensure!(condition(&adapter, "Reconciled") == Some(("True", "Applied")));
    ensure!(condition(&adapter, "Degraded") == Some(("False", "AsExpected")));
    ensure!(
        condition(&adapter, "Ready") == Some(("False", "Progressing")),
        "no pods yet"
    );
    let status_text = serde_json::to_string(&status)?;
    ensure!(!status_text.contains("redis://") && !status_text.contains("postgres://"));

    wait_event(&env, "Normal", "Created").await?;
    Ok(())
}

#[tokio::test]
async fn available_deployment_makes_the_adapter_ready_and_kubectl_shows_the_columns() -> Result<()>
{
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    env.wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    env.mark_deployment_available("orders-worker").await?;
    let adapter = env
        .wait_adapter("orders", "Ready=True at the current generation", is_ready)
        .await?;
    ensure!(adapter.status.as_ref().and_then(|s| s.ready_replicas) == Some(2));

    let table = env
        .plane
        .kubectl_ok(&["get", "qa", "-n", OperatorEnv::NAMESPACE])?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().context("header")?.split_whitespace().collect();
    ensure!(
        header
            == [
                "NAME", "SOURCE", "MODE", "QUEUE", "ENABLED", "READY", "BACKLOG", "OLDEST", "AGE"
            ],
        "{table}"
    );
    let row: Vec<&str> = lines.next().context("row")?.split_whitespace().collect();
    ensure!(
        row[..6] == ["orders", "redis", "stream", "orders", "true", "True"],
        "{table}"
    );
    println!("{table}");
    Ok(())
}

#[tokio::test]
async fn spec_changes_roll_the_hash_and_an_unchanged_adapter_writes_nothing() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    let first = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    env.mark_deployment_available("orders-worker").await?;
    // Ready, and the runtime part written once (no worker reports: it stays as it is).
    env.wait_adapter("orders", "Ready with its runtime conditions", |adapter| {
        is_ready(adapter) && condition(adapter, "BrokerConnected").is_some()
    })
    .await?;
    let hash = config_hash(&first).context("hash")?;

    // Unchanged: touch only an annotation, which triggers a reconcile without changing the spec.
    let adapter = env.adapters().get("orders").await?;
    let deployment = env.deployments().get("orders-worker").await?;
    let config_map = env.config_maps().get("orders-worker").await?;
    let row = env.adapter_row("orders").await?;
    let before = applied(&operator).await?;
    let touched = env
        .adapters()
        .patch(
            "orders",
            &PatchParams::apply("touch"),
            &Patch::Apply(serde_json::json!({
                "apiVersion": "switchboard.dev/v1alpha1", "kind": "QueueAdapter",
                "metadata": {"annotations": {"example.com/touched": "yes"}},
            })),
        )
        .await?;
    ensure!(touched.metadata.generation == adapter.metadata.generation);
    wait_for(
        OPERATOR_TIMEOUT,
        "the touched adapter is reconciled",
        || async { Ok(applied(&operator).await? > before) },
    )
    .await?;
    let after_adapter = env.adapters().get("orders").await?;
    ensure!(
        after_adapter.metadata.resource_version == touched.metadata.resource_version,
        "reconciling an unchanged adapter wrote its status"
    );
    ensure!(
        env.deployments()
            .get("orders-worker")
            .await?
            .metadata
            .resource_version
            == deployment.metadata.resource_version,
        "Deployment rewritten"
    );
    ensure!(
        env.config_maps()
            .get("orders-worker")
            .await?
            .metadata
            .resource_version
            == config_map.metadata.resource_version,
        "ConfigMap rewritten"
    );
    ensure!(
        env.adapter_row("orders").await? == row,
        "adapters row rewritten"
    );

    // Spec change: the Deployment follows and the hash changes.
    env.apply_adapter(&ORDERS.replace("batchSize: 200", "batchSize: 300"))
        .await?;
    let updated = env
        .wait_deployment("orders-worker", "the hash changes with the spec", |d| {
            config_hash(d).is_some_and(|h| h != hash)
        })
        .await?;
    let manifest = env
        .config_maps()
        .get("orders-worker")
        .await?
        .data
        .unwrap_or_default()[MANIFEST_KEY]
        .clone();
    ensure!(manifest.contains("batchSize: 300"), "{manifest}");
    ensure!(config_hash(&updated).is_some_and(|h| h.len() == 64));
    ensure!(
        env.adapter_row("orders").await?.context("row")?.config["delivery"]["batchSize"] == 300
    );
    Ok(())
}

#[tokio::test]
async fn disabling_scales_to_zero_and_disables_the_row_and_enabling_restores_both() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = running_orders(&env).await?;

    let disabled = ORDERS.replace("spec:\n", "spec:\n  enabled: false\n");
    env.apply_adapter(&disabled).await?;
    env.wait_deployment("orders-worker", "0 replicas", |d| replicas(d) == Some(0))
        .await?;
    let row = env.adapter_row("orders").await?.context("row")?;
    ensure!(!row.enabled, "adapters.enabled must be false");
    let adapter = env
        .wait_adapter("orders", "Ready=False Disabled", |a| {
            condition(a, "Ready") == Some(("False", "Disabled"))
        })
        .await?;
    ensure!(adapter.status.and_then(|s| s.observed_generation) == adapter.metadata.generation);

    env.apply_adapter(&ORDERS).await?;
    env.wait_deployment("orders-worker", "2 replicas again", |d| {
        replicas(d) == Some(2)
    })
    .await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "adapters.enabled is true again",
        || async { Ok(env.adapter_row("orders").await?.is_some_and(|r| r.enabled)) },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn disabling_an_adapter_whose_secret_is_gone_still_scales_it_to_zero() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = running_orders(&env).await?;

    // The Redis Secret is deleted (the operator cannot see that: it reads no Secret)…
    Api::<Secret>::namespaced(env.admin.clone(), OperatorEnv::NAMESPACE)
        .delete("redis", &DeleteParams::default())
        .await?;
    // …and disabling it is what the user does next: that needs no Secret.
    let disabled = ORDERS.replace("spec:\n", "spec:\n  enabled: false\n");
    env.apply_adapter(&disabled).await?;
    env.wait_deployment("orders-worker", "0 replicas", |d| replicas(d) == Some(0))
        .await?;
    wait_for(OPERATOR_TIMEOUT, "adapters.enabled is false", || async {
        Ok(env.adapter_row("orders").await?.is_some_and(|r| !r.enabled))
    })
    .await?;
    env.wait_adapter("orders", "Reconciled=True, Ready=False Disabled", |a| {
        condition(a, "Reconciled") == Some(("True", "Applied"))
            && condition(a, "Ready") == Some(("False", "Disabled"))
            && a.status.as_ref().and_then(|s| s.observed_generation) == a.metadata.generation
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn deleting_the_adapter_removes_its_row_and_finalizer_and_the_object() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    env.wait_adapter("orders", "the finalizer is added", |a| {
        a.metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .contains(&FINALIZER.to_owned())
    })
    .await?;
    wait_for(OPERATOR_TIMEOUT, "the adapters row exists", || async {
        Ok(env.adapter_row("orders").await?.is_some())
    })
    .await?;

    env.adapters()
        .delete("orders", &DeleteParams::default())
        .await?;
    wait_for(OPERATOR_TIMEOUT, "the QueueAdapter is gone", || async {
        Ok(env.adapters().get_opt("orders").await?.is_none())
    })
    .await?;
    ensure!(
        env.adapter_row("orders").await?.is_none(),
        "adapters row left behind"
    );
    ensure!(
        operator
            .metric_sum(r#"switchboard_operator_reconciliations_total{outcome="cleaned_up"}"#)
            .await?
            >= 1.0
    );

    // Cleanup is idempotent: a row that never existed (or is already gone) is no error.
    env.apply_adapter(&ORDERS).await?;
    wait_for(OPERATOR_TIMEOUT, "the new row exists", || async {
        Ok(env.adapter_row("orders").await?.is_some())
    })
    .await?;
    sqlx::query("DELETE FROM adapters")
        .execute(env.fixture.pool())
        .await?;
    env.adapters()
        .delete("orders", &DeleteParams::default())
        .await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the QueueAdapter without a row is gone",
        || async { Ok(env.adapters().get_opt("orders").await?.is_none()) },
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn invalid_adapter_is_reported_and_resolved_by_a_change() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator("operator-a", &[])?;
    // Valid for the API server, not for a worker in Kubernetes: no Redis Secret.
    env.apply_adapter(&ORDERS.replace(", urlSecretRef: {name: redis, key: url}", ""))
        .await?;
    wait_blocked(&env, "orders", "InvalidSpec").await?;
    ensure!(env.deployments().get_opt("orders-worker").await?.is_none());

    // Fixed spec. Whether its Secret exists is the worker pods' to say (tests/tests/cluster.rs).
    env.apply_adapter(&ORDERS.replace("name: redis, key: url", "name: redis-later, key: url"))
        .await?;
    env.wait_deployment("orders-worker", "the fixed spec's Deployment", |_| true)
        .await?;
    env.wait_adapter("orders", "Reconciled=True", |a| {
        condition(a, "Reconciled") == Some(("True", "Applied"))
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn worker_image_outside_the_allow_list_is_refused_until_an_allowed_one_is_named() -> Result<()>
{
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator(
        "operator-a",
        &["--allowed-worker-images", "registry.example/custom/"],
    )?;
    let with_image = |image: &str| {
        ORDERS.replace(
            "  workload:\n",
            &format!("  workload:\n    image: {image}\n"),
        )
    };
    // A pod of this image would receive the adapter's Secrets: the operator refuses it.
    env.apply_adapter(&with_image("evil.example/steal:1"))
        .await?;
    let adapter = wait_blocked(&env, "orders", "ImageNotAllowed").await?;
    let message = &control_plane::condition(&adapter, "Reconciled")
        .context("Reconciled")?
        .message;
    ensure!(
        message.contains("spec.workload.image") && message.contains("registry.example/custom/"),
        "the message names the field and the allowed prefixes: {message}"
    );
    ensure!(env.deployments().get_opt("orders-worker").await?.is_none());

    let allowed = "registry.example/custom/worker:2";
    env.apply_adapter(&with_image(allowed)).await?;
    let deployment = env
        .wait_deployment("orders-worker", "the allowed image's Deployment", |_| true)
        .await?;
    let (_, container) = pod_template(&deployment)?;
    ensure!(
        container.image.as_deref() == Some(allowed),
        "worker image {:?}",
        container.image
    );
    env.wait_adapter("orders", "Reconciled=True", |a| {
        condition(a, "Reconciled") == Some(("True", "Applied"))
    })
    .await?;
    ensure!(
        replicas(&deployment) == Some(2),
        "{:?}",
        replicas(&deployment)
    );

    // An image refused later (or by a narrower allow-list after an upgrade) stops the workers
    // that run: they would keep the adapter's Secrets otherwise.
    env.apply_adapter(&with_image("evil.example/steal:2"))
        .await?;
    wait_blocked(&env, "orders", "ImageNotAllowed").await?;
    env.wait_deployment("orders-worker", "the running workers stopped", |d| {
        replicas(d) == Some(0)
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn operator_token_holds_only_the_rules_it_needs() -> Result<()> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    use switchboard_tests::control_plane::ControlPlane;
    let plane = ControlPlane::start().await?;
    // As OperatorEnv does: the leader-election Role in the operator's own namespace.
    plane.create_namespace("shop").await?;
    let lease = control_plane::OPERATOR_LEASE;
    plane
        .grant_operator(Some("shop"), ControlPlane::leader_election_rules(lease)?)
        .await?;
    let rules = [
        ControlPlane::operator_rules()?,
        ControlPlane::leader_election_rules(lease)?,
    ];
    for rule in rules.iter().flatten() {
        let all = [
            rule.api_groups.clone().unwrap_or_default(),
            rule.resources.clone().unwrap_or_default(),
            rule.verbs.clone(),
        ];
        ensure!(
            !all.iter().flatten().any(|v| v.contains('*')),
            "wildcard in {rule:?}"
        );
    }
    let reviews = Api::<SelfSubjectAccessReview>::all(plane.operator_client().await?);
    let can_in = |namespace: &str, name: &str, group: &str, resource: &str, verb: &str| {
        let review = SelfSubjectAccessReview {
            spec: SelfSubjectAccessReviewSpec {
                resource_attributes: Some(ResourceAttributes {
                    group: Some(group.to_owned()),
                    resource: Some(resource.to_owned()),
                    verb: Some(verb.to_owned()),
                    namespace: Some(namespace.to_owned()),
                    name: (!name.is_empty()).then(|| name.to_owned()),
                    ..ResourceAttributes::default()
                }),
                ..SelfSubjectAccessReviewSpec::default()
            },
            ..SelfSubjectAccessReview::default()
        };
        let reviews = reviews.clone();
        async move {
            let answer = reviews.create(&PostParams::default(), &review).await?;
            anyhow::Ok(answer.status.is_some_and(|s| s.allowed))
        }
    };
    let can = |group, resource, verb| can_in("shop", "", group, resource, verb);
    for (group, resource, verb) in [
        ("apps", "deployments", "patch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("switchboard.dev", "queueadapters", "watch"),
        ("switchboard.dev", "queueadapters/status", "patch"),
        ("coordination.k8s.io", "leases", "create"),
        ("events.k8s.io", "events", "create"),
        ("policy", "poddisruptionbudgets", "patch"),
        ("policy", "poddisruptionbudgets", "delete"),
    ] {
        ensure!(
            can(group, resource, verb).await?,
            "operator cannot {verb} {resource}"
        );
    }
    for (group, resource, verb) in [
        ("", "secrets", "get"),
        ("", "secrets", "list"),
        ("", "secrets", "watch"),
        ("", "secrets", "create"),
        ("", "secrets", "update"),
        ("", "secrets", "delete"),
        ("apps", "deployments", "delete"),
        ("", "configmaps", "delete"),
        ("", "configmaps", "get"),
        ("switchboard.dev", "queueadapters", "create"),
        ("switchboard.dev", "queueadapters", "delete"),
        ("", "pods", "create"),
        ("", "pods", "get"),
        ("", "pods", "delete"),
        ("", "serviceaccounts", "create"),
        ("rbac.authorization.k8s.io", "clusterroles", "create"),
        ("coordination.k8s.io", "leases", "delete"),
        ("policy", "poddisruptionbudgets", "get"),
        ("policy", "poddisruptionbudgets", "update"),
    ] {
        ensure!(
            !can(group, resource, verb).await?,
            "operator may {verb} {resource}"
        );
    }
    // Leader election is confined to the operator's own Lease in its namespace: other Leases
    // there, node heartbeats and the control plane's own leader Leases are out of reach.
    for verb in ["get", "update"] {
        ensure!(
            can_in("shop", lease, "coordination.k8s.io", "leases", verb).await?,
            "operator cannot {verb} its Lease"
        );
    }
    for (namespace, name) in [
        ("shop", "another-lease"),
        ("kube-node-lease", lease),
        ("kube-system", "kube-controller-manager"),
        ("default", lease),
    ] {
        ensure!(
            !can_in(namespace, name, "coordination.k8s.io", "leases", "update").await?,
            "operator may update Lease {namespace}/{name}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn operator_identity_reconciles_without_reading_any_secret_and_gets_403_on_one() -> Result<()>
{
    let env = OperatorEnv::start().await?;
    // The operator reconciles an adapter (its Deployment names Secrets `redis` and
    // `switchboard-db`) with the chart's rules alone.
    let _operator = running_orders(&env).await?;
    env.plane.create_namespace("payments").await?;
    env.plane
        .put_secret("shop", "unreferenced", "password", "hunter2")
        .await?;
    env.plane
        .put_secret("payments", "api-key", "key", "hunter2")
        .await?;
    let operator = env.plane.operator_client().await?;
    let forbidden = |result: Result<Secret, kube::Error>| matches!(result, Err(kube::Error::Api(status)) if status.code == 403);
    // A real GET as the operator: one nobody references, one in another namespace, and the
    // adapter's own (the operator needs none of them).
    for (namespace, name) in [
        ("shop", "unreferenced"),
        ("payments", "api-key"),
        ("shop", "redis"),
    ] {
        let result = Api::<Secret>::namespaced(operator.clone(), namespace)
            .get(name)
            .await;
        ensure!(
            forbidden(result),
            "GET Secret {namespace}/{name} as the operator is not 403"
        );
    }
    let listed = Api::<Secret>::all(operator)
        .list(&ListParams::default())
        .await;
    ensure!(
        matches!(listed, Err(kube::Error::Api(status)) if status.code == 403),
        "listing Secrets as the operator is not 403"
    );
    // `kubectl auth can-i` as the operator's user: no for Secrets, yes for what it does use.
    let can_i = |args: &[&str]| -> Result<String> {
        let mut all = vec!["auth", "can-i"];
        all.extend(args);
        all.extend(["--as", control_plane::OPERATOR_USER]);
        let output = env.plane.kubectl(&all)?;
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    for args in [
        &["get", "secrets", "--namespace", "shop"][..],
        &["get", "secret/unreferenced", "--namespace", "shop"],
        &["get", "secret/api-key", "--namespace", "payments"],
        &["list", "secrets", "--all-namespaces"],
        &["watch", "secrets", "--all-namespaces"],
    ] {
        ensure!(can_i(args)? == "no", "kubectl auth can-i {args:?} says yes");
    }
    ensure!(
        can_i(&["list", "pods", "--namespace", "shop"])? == "yes",
        "kubectl auth can-i list pods says no: is --as the operator?"
    );
    Ok(())
}

#[tokio::test]
async fn database_outage_is_reported_retried_with_backoff_and_recovered() -> Result<()> {
    let mut env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the operator migrated and is ready",
        || async { Ok(operator.http_get("/readyz").await?.0 == 200) },
    )
    .await?;
    env.fixture.postgres.stop();
    env.apply_adapter(&ORDERS).await?;
    let adapter = env
        .wait_adapter("orders", "Degraded=True DatabaseUnavailable", |a| {
            condition(a, "Degraded") == Some(("True", "DatabaseUnavailable"))
        })
        .await?;
    ensure!(condition(&adapter, "Reconciled") == Some(("False", "DatabaseUnavailable")));
    wait_for(
        OPERATOR_TIMEOUT,
        "failures are counted as database failures",
        || async {
            Ok(operator
                .metric_sum(r#"switchboard_operator_reconcile_failures_total{category="database"}"#)
                .await?
                >= 2.0)
        },
    )
    .await?;
    let warnings = operator
        .log()
        .lines()
        .filter(|line| line.contains("reconcile failed; retrying with backoff"))
        .count();
    ensure!(
        warnings == 1,
        "one log line per new failure, found {warnings}"
    );

    env.fixture.postgres.restart()?;
    env.wait_adapter(
        "orders",
        "Reconciled=True after the database is back",
        |a| {
            condition(a, "Reconciled") == Some(("True", "Applied"))
                && condition(a, "Degraded") == Some(("False", "AsExpected"))
        },
    )
    .await?;
    ensure!(env.adapter_row("orders").await?.is_some());
    Ok(())
}

#[tokio::test]
async fn deleting_an_adapter_while_the_database_is_down_says_degraded_and_removes_the_row_later()
-> Result<()> {
    let mut env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    wait_for(OPERATOR_TIMEOUT, "the adapters row exists", || async {
        Ok(env.adapter_row("orders").await?.is_some())
    })
    .await
    .with_context(|| operator.log_tail())?;
    env.wait_adapter("orders", "Reconciled=True", |a| {
        condition(a, "Reconciled") == Some(("True", "Applied"))
    })
    .await?;

    env.fixture.postgres.stop();
    env.adapters()
        .delete("orders", &DeleteParams::default())
        .await?;
    let adapter = env
        .wait_adapter("orders", "Degraded=True DatabaseUnavailable", |a| {
            condition(a, "Degraded") == Some(("True", "DatabaseUnavailable"))
        })
        .await
        .with_context(|| operator.log_tail())?;
    ensure!(
        condition(&adapter, "Reconciled") == Some(("False", "DatabaseUnavailable")),
        "{:?}",
        adapter.status
    );
    ensure!(adapter.metadata.deletion_timestamp.is_some());
    wait_event(&env, "Warning", "DatabaseUnavailable").await?;

    env.fixture.postgres.restart()?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the QueueAdapter is gone once the database is back",
        || async { Ok(env.adapters().get_opt("orders").await?.is_none()) },
    )
    .await
    .with_context(|| operator.log_tail())?;
    ensure!(
        env.adapter_row("orders").await?.is_none(),
        "adapters row left behind"
    );
    Ok(())
}

#[tokio::test]
async fn operator_started_with_the_database_down_reconciles_kubernetes_and_mirrors_rows_later()
-> Result<()> {
    let mut env = OperatorEnv::start().await?;
    env.fixture.postgres.stop();
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&ORDERS).await?;
    env.wait_deployment("orders-worker", "the worker Deployment is created", |_| {
        true
    })
    .await
    .with_context(|| operator.log_tail())?;
    env.wait_adapter("orders", "Degraded=True DatabaseUnavailable", |a| {
        condition(a, "Degraded") == Some(("True", "DatabaseUnavailable"))
    })
    .await
    .with_context(|| operator.log_tail())?;
    // A disabled adapter is still scaled to zero.
    env.apply_adapter(&ORDERS.replace("spec:\n", "spec:\n  enabled: false\n"))
        .await?;
    env.wait_deployment(
        "orders-worker",
        "the disabled adapter's workers stop",
        |d| d.spec.as_ref().and_then(|s| s.replicas) == Some(0),
    )
    .await
    .with_context(|| operator.log_tail())?;

    env.fixture.postgres.restart()?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the row is mirrored once the database is back",
        || async { Ok(env.adapter_row("orders").await?.is_some_and(|r| !r.enabled)) },
    )
    .await
    .with_context(|| operator.log_tail())?;
    env.wait_adapter("orders", "Degraded=False once the row is mirrored", |a| {
        condition(a, "Degraded").is_some_and(|(status, _)| status == "False")
    })
    .await?;
    Ok(())
}

/// The operator's worker pod defaults, as the chart renders them (`--worker-pod-defaults`).
const POD_DEFAULTS: &str = include_str!("../../operator/fixtures/pod-defaults.json");

/// The labels and annotations of `deployment`'s pod template.
fn pod_labels_and_annotations(
    deployment: &Deployment,
) -> Result<(BTreeMap<String, String>, BTreeMap<String, String>)> {
    let metadata = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .context("pod metadata")?;
    Ok((
        metadata.labels.clone().unwrap_or_default(),
        metadata.annotations.clone().unwrap_or_default(),
    ))
}

#[tokio::test]
async fn pod_template_reaches_the_worker_pod_and_the_adapters_values_win_over_the_operators()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &["--worker-pod-defaults", POD_DEFAULTS])?;
    env.apply_adapter(&adapter_manifest("plain", "")).await?;
    env.apply_adapter(&adapter_manifest(
        "custom",
        "  workload:\n\
         \x20   imagePullSecrets: []\n\
         \x20   serviceAccountName: custom-irsa\n\
         \x20   nodeSelector: {zone: a}\n\
         \x20   tolerations: [{key: spot, operator: Exists, effect: NoSchedule}]\n\
         \x20   affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: arch, operator: In, values: [arm64]}]}]}}}\n\
         \x20   topologySpreadConstraints: [{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app.kubernetes.io/instance: custom}}}]\n\
         \x20   priorityClassName: custom-critical\n\
         \x20   podAnnotations: {team: shop, switchboard.dev/config-hash: forged}\n\
         \x20   podLabels: {team: shop, app.kubernetes.io/instance: plain}\n",
    ))
    .await?;
    let plain = env
        .wait_deployment("plain-worker", "the plain worker Deployment", |_| true)
        .await
        .with_context(|| operator.log_tail())?;
    let (pod, _) = pod_template(&plain)?;
    let secrets: Vec<&str> = pod
        .image_pull_secrets
        .iter()
        .flatten()
        .map(|s| s.name.as_str())
        .collect();
    ensure!(secrets == ["regcred"], "default pull secrets: {secrets:?}");
    ensure!(pod.service_account_name.as_deref() == Some("queue-workers"));
    ensure!(pod.node_selector == Some(pairs(&[("pool", "queues")])));
    ensure!(
        pod.tolerations
            .as_ref()
            .is_some_and(|t| t[0].key.as_deref() == Some("dedicated"))
    );
    ensure!(pod.priority_class_name.as_deref() == Some("queue-workers"));
    ensure!(pod.affinity.is_none() && pod.topology_spread_constraints.is_none());
    // The default pod labels and annotations, under the selector labels and the config hash.
    let (labels, annotations) = pod_labels_and_annotations(&plain)?;
    ensure!(
        labels.get("team").map(String::as_str) == Some("platform")
            && labels.get("tier").map(String::as_str) == Some("queues")
            && labels.get("app.kubernetes.io/instance").map(String::as_str) == Some("plain"),
        "{labels:?}"
    );
    ensure!(
        annotations.get("cost-center").map(String::as_str) == Some("queues")
            && config_hash(&plain).is_some_and(|hash| hash.len() == 64),
        "{annotations:?}"
    );

    let custom = env
        .wait_deployment("custom-worker", "the custom worker Deployment", |_| true)
        .await
        .with_context(|| operator.log_tail())?;
    let (pod, container) = pod_template(&custom)?;
    ensure!(
        pod.image_pull_secrets.iter().flatten().next().is_none(),
        "cleared: {pod:?}"
    );
    ensure!(pod.service_account_name.as_deref() == Some("custom-irsa"));
    ensure!(pod.node_selector == Some(pairs(&[("zone", "a")])));
    ensure!(
        pod.tolerations
            .as_ref()
            .is_some_and(|t| t.len() == 1 && t[0].key.as_deref() == Some("spot"))
    );
    ensure!(
        pod.affinity
            .as_ref()
            .is_some_and(|a| a.node_affinity.is_some())
    );
    ensure!(
        pod.topology_spread_constraints
            .as_ref()
            .is_some_and(|t| t.len() == 1)
    );
    ensure!(pod.priority_class_name.as_deref() == Some("custom-critical"));
    // Restricted whatever the template says, and no API token for the chosen account.
    ensure!(pod.automount_service_account_token == Some(false));
    let security = container
        .security_context
        .as_ref()
        .context("securityContext")?;
    ensure!(
        security.read_only_root_filesystem == Some(true)
            && security.run_as_non_root == Some(true)
            && security.allow_privilege_escalation == Some(false)
    );
    // The adapter's pod labels and annotations win per key; the defaults' other keys stay.
    let (labels, annotations) = pod_labels_and_annotations(&custom)?;
    ensure!(
        labels.get("team").map(String::as_str) == Some("shop")
            && labels.get("tier").map(String::as_str) == Some("queues"),
        "{labels:?}"
    );
    ensure!(
        labels.get("app.kubernetes.io/instance").map(String::as_str) == Some("custom"),
        "podLabels cannot move the pods out of their Deployment's selector: {labels:?}"
    );
    ensure!(
        annotations.get("team").map(String::as_str) == Some("shop")
            && annotations.get("cost-center").map(String::as_str) == Some("queues"),
        "{annotations:?}"
    );
    ensure!(
        config_hash(&custom).is_some_and(|hash| hash.len() == 64),
        "the config hash is the operator's: {annotations:?}"
    );
    Ok(())
}

#[tokio::test]
async fn worker_without_resources_gets_the_operators_default_resources_and_its_own_win()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &["--worker-pod-defaults", POD_DEFAULTS])?;
    env.apply_adapter(&adapter_manifest("plain", "")).await?;
    env.apply_adapter(&ORDERS).await?;
    let plain = env
        .wait_deployment("plain-worker", "the plain worker Deployment", |_| true)
        .await
        .with_context(|| operator.log_tail())?;
    let (_, container) = pod_template(&plain)?;
    ensure!(
        quantities(container.resources.as_ref(), "requests")
            == pairs(&[("cpu", "100m"), ("memory", "128Mi")])
            && quantities(container.resources.as_ref(), "limits") == pairs(&[("memory", "512Mi")]),
        "the default resources: {:?}",
        container.resources
    );
    let orders = env
        .wait_deployment("orders-worker", "the orders worker Deployment", |_| true)
        .await?;
    let (_, container) = pod_template(&orders)?;
    ensure!(
        quantities(container.resources.as_ref(), "requests")
            == pairs(&[("cpu", "50m"), ("memory", "64Mi")])
            && quantities(container.resources.as_ref(), "limits") == pairs(&[("memory", "128Mi")]),
        "the adapter's own resources, as a whole: {:?}",
        container.resources
    );
    Ok(())
}

#[tokio::test]
async fn worker_disruption_budget_exists_with_two_replicas_and_goes_with_one() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = running_orders(&env).await?;
    let budgets = Api::<PodDisruptionBudget>::namespaced(env.admin.clone(), &env.namespace);
    let budget =
        control_plane::wait_object(&budgets, "orders-worker", "the worker budget", |_| true)
            .await
            .with_context(|| operator.log_tail())?;
    let owner = budget
        .metadata
        .owner_references
        .iter()
        .flatten()
        .next()
        .context("owner")?;
    ensure!(
        owner.kind == "QueueAdapter" && owner.name == "orders" && owner.controller == Some(true),
        "owned by the adapter: {owner:?}"
    );
    let spec = budget.spec.context("budget spec")?;
    ensure!(spec.max_unavailable == Some(IntOrString::Int(1)) && spec.min_available.is_none());
    let deployment = env.deployments().get("orders-worker").await?;
    ensure!(
        spec.selector.and_then(|s| s.match_labels)
            == deployment.spec.and_then(|s| s.selector.match_labels),
        "the budget selects the worker pods"
    );
    env.apply_adapter(&ORDERS.replace("replicas: 2", "replicas: 1"))
        .await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the budget is deleted at 1 replica",
        || async { Ok(budgets.get_opt("orders-worker").await?.is_none()) },
    )
    .await
    .with_context(|| operator.log_tail())?;
    env.apply_adapter(&ORDERS).await?;
    control_plane::wait_object(&budgets, "orders-worker", "the budget is back at 2", |_| {
        true
    })
    .await
    .with_context(|| operator.log_tail())?;
    Ok(())
}
