//! The operator on a real API server with a gateway adapter whose gateway has a private CA
//! (`spec.source.gateway.tls.caSecretRef`): the Deployment mounts only that key, read-only, and
//! names the file in `GATEWAY_CA_FILE`; the worker run from it the way a kubelet would stores
//! messages through the HTTPS test gateway with tokens from a real Hydra. The API server takes
//! `spec.source.gateway.deadLetter.queue`, and refuses it naming the queue itself (CEL).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use switchboard_api::source::gateway::{CA_DIR, CA_ENV, CA_FILE};
use switchboard_tests::brokers::gateway::{AUDIENCE, SCOPE, TestCa};
use switchboard_tests::brokers::{BrokerFixture, GatewayBroker};
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, orders_adapter, pod_template,
};
use switchboard_tests::wait::wait_for;

const MESSAGES: usize = 50;

#[tokio::test]
async fn gateway_adapter_pod_mounts_its_ca_read_only_and_stores_messages_over_tls() -> Result<()> {
    let env = OperatorEnv::start().await?;
    let ca = TestCa::generate()?;
    let (broker, _) = GatewayBroker::start_with(Duration::from_secs(300), Some(&ca))?;
    broker.create_queues("orders").await?;
    let namespace = OperatorEnv::NAMESPACE;
    env.plane
        .put_secret(namespace, "gateway-client", "secret", &broker.client.secret)
        .await?;
    env.plane
        .put_secret(namespace, "gateway-ca", "ca.pem", &ca.ca_pem)
        .await?;
    let operator = env.start_operator("operator-a", &[])?;
    // The API server refuses a dead-letter queue that is the queue itself (CEL).
    let itself = env
        .apply_adapter(&orders_adapter(&format!(
            "\x20   gateway:\n\
             \x20     url: \"{url}\"\n\
             \x20     queue: orders\n\
             \x20     deadLetter: {{queue: orders}}\n\
             \x20     auth: {{tokenSecretRef: {{name: gateway-client, key: secret}}}}\n",
            url = broker.gateway.url(),
        )))
        .await;
    ensure!(
        itself.as_ref().is_err_and(|err| format!("{err:#}")
            .contains("spec.source.gateway.deadLetter.queue must name the dead-letter queue")),
        "the queue accepted as its own dead-letter queue: {itself:?}"
    );
    env.apply_adapter(&orders_adapter(&format!(
        "\x20   gateway:\n\
         \x20     url: \"{url}\"\n\
         \x20     queue: orders\n\
         \x20     deadLetter: {{queue: orders-dlq}}\n\
         \x20     waitTimeSeconds: 1\n\
         \x20     auth: {{oauth2: {{tokenUrl: \"{token_url}\", clientId: \"{client}\", \
         clientSecretRef: {{name: gateway-client, key: secret}}, audience: \"{AUDIENCE}\", \
         scopes: [{SCOPE}]}}}}\n\
         \x20     tls: {{caSecretRef: {{name: gateway-ca, key: ca.pem}}}}\n",
        url = broker.gateway.url(),
        token_url = broker.hydra.token_url(),
        client = broker.client.id,
    )))
    .await?;
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await
        .with_context(|| operator.log_tail())?;

    let (pod_spec, container) = pod_template(&deployment)?;
    let volume = pod_spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "gateway-ca")
        .context("no gateway-ca volume")?;
    let secret = volume
        .secret
        .as_ref()
        .context("the CA volume is a Secret's")?;
    let items: Vec<(&str, &str)> = secret
        .items
        .iter()
        .flatten()
        .map(|item| (item.key.as_str(), item.path.as_str()))
        .collect();
    ensure!(
        secret.secret_name.as_deref() == Some("gateway-ca")
            && items == [("ca.pem", CA_FILE)]
            && secret.default_mode == Some(0o444),
        "the CA volume holds only its key, read-only: {secret:?}"
    );
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "gateway-ca")
        .context("the CA volume is not mounted")?;
    ensure!(
        mount.mount_path == CA_DIR && mount.read_only == Some(true),
        "{mount:?}"
    );
    let ca_env = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == CA_ENV)
        .context("no GATEWAY_CA_FILE")?;
    ensure!(
        ca_env.value.as_deref() == Some(format!("{CA_DIR}/{CA_FILE}").as_str()),
        "{ca_env:?}"
    );

    let pod = LocalPod::start(
        &env.admin,
        &deployment,
        "orders-worker-5d8c7-aaaaa",
        env.fixture.dir.path(),
    )
    .await?;
    ensure!(
        std::fs::read_to_string(&pod.env[CA_ENV])? == ca.ca_pem,
        "the pod reads the CA from the mounted file"
    );
    wait_for(OPERATOR_TIMEOUT, "the readiness probe passes", || async {
        Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200)
    })
    .await
    .with_context(|| pod.log_tail())?;
    let bodies = (0..MESSAGES)
        .map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
        .collect();
    broker.produce(&env.fixture, "orders", bodies).await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "every message is a todo and nothing is left un-acknowledged",
        || async {
            Ok(env.fixture.todo_count("orders").await? == MESSAGES as i64
                && broker.unacknowledged(&env.fixture, "orders").await? == 0)
        },
    )
    .await
    .with_context(|| pod.log_tail())?;
    ensure!(env.fixture.distinct_keys("orders").await? == MESSAGES as i64);
    ensure!(
        !pod.log_tail().contains(&broker.client.secret),
        "the client secret is in the worker log"
    );
    Ok(())
}
