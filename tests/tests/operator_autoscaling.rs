//! `spec.workload.autoscaling` on a real kube-apiserver with KEDA's own CRDs installed: the
//! ScaledObject (and the SQS TriggerAuthentication) the operator writes pass KEDA's schema with
//! every field kept, the Deployment's `replicas` is left to it, and turning autoscaling off
//! removes them and gives `replicas` back. With KEDA's own operator running: scale to zero and
//! back on a Redis stream's backlog.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use lapin::BasicProperties;
use serde_json::json;
use switchboard_operator::operator_owns_replicas;
use switchboard_tests::brokers::kafka::KafkaServer;
use switchboard_tests::brokers::nats::NatsServer;
use switchboard_tests::brokers::rabbitmq::{QueueType, RabbitMq, queue_arguments};
use switchboard_tests::brokers::sqs::ElasticMq;
use switchboard_tests::control_plane::keda::KedaOperator;
use switchboard_tests::control_plane::pod::LocalPod;
use switchboard_tests::control_plane::{
    OPERATOR_TIMEOUT, OperatorEnv, adapter_manifest, condition, wait_object,
};
use switchboard_tests::todos_lock::TodosLock;
use switchboard_tests::wait::wait_for;

const QUEUE_URL: &str = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders";

fn keda(env: &OperatorEnv, kind: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("keda.sh", "v1alpha1", kind));
    Api::namespaced_with(env.admin.clone(), &env.namespace, &resource)
}

fn sqs_adapter(workload: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: orders, namespace: {}}}\n\
         spec:\n\
         \x20 source:\n\
         \x20   sqs:\n\
         \x20     queueUrl: \"{QUEUE_URL}\"\n\
         \x20     accessKeyIdSecretRef: {{name: aws-id, key: id}}\n\
         \x20     secretAccessKeySecretRef: {{name: aws-secret, key: secret}}\n\
         \x20 target: {{queue: orders}}\n\
         {workload}",
        OperatorEnv::NAMESPACE
    )
}

fn replicas(deployment: &Deployment) -> Option<i32> {
    deployment.spec.as_ref()?.replicas
}

