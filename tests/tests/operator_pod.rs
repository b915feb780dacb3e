//! Acceptance for the Deployment the operator writes: its pod template, run locally the way a
//! kubelet would (ConfigMap volume, env from Secrets and the downward API, probes), ingests
//! messages from Redis into todos with the real worker binary.

use anyhow::{Context, Result, ensure};
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest};
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 500;

#[tokio::test]
async fn rendered_pod_template_ingests_messages_from_redis_into_todos() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&adapter_manifest(
        "orders",
        "  delivery: {batchSize: 50}\n  workload: {replicas: 2}\n",
    ))
    .await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    let log_dir = env.fixture.dir.path();
    let mut pods = Vec::new();
    for pod_name in ["orders-worker-5d8c7-aaaaa", "orders-worker-5d8c7-bbbbb"] {
        pods.push(LocalPod::start(&env.admin, &deployment, pod_name, log_dir).await?);
    }
    let first = &pods[0];
    ensure!(first.env["REDIS_URL"] == env.fixture.redis.url());
    ensure!(first.env["DATABASE_URL"] == env.fixture.postgres.url());
    ensure!(first.env["HOSTNAME"] == "orders-worker-5d8c7-aaaaa");
    for pod in &pods {
        wait_for(OPERATOR_TIMEOUT, "the readiness probe passes", || async {
            Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200)
        })
        .await
        .with_context(|| pod.log_tail())?;
        ensure!(pod.probe(pod.container.liveness_probe.as_ref()).await? == 200);
    }

    let bodies = (0..MESSAGES).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes());
    env.fixture.produce("orders", bodies)?;
    wait_for(OPERATOR_TIMEOUT, "every message is a todo", || async {
        Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
            && env.fixture.pending("orders", "switchboard")? == 0)
    })
    .await
    .with_context(|| {
        pods.iter()
            .map(LocalPod::log_tail)
            .collect::<Vec<_>>()
            .join("\n")
    })?;
    ensure!(env.fixture.distinct_keys("orders").await? == MESSAGES as i64);

    // Consumer names are the pod names (HOSTNAME from metadata.name).
    let mut redis = env.fixture.redis.connection()?;
    let consumers: redis::Value = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg("orders")
        .arg("switchboard")
        .query(&mut redis)?;
    let consumers = format!("{consumers:?}");
    for pod in ["orders-worker-5d8c7-aaaaa", "orders-worker-5d8c7-bbbbb"] {
        ensure!(
            consumers.contains(pod),
            "{pod} is not a consumer: {consumers}"
        );
    }
    for pod in &mut pods {
        ensure!(pod.is_running(), "{}", pod.log_tail());
    }
    // JSON logs (LOG_JSON=true), and no secret in them.
    let log = pods[0].log_tail();
    ensure!(log.contains(r#""level":"INFO""#), "{log}");
    ensure!(
        !log.contains(&env.fixture.redis.url()),
        "secret in the worker log"
    );
    Ok(())
}

/// The operator's default database CA (Helm value `worker.defaultDatabaseCa`) reaches the
/// worker Deployment the API server stores: the ConfigMap key mounted read-only, its path in
/// `PGSSLROOTCERT` for `sslmode=verify-full`.
#[tokio::test]
async fn default_database_ca_is_mounted_read_only_as_pgsslrootcert() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let _operator = env.start_operator(
        "operator-a",
        &["--default-database-ca", "configMap:pg-bundle/ca.pem"],
    )?;
    env.apply_adapter(&adapter_manifest("orders", "")).await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    let pod = deployment
        .spec
        .and_then(|spec| spec.template.spec)
        .context("a pod template")?;
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "database-ca")
        .context("the database CA volume")?;
    let map = volume.config_map.as_ref().context("from the ConfigMap")?;
    ensure!(map.name == "pg-bundle", "{map:?}");
    let items = map.items.as_deref().unwrap_or_default();
    ensure!(items.len() == 1 && items[0].key == "ca.pem" && items[0].path == "ca.crt");
    let container = &pod.containers[0];
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "database-ca")
        .context("mounted")?;
    ensure!(mount.read_only == Some(true), "{mount:?}");
    let root_cert = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "PGSSLROOTCERT")
        .and_then(|e| e.value.clone());
    ensure!(
        root_cert == Some(format!("{}/ca.crt", mount.mount_path)),
        "{root_cert:?}"
    );
    Ok(())
}
