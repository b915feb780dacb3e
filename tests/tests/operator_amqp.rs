//! The operator on a real API server with a RabbitMQ adapter: the API server checks the amqp
//! schema and its CEL rules, and the Deployment the operator writes, run the way a kubelet
//! would, takes `AMQP_URL` from its Secret and stores messages from a real RabbitMQ node.

use anyhow::{Context, Result, ensure};
use lapin::BasicProperties;
use switchboard_tests::brokers::rabbitmq::{QueueType, RabbitMq, queue_arguments};
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{OPERATOR_TIMEOUT, OperatorEnv};
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 200;

/// QueueAdapter `orders` in [`OperatorEnv::NAMESPACE`] with `source` as `spec.source`.
fn adapter(source: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: orders, namespace: {namespace}}}\n\
         spec:\n\
         \x20 source: {source}\n\
         \x20 target: {{queue: orders}}\n\
         \x20 delivery: {{batchSize: 50}}\n",
        namespace = OperatorEnv::NAMESPACE
    )
}

#[tokio::test]
async fn amqp_adapter_pod_takes_the_url_from_its_secret_and_stores_messages() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let server = RabbitMq::start()?;
    server
        .declare("orders", queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let namespace = OperatorEnv::NAMESPACE;
    env.plane
        .put_secret(namespace, "rabbitmq", "url", &server.url())
        .await?;

    // The API server refuses two brokers at once (CEL) before any operator sees it.
    let both = adapter("{amqp: {queue: orders}, redis: {mode: stream, stream: orders}}");
    let refused = env.apply_adapter(&both).await;
    ensure!(
        refused
            .as_ref()
            .is_err_and(|err| format!("{err:#}").contains("exactly one broker")),
        "two brokers accepted: {refused:?}"
    );

    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&adapter(
        "{amqp: {queue: orders, urlSecretRef: {name: rabbitmq, key: url}}}",
    ))
    .await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await
        .with_context(|| operator.log_tail())?;
    let pod = LocalPod::start(
        &env.admin,
        &deployment,
        "orders-worker-5d8c7-bbbbb",
        env.fixture.dir.path(),
    )
    .await?;
    ensure!(pod.env.get("AMQP_URL") == Some(&server.url()));
    ensure!(
        !pod.env.contains_key("REDIS_URL"),
        "an AMQP worker got REDIS_URL"
    );
    wait_for(OPERATOR_TIMEOUT, "the readiness probe passes", || async {
        Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200)
    })
    .await
    .with_context(|| pod.log_tail())?;

    let messages = (0..MESSAGES).map(|i| {
        let properties = BasicProperties::default().with_message_id(format!("o-{i}").into());
        (format!(r#"{{"order":{i}}}"#).into_bytes(), properties)
    });
    server.publish("orders", messages).await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "every message is a todo and the queue is empty",
        || async {
            Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
                && server.messages("orders").await? == 0)
        },
    )
    .await
    .with_context(|| pod.log_tail())?;
    ensure!(env.fixture.distinct_keys("orders").await? == MESSAGES as i64);
    ensure!(
        !pod.log_tail().contains("guest:guest"),
        "the URL's password in the worker log"
    );
    env.wait_adapter("orders", "the status names source amqp", |a| {
        a.status
            .as_ref()
            .is_some_and(|s| s.source.as_deref() == Some("amqp"))
    })
    .await
    .with_context(|| operator.log_tail())?;
    Ok(())
}