/// The Secrets [`sqs_adapter`] references.
async fn put_aws_secrets(env: &OperatorEnv) -> Result<()> {
    for (name, key, value) in [
        ("aws-id", "id", "AKIDEXAMPLE"),
        ("aws-secret", "secret", "not-a-real-secret"),
    ] {
        env.plane
            .put_secret(&env.namespace, name, key, value)
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn autoscaled_sqs_adapter_gets_a_scaled_object_keda_accepts_and_leaves_replicas_to_it()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    put_aws_secrets(&env).await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&sqs_adapter(
        "  workload:\n    autoscaling: {minReplicas: 0, maxReplicas: 5, targetBacklogPerReplica: 50}\n",
    ))
    .await?;

    let scaled_objects = keda(&env, "ScaledObject");
    let authentications = keda(&env, "TriggerAuthentication");
    let scaled = wait_object(
        &scaled_objects,
        "orders-worker",
        "the ScaledObject exists",
        |_| true,
    )
    .await
    .with_context(|| format!("operator log:\n{}", operator.log_tail()))?;
    // The API server stores what KEDA's schema keeps: every field we set must still be there.
    let spec = &scaled.data["spec"];
    let expected = json!({
        "scaleTargetRef": {"name": "orders-worker"},
        "minReplicaCount": 0,
        "maxReplicaCount": 5,
        "triggers": [{
            "type": "aws-sqs-queue",
            "authenticationRef": {"name": "orders-worker"},
            "metadata": {
                "queueURL": QUEUE_URL,
                "awsRegion": "eu-west-1",
                "queueLength": "50",
                "activationQueueLength": "0",
                "scaleOnInFlight": "true",
            },
        }],
    });
    ensure!(
        spec == &expected,
        "ScaledObject spec\n{spec:#}\nexpected\n{expected:#}"
    );
    let authentication = authentications.get("orders-worker").await?;
    let targets = &authentication.data["spec"]["secretTargetRef"];
    ensure!(
        targets
            == &json!([
                {"parameter": "awsAccessKeyID", "name": "aws-id", "key": "id"},
                {"parameter": "awsSecretAccessKey", "name": "aws-secret", "key": "secret"},
            ]),
        "TriggerAuthentication {targets:#}"
    );
    ensure!(
        !serde_json::to_string(&authentication.data)?.contains("not-a-real-secret"),
        "a secret value in the TriggerAuthentication"
    );

    // `replicas` is KEDA's (through its HPA): the operator neither owns nor resets it.
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    ensure!(
        !operator_owns_replicas(&deployment),
        "the operator still owns spec.replicas"
    );
    env.deployments()
        .patch(
            "orders-worker",
            &PatchParams::apply("keda-hpa").force(),
            &Patch::Apply(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "spec": {"replicas": 4},
            })),
        )
        .await?;
    let generation = deployment.metadata.generation;
    env.apply_adapter(&sqs_adapter(
        "  delivery: {batchSize: 20}\n  workload:\n    autoscaling: {minReplicas: 0, maxReplicas: 5, targetBacklogPerReplica: 50}\n",
    ))
    .await?;
    let rolled = env
        .wait_deployment("orders-worker", "the spec change is applied", |d| {
            d.metadata.generation > generation
        })
        .await?;
    ensure!(
        replicas(&rolled) == Some(4),
        "the reconcile reset KEDA's replicas: {:?}",
        replicas(&rolled)
    );

    // Autoscaling off: KEDA's objects go, `replicas` is the spec's again.
    env.apply_adapter(&sqs_adapter("")).await?;
    wait_for(OPERATOR_TIMEOUT, "the KEDA objects are deleted", || async {
        Ok(scaled_objects.get_opt("orders-worker").await?.is_none()
            && authentications.get_opt("orders-worker").await?.is_none())
    })
    .await?;
    env.wait_deployment("orders-worker", "replicas is the spec's 1 again", |d| {
        replicas(d) == Some(1) && operator_owns_replicas(d)
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn autoscaling_a_redis_list_or_without_trigger_authentication_is_refused_naming_why()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    let refused = |yaml: String| {
        let env = &env;
        async move {
            match env.apply_adapter(&yaml).await {
                Ok(_) => anyhow::bail!("the API server accepted:\n{yaml}"),
                Err(err) => Ok(format!("{err:#}")),
            }
        }
    };
    let stream = refused(adapter_manifest(
        "orders",
        "  workload:\n    autoscaling: {maxReplicas: 3}\n",
    ))
    .await?;
    ensure!(
        stream.contains("spec.workload.autoscaling.triggerAuthenticationRef is required for Redis"),
        "{stream}"
    );
    let list = refused(
        adapter_manifest("jobs", "  workload:\n    autoscaling: {maxReplicas: 3, triggerAuthenticationRef: redis-keda}\n")
            .replace("mode: stream, stream: jobs", "mode: list, list: jobs"),
    )
    .await?;
    ensure!(
        list.contains("Redis lists and pubsub cannot be autoscaled"),
        "{list}"
    );
    let inverted = refused(adapter_manifest(
        "orders",
        "  workload:\n    autoscaling: {minReplicas: 4, maxReplicas: 3, triggerAuthenticationRef: redis-keda}\n",
    ))
    .await?;
    ensure!(
        inverted.contains("maxReplicas must be at least minReplicas"),
        "{inverted}"
    );
    let nats = refused(
        adapter_manifest("events", "  workload:\n    autoscaling: {maxReplicas: 3}\n").replace(
            "redis: {mode: stream, stream: events, urlSecretRef: {name: redis, key: url}}",
            "nats: {stream: EVENTS, urlSecretRef: {name: nats, key: url}}",
        ),
    )
    .await?;
    ensure!(
        nats.contains("natsMonitoringEndpoint is required for NATS"),
        "{nats}"
    );
    Ok(())
}

/// A QueueAdapter `name` reading `source` (a YAML flow mapping), autoscaled with `autoscaling`.
fn autoscaled_adapter(name: &str, source: &str, autoscaling: &str) -> String {
    format!(
        "apiVersion: switchboard.dev/v1alpha1\n\
         kind: QueueAdapter\n\
         metadata: {{name: {name}, namespace: {}}}\n\
         spec:\n\
         \x20 source: {source}\n\
         \x20 target: {{queue: {name}}}\n\
         \x20 workload:\n\
         \x20   autoscaling: {autoscaling}\n",
        OperatorEnv::NAMESPACE
    )
}

#[tokio::test]
async fn nats_rabbitmq_and_kafka_adapters_get_their_brokers_trigger_counting_held_messages()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    for name in ["nats", "rabbitmq"] {
        env.plane
            .put_secret(
                &env.namespace,
                name,
                "url",
                "scheme://user:not-a-real-secret@host",
            )
            .await?;
    }
    let operator = env.start_operator("operator-a", &[])?;
    let cases = [
        (
            "events",
            "{nats: {stream: EVENTS, consumer: workers, urlSecretRef: {name: nats, key: url}}}",
            "{maxReplicas: 4, targetBacklogPerReplica: 200, natsMonitoringEndpoint: \"nats.shop:8222\"}",
            json!({
                "type": "nats-jetstream",
                "metadata": {
                    "natsServerMonitoringEndpoint": "nats.shop:8222",
                    "account": "$G",
                    "stream": "EVENTS",
                    "consumer": "workers",
                    "lagThreshold": "200",
                    "activationLagThreshold": "0",
                },
            }),
        ),
        (
            "jobs",
            "{amqp: {queue: jobs, urlSecretRef: {name: rabbitmq, key: url}}}",
            "{maxReplicas: 4, activationBacklog: 5, triggerAuthenticationRef: rabbitmq-management}",
            json!({
                "type": "rabbitmq",
                "authenticationRef": {"name": "rabbitmq-management"},
                "metadata": {
                    "protocol": "http",
                    "queueName": "jobs",
                    "mode": "QueueLength",
                    "value": "100",
                    "activationValue": "5",
                },
            }),
        ),
        (
            "clicks",
            "{kafka: {bootstrapServers: \"kafka-0:9092\", topics: [clicks], startFrom: latest}}",
            "{minReplicas: 0, maxReplicas: 6}",
            json!({
                "type": "kafka",
                "metadata": {
                    "bootstrapServers": "kafka-0:9092",
                    "consumerGroup": "switchboard-shop-clicks",
                    "topic": "clicks",
                    "lagThreshold": "100",
                    "activationLagThreshold": "0",
                    "offsetResetPolicy": "latest",
                },
            }),
        ),
    ];
    for (name, source, autoscaling, _) in &cases {
        env.apply_adapter(&autoscaled_adapter(name, source, autoscaling))
            .await?;
    }
    let scaled_objects = keda(&env, "ScaledObject");
    for (name, _, _, trigger) in cases {
        let scaled = wait_object(
            &scaled_objects,
            &format!("{name}-worker"),
            &format!("the ScaledObject of {name} exists"),
            |_| true,
        )
        .await
        .with_context(|| format!("operator log:\n{}", operator.log_tail()))?;
        // Every field we set survived KEDA's schema.
        let triggers = &scaled.data["spec"]["triggers"];
        ensure!(
            triggers == &json!([trigger]),
            "{name}: triggers\n{triggers:#}\nexpected\n{trigger:#}"
        );
    }
    Ok(())
}

