//! The operator on a real API server with an Amazon SQS adapter: the Deployment it writes, run
//! the way a kubelet would, stores messages from a real SQS-compatible server (ElasticMQ); and a
//! disabled adapter stops its worker even when its spec is invalid.

use anyhow::{Context, Result, ensure};
use switchboard_tests::brokers::sqs::ElasticMq;
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest, condition, orders_adapter,
};
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 200;

/// QueueAdapter `orders` in [`OperatorEnv::NAMESPACE`] reading `queue_url` on `endpoint`, the
/// credentials from Secrets `aws-key-id` (key `id`) and `aws-secret` (key `secret`).
fn sqs_adapter(queue_url: &str, endpoint: &str) -> String {
    orders_adapter(&format!(
        "\x20   sqs:\n\
         \x20     queueUrl: \"{queue_url}\"\n\
         \x20     endpoint: \"{endpoint}\"\n\
         \x20     region: us-east-1\n\
         \x20     waitTimeSeconds: 1\n\
         \x20     accessKeyIdSecretRef: {{name: aws-key-id, key: id}}\n\
         \x20     secretAccessKeySecretRef: {{name: aws-secret, key: secret}}\n"
    ))
}

#[tokio::test]
async fn sqs_adapter_pod_takes_credentials_from_secrets_and_stores_messages_from_sqs() -> Result<()>
{
    let env = OperatorEnv::start().await?;
    let mq = ElasticMq::start()?;
    let queue = mq.create_queue("orders", &[]).await?;
    mq.create_queue("orders-dlq", &[]).await?;
    let namespace = OperatorEnv::NAMESPACE;
    env.plane
        .put_secret(namespace, "aws-key-id", "id", "test-key-id")
        .await?;
    env.plane
        .put_secret(namespace, "aws-secret", "secret", "test-secret-key")
        .await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&sqs_adapter(&queue, &mq.endpoint()))
        .await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await
        .with_context(|| operator.log_tail())?;

    let pod = LocalPod::start(
        &env.admin,
        &deployment,
        "orders-worker-5d8c7-aaaaa",
        env.fixture.dir.path(),
    )
    .await?;
    ensure!(pod.env.get("AWS_ACCESS_KEY_ID").map(String::as_str) == Some("test-key-id"));
    ensure!(pod.env.get("AWS_SECRET_ACCESS_KEY").map(String::as_str) == Some("test-secret-key"));
    ensure!(
        !pod.env.contains_key("REDIS_URL"),
        "an SQS worker got REDIS_URL"
    );
    ensure!(pod.env["DATABASE_URL"] == env.fixture.postgres.url());
    wait_for(OPERATOR_TIMEOUT, "the readiness probe passes", || async {
        Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200)
    })
    .await
    .with_context(|| pod.log_tail())?;

    let bodies = (0..MESSAGES).map(|i| format!(r#"{{"order":{i}}}"#).into_bytes());
    mq.send_bodies(&queue, bodies).await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "every message is a todo and the queue is empty",
        || async {
            let counts = mq.count(&queue).await?;
            Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
                && counts.visible + counts.in_flight == 0)
        },
    )
    .await
    .with_context(|| pod.log_tail())?;
    ensure!(env.fixture.distinct_keys("orders").await? == MESSAGES as i64);
    let log = pod.log_tail();
    ensure!(!log.contains("test-secret-key"), "secret in the worker log");

    env.wait_adapter(
        "orders",
        "the status names source sqs, mode standard",
        |a| {
            a.status.as_ref().is_some_and(|s| {
                s.source.as_deref() == Some("sqs") && s.mode.as_deref() == Some("standard")
            })
        },
    )
    .await
    .with_context(|| operator.log_tail())?;
    let table = env
        .plane
        .kubectl_ok(&["get", "qa", "orders", "-n", namespace])?;
    let row = table
        .lines()
        .nth(1)
        .context("kubectl get qa printed no row")?;
    let columns: Vec<&str> = row.split_whitespace().collect();
    ensure!(
        columns.contains(&"sqs") && columns.contains(&"standard"),
        "kubectl get qa:\n{table}"
    );
    Ok(())
}

#[tokio::test]
async fn invalid_disabled_adapter_still_scales_its_worker_to_zero() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&adapter_manifest("orders", "  workload: {replicas: 2}\n"))
        .await?;
    env.wait_deployment("orders-worker", "the worker Deployment runs 2", |d| {
        d.spec.as_ref().and_then(|s| s.replicas) == Some(2)
    })
    .await
    .with_context(|| operator.log_tail())?;

    // The API server accepts it (the schema leaves urlSecretRef optional); the operator cannot
    // run it in Kubernetes without the Redis URL.
    let invalid = format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: orders, namespace: {namespace}}}\n\
         spec:\n\
         \x20 enabled: false\n\
         \x20 source:\n\
         \x20   redis: {{mode: stream, stream: orders}}\n\
         \x20 target: {{queue: orders}}\n\
         \x20 workload: {{replicas: 2}}\n",
        namespace = OperatorEnv::NAMESPACE
    );
    env.apply_adapter(&invalid).await?;
    env.wait_deployment(
        "orders-worker",
        "the worker Deployment is scaled to 0",
        |d| d.spec.as_ref().and_then(|s| s.replicas) == Some(0),
    )
    .await
    .with_context(|| operator.log_tail())?;
    let adapter = env
        .wait_adapter(
            "orders",
            "a condition names spec.source.redis.urlSecretRef",
            |a| {
                ["Reconciled", "Ready"].iter().any(|type_| {
                    condition(a, type_).is_some_and(|c| {
                        c.status == "False" && c.message.contains("spec.source.redis.urlSecretRef")
                    })
                })
            },
        )
        .await
        .with_context(|| operator.log_tail())?;
    let reconciled = condition(&adapter, "Reconciled").context("no Reconciled condition")?;
    ensure!(
        reconciled.status == "False",
        "Reconciled is {}: {}",
        reconciled.status,
        reconciled.message
    );
    Ok(())
}