/// `workload` with `replicas` and, when given, `autoscaling` (a YAML flow mapping).
fn workload(replicas: i32, autoscaling: Option<&str>) -> String {
    let autoscaling = autoscaling
        .map(|a| format!("    autoscaling: {a}\n"))
        .unwrap_or_default();
    format!("  workload:\n    replicas: {replicas}\n{autoscaling}")
}

#[tokio::test]
async fn enabling_autoscaling_never_lowers_the_replicas_below_the_running_count_or_the_minimum()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    put_aws_secrets(&env).await?;
    let operator = env.start_operator("operator-a", &[])?;
    env.apply_adapter(&sqs_adapter(&workload(3, None))).await?;
    env.wait_deployment("orders-worker", "3 replicas run", |d| {
        replicas(d) == Some(3)
    })
    .await
    .with_context(|| operator.log_tail())?;

    // Without KEDA: the ScaledObject cannot be written, the 3 running replicas stay.
    let min_two = "{minReplicas: 2, maxReplicas: 5, targetBacklogPerReplica: 50}";
    env.apply_adapter(&sqs_adapter(&workload(3, Some(min_two))))
        .await?;
    env.wait_adapter(
        "orders",
        "Degraded=True KubernetesApiError (no KEDA)",
        |a| {
            condition(a, "Degraded")
                .is_some_and(|c| c.status == "True" && c.reason == "KubernetesApiError")
        },
    )
    .await
    .with_context(|| operator.log_tail())?;
    let deployment = env.deployments().get("orders-worker").await?;
    ensure!(
        replicas(&deployment) == Some(3),
        "enabling autoscaling without KEDA changed 3 running replicas to {:?}",
        replicas(&deployment)
    );
    // A minimum above what runs raises it.
    let min_four = "{minReplicas: 4, maxReplicas: 5, targetBacklogPerReplica: 50}";
    env.apply_adapter(&sqs_adapter(&workload(3, Some(min_four))))
        .await?;
    env.wait_deployment("orders-worker", "minReplicas 4 raises the replicas", |d| {
        replicas(d) == Some(4)
    })
    .await
    .with_context(|| operator.log_tail())?;

    // With KEDA: switched off (the spec's 3 again), then on with minReplicas 1: 3 stay.
    env.plane.install_keda_crds().await?;
    let scaled_objects = keda(&env, "ScaledObject");
    env.apply_adapter(&sqs_adapter(&workload(3, None))).await?;
    env.wait_deployment("orders-worker", "the spec's 3 replicas again", |d| {
        replicas(d) == Some(3) && operator_owns_replicas(d)
    })
    .await?;
    let min_one = "{minReplicas: 1, maxReplicas: 5, targetBacklogPerReplica: 50}";
    env.apply_adapter(&sqs_adapter(&workload(3, Some(min_one))))
        .await?;
    wait_object(
        &scaled_objects,
        "orders-worker",
        "the ScaledObject exists",
        |_| true,
    )
    .await
    .with_context(|| operator.log_tail())?;
    let deployment = env
        .wait_deployment("orders-worker", "the operator let go of replicas", |d| {
            !operator_owns_replicas(d)
        })
        .await?;
    ensure!(
        replicas(&deployment) == Some(3),
        "enabling autoscaling with KEDA changed 3 running replicas to {:?}",
        replicas(&deployment)
    );
    Ok(())
}

/// The last time KEDA saw a trigger of ScaledObject `name` active (`status.lastActiveTime`).
async fn last_active(
    scaled_objects: &Api<DynamicObject>,
    name: &str,
) -> Result<Option<SystemTime>> {
    let object = scaled_objects.get(name).await?;
    object.data["status"]["lastActiveTime"]
        .as_str()
        .map(|text| Ok(humantime::parse_rfc3339(text)?))
        .transpose()
}

/// A broker of the scale-to-zero tests: its adapter's `spec.source`, what its autoscaling adds
/// (a TriggerAuthentication, a monitoring endpoint), how to produce and how many messages wait
/// (received by no worker).
trait ZeroCase {
    fn source(&self) -> String;
    fn autoscaling(&self) -> Option<String>;
    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()>;
    async fn waiting(&self) -> Result<u64>;
}

/// Connections of PostgreSQL waiting for a lock (a worker storing behind [`TodosLock`]).
async fn lock_waiters(env: &OperatorEnv) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            .fetch_one(env.fixture.pool())
            .await?,
    )
}

/// KEDA's own operator and ours on `env`, an adapter `orders` of `case` with `minReplicas: 0`,
/// a 1 s polling interval and a 3 s cooldown, and a kubelet stand-in started and killed by the
/// test as the replicas say: the first pod makes the group or consumer and stores a first
/// message, then nothing waits and KEDA scales it to zero; five messages wake it; while its pod
/// holds them (its store behind a lock) KEDA keeps seeing the trigger active past the cooldown
/// and leaves it at one; once they are stored and acknowledged it is scaled to zero again;
/// every message is one todo.
async fn scales_to_zero_and_back(env: &OperatorEnv, case: &impl ZeroCase) -> Result<()> {
    const COOLDOWN: u64 = 3;
    let keda_operator = KedaOperator::start(&env.plane, env.fixture.dir.path()).await?;
    let operator = env.start_operator("operator-a", &[])?;
    let extra = case
        .autoscaling()
        .map(|extra| format!(", {extra}"))
        .unwrap_or_default();
    env.apply_adapter(&autoscaled_adapter(
        "orders",
        &case.source(),
        &format!(
            "{{minReplicas: 0, maxReplicas: 3, targetBacklogPerReplica: 10, \
             pollingIntervalSeconds: 1, cooldownSeconds: {COOLDOWN}{extra}}}"
        ),
    ))
    .await?;
    let logs = || format!("{}\n{}", keda_operator.log_tail(), operator.log_tail());
    let dir = env.fixture.dir.path();

    // The first pod (a new Deployment has one) makes the group or consumer and stores a first
    // message (a Kafka group that never committed counts a lag of one); then nothing waits.
    let deployment = env
        .wait_deployment("orders-worker", "the worker Deployment exists", |_| true)
        .await?;
    let mut pod = LocalPod::start(&env.admin, &deployment, "orders-worker-1", dir).await?;
    wait_for(OPERATOR_TIMEOUT, "the first pod is ready", || async {
        Ok(pod.probe(pod.container.readiness_probe.as_ref()).await? == 200)
    })
    .await
    .with_context(|| pod.log_tail())?;
    let mut bodies = vec![br#"{"order":"first"}"#.to_vec()];
    case.produce(bodies.clone()).await?;
    wait_for(OPERATOR_TIMEOUT, "the first message is stored", || async {
        Ok(env.fixture.todo_count("orders").await? == 1)
    })
    .await
    .with_context(|| pod.log_tail())?;
    env.wait_deployment("orders-worker", "KEDA scales the idle worker to 0", |d| {
        replicas(d) == Some(0)
    })
    .await
    .with_context(logs)?;
    pod.kill();

    // A backlog wakes it; its pod receives the messages and holds them, its store locked out.
    let lock = TodosLock::take(&env.fixture.postgres.url()).await?;
    let backlog: Vec<Vec<u8>> = (0..5)
        .map(|i| format!(r#"{{"order":{i}}}"#).into_bytes())
        .collect();
    case.produce(backlog.clone()).await?;
    bodies.extend(backlog);
    let deployment = env
        .wait_deployment(
            "orders-worker",
            "KEDA wakes the worker on the backlog",
            |d| replicas(d) == Some(1),
        )
        .await
        .with_context(logs)?;
    let mut pod = LocalPod::start(&env.admin, &deployment, "orders-worker-2", dir).await?;
    wait_for(
        OPERATOR_TIMEOUT,
        "the worker holds every message, its store waiting",
        || async { Ok(case.waiting().await? == 0 && lock_waiters(env).await? > 0) },
    )
    .await
    .with_context(|| pod.log_tail())?;

    // Held, not waiting: KEDA keeps seeing the trigger active past the cooldown.
    let held_since = SystemTime::now();
    let scaled_objects = keda(env, "ScaledObject");
    wait_for(
        OPERATOR_TIMEOUT,
        "KEDA saw the held batch a cooldown later",
        || async {
            Ok(last_active(&scaled_objects, "orders-worker")
                .await?
                .is_some_and(|at| at > held_since + Duration::from_secs(COOLDOWN + 1)))
        },
    )
    .await
    .with_context(logs)?;
    let deployment = env.deployments().get("orders-worker").await?;
    ensure!(
        replicas(&deployment) == Some(1),
        "KEDA scaled the worker away while it held a batch: {:?}",
        replicas(&deployment)
    );

    // Stored and acknowledged: nothing waits or is held, so KEDA scales to zero again.
    lock.release().await?;
    env.wait_deployment(
        "orders-worker",
        "KEDA scales the drained worker to 0",
        |d| replicas(d) == Some(0),
    )
    .await
    .with_context(|| format!("{}\n{}", pod.log_tail(), logs()))?;
    pod.kill();
    env.fixture.assert_stored_exactly("orders", &bodies).await
}

/// Secret `name` holding `value` under key `parameter`, and TriggerAuthentication `name` giving
/// it to KEDA as that parameter.
async fn secret_trigger_authentication(
    env: &OperatorEnv,
    name: &str,
    parameter: &str,
    value: &str,
) -> Result<()> {
    env.plane
        .put_secret(&env.namespace, name, parameter, value)
        .await?;
    keda(env, "TriggerAuthentication")
        .patch(
            name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(json!({
                "apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
                "metadata": {"name": name},
                "spec": {"secretTargetRef": [
                    {"parameter": parameter, "name": name, "key": parameter},
                ]},
            })),
        )
        .await?;
    Ok(())
}

/// Stream `orders` of the fixture's Redis; KEDA connects through TriggerAuthentication
/// `redis-keda` (the address from a Secret).
struct RedisZero<'a>(&'a OperatorEnv);

impl RedisZero<'_> {
    async fn start(env: &OperatorEnv) -> Result<RedisZero<'_>> {
        let address = env.fixture.redis.address();
        secret_trigger_authentication(env, "redis-keda", "address", &address).await?;
        Ok(RedisZero(env))
    }
}

impl ZeroCase for RedisZero<'_> {
    fn source(&self) -> String {
        "{redis: {mode: stream, stream: orders, urlSecretRef: {name: redis, key: url}}}".into()
    }

    fn autoscaling(&self) -> Option<String> {
        Some("triggerAuthenticationRef: redis-keda".into())
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.0.fixture.produce("orders", bodies).map(drop)
    }

    async fn waiting(&self) -> Result<u64> {
        Ok(u64::try_from(self.0.fixture.group_lag("orders")?)?)
    }
}

/// Stream `ORDERS` (subjects `orders.>`) of a nats-server of its own, consumer `workers`; KEDA
/// reads the consumer from the server's monitoring endpoint.
struct NatsZero(NatsServer);

impl ZeroCase for NatsZero {
    fn source(&self) -> String {
        "{nats: {stream: ORDERS, consumer: workers, urlSecretRef: {name: nats, key: url}}}".into()
    }

    fn autoscaling(&self) -> Option<String> {
        Some(format!(
            "natsMonitoringEndpoint: \"{}\"",
            self.0
                .monitoring_address()
                .expect("nats-server's monitoring port")
        ))
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.0.publish("orders.new", bodies).await
    }

    async fn waiting(&self) -> Result<u64> {
        let info = self.0.consumer_info("ORDERS", "workers").await?;
        Ok(info.context("consumer workers exists")?.num_pending)
    }
}

/// Queue `orders` of an ElasticMQ server of its own; KEDA connects with the
/// TriggerAuthentication the operator writes from the source's credential Secrets.
struct SqsZero {
    mq: ElasticMq,
    queue: String,
}

impl ZeroCase for SqsZero {
    fn source(&self) -> String {
        format!(
            "{{sqs: {{queueUrl: \"{}\", endpoint: \"{}\", region: us-east-1, waitTimeSeconds: 1, \
             accessKeyIdSecretRef: {{name: aws-id, key: id}}, \
             secretAccessKeySecretRef: {{name: aws-secret, key: secret}}}}}}",
            self.queue,
            self.mq.endpoint()
        )
    }

    fn autoscaling(&self) -> Option<String> {
        None
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.mq.send_bodies(&self.queue, bodies).await.map(drop)
    }

    async fn waiting(&self) -> Result<u64> {
        Ok(self.mq.count(&self.queue).await?.visible)
    }
}

/// Topic `orders` (one partition, read from the earliest offset) of a Kafka node of its own.
struct KafkaZero(KafkaServer);

impl ZeroCase for KafkaZero {
    fn source(&self) -> String {
        format!(
            "{{kafka: {{bootstrapServers: \"{}\", topics: [orders], startFrom: earliest, \
             sessionTimeoutSeconds: 6}}}}",
            self.0.bootstrap()
        )
    }

    fn autoscaling(&self) -> Option<String> {
        None
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.0.produce("orders", bodies).await
    }

    /// Kafka keeps no count of what a consumer fetched: what the worker holds and what waits
    /// are one lag, which KEDA counts whole.
    async fn waiting(&self) -> Result<u64> {
        Ok(0)
    }
}

/// Quorum queue `orders` of a RabbitMQ node with the management plugin; KEDA reads the queue's
/// ready and unacknowledged counts from the management API (TriggerAuthentication
/// `rabbitmq-management`, its `host` from a Secret).
struct AmqpZero(RabbitMq);

impl ZeroCase for AmqpZero {
    fn source(&self) -> String {
        "{amqp: {queue: orders, urlSecretRef: {name: rabbitmq, key: url}}}".into()
    }

    fn autoscaling(&self) -> Option<String> {
        Some("triggerAuthenticationRef: rabbitmq-management".into())
    }

    async fn produce(&self, bodies: Vec<Vec<u8>>) -> Result<()> {
        let messages = bodies.into_iter().enumerate().map(|(i, body)| {
            let id = format!("{}-{i}", String::from_utf8_lossy(&body));
            (body, BasicProperties::default().with_message_id(id.into()))
        });
        self.0.publish("orders", messages).await
    }

    async fn waiting(&self) -> Result<u64> {
        Ok(self
            .0
            .counted("orders", "messages_ready")
            .await?
            .unwrap_or(0))
    }
}

/// Scale to zero with KEDA's own operator on a Redis stream's lag and pending entries.
#[tokio::test]
async fn keda_scales_an_idle_redis_stream_worker_to_zero_wakes_it_on_backlog_and_keeps_it_while_it_holds_a_batch()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    let case = RedisZero::start(&env).await?;
    scales_to_zero_and_back(&env, &case).await
}

/// Scale to zero with KEDA's own operator on a NATS consumer's pending and unacknowledged
/// messages, read from nats-server's monitoring endpoint.
#[tokio::test]
async fn keda_scales_an_idle_nats_worker_to_zero_wakes_it_on_backlog_and_keeps_it_while_it_holds_a_batch()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    let server = NatsServer::start().await?;
    server
        .create_stream("ORDERS", &["orders.>".to_owned()])
        .await?;
    env.plane
        .put_secret(&env.namespace, "nats", "url", &server.url())
        .await?;
    scales_to_zero_and_back(&env, &NatsZero(server)).await
}

/// Scale to zero with KEDA's own operator on an SQS queue's visible and in-flight messages
/// (ElasticMQ as the endpoint).
#[tokio::test]
async fn keda_scales_an_idle_sqs_worker_to_zero_wakes_it_on_backlog_and_keeps_it_while_it_holds_a_batch()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    put_aws_secrets(&env).await?;
    let mq = ElasticMq::start()?;
    let queue = mq.create_queue("orders", &[]).await?;
    mq.create_queue("orders-dlq", &[]).await?;
    scales_to_zero_and_back(&env, &SqsZero { mq, queue }).await
}

/// Scale to zero with KEDA's own operator on a Kafka group's lag (offsets committed after the
/// store, so held records count).
#[tokio::test]
async fn keda_scales_an_idle_kafka_worker_to_zero_wakes_it_on_backlog_and_keeps_it_while_it_holds_a_batch()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    let server = KafkaServer::start()?;
    server.create_topic("orders", 1).await?;
    server.create_topic("orders.dlq", 1).await?;
    scales_to_zero_and_back(&env, &KafkaZero(server)).await
}

/// Scale to zero with KEDA's own operator on a RabbitMQ quorum queue's ready and unacknowledged
/// messages, read from the management API.
#[tokio::test]
async fn keda_scales_an_idle_rabbitmq_worker_to_zero_wakes_it_on_backlog_and_keeps_it_while_it_holds_a_batch()
-> Result<()> {
    let env = OperatorEnv::start().await?;
    env.plane.install_keda_crds().await?;
    let server = RabbitMq::start_managed()?;
    server
        .declare("orders", queue_arguments(QueueType::Quorum, &[]))
        .await?;
    let namespace = &env.namespace;
    env.plane
        .put_secret(namespace, "rabbitmq", "url", &server.url())
        .await?;
    let management = server.management_url().context("the management API")?;
    secret_trigger_authentication(&env, "rabbitmq-management", "host", &management).await?;
    scales_to_zero_and_back(&env, &AmqpZero(server)).await
}
