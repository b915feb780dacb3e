//! The `QueueAdapter` custom resource (`switchboard.dev/v1alpha1`).
//!
//! Pure data: the spec a user writes, its defaults, the CEL rules the API server enforces, the
//! status the operator reports, and a loader for the same manifest outside Kubernetes. The `///`
//! comments on spec fields are what `kubectl explain queueadapter.spec` shows.

mod autoscaling;
mod manifest;
pub mod source;
mod validate;

pub use autoscaling::Autoscaling;
pub use manifest::{ManifestError, UnknownField, load_manifest};
pub use source::amqp::{AmqpBinding, AmqpDeclare, AmqpQueueType, AmqpSource};
pub use source::gateway::{
    ConfigMapKeyRef, GatewayAuth, GatewaySource, GatewayTls, OAuth2ClientCredentials,
};
pub use source::kafka::{KafkaSasl, KafkaSource, KafkaTls, SaslMechanism};
pub use source::nats::{NatsDeliverPolicy, NatsSource};
pub use source::redis::{RedisMode, RedisSource, StartFrom};
pub use source::sqs::SqsSource;
pub use source::{
    BROKERS, Broker, BrokerSpec, FileSource, MissingSecret, MountedFile, SecretEnv, Source,
    Triggers, broker_list, exactly_one_broker,
};
pub use validate::{FieldError, InvalidSpec};

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "switchboard.dev";
pub const VERSION: &str = "v1alpha1";

/// Pulls messages from a broker and stores each one as a durable todo in PostgreSQL before
/// acknowledging it to the broker (store-then-ack).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "switchboard.dev",
    version = "v1alpha1",
    kind = "QueueAdapter",
    plural = "queueadapters",
    shortname = "qa",
    category = "switchboard",
    namespaced,
    doc = "A QueueAdapter runs a worker that pulls messages from a broker and stores each one as a durable todo in PostgreSQL before acknowledging it to the broker (store-then-ack).",
    validation = Rule::new("size(self.metadata.name) <= 63").message("metadata.name must be at most 63 characters: it names the worker's Deployment and labels"),
    validation = Rule::new("!has(self.spec.workload) || !has(self.spec.workload.autoscaling) || !has(self.spec.source.redis) || self.spec.source.redis.mode == 'stream'").message("spec.workload.autoscaling: Redis lists and pubsub cannot be autoscaled (KEDA cannot see what list consumers hold; every pubsub replica gets every message)"),
    validation = Rule::new("!has(self.spec.workload) || !has(self.spec.workload.autoscaling) || !has(self.spec.source.redis) || has(self.spec.workload.autoscaling.triggerAuthenticationRef)").message("spec.workload.autoscaling.triggerAuthenticationRef is required for Redis: KEDA takes the address and password as separate parameters"),
    validation = Rule::new("!has(self.spec.workload) || !has(self.spec.workload.autoscaling) || !has(self.spec.source.nats) || has(self.spec.workload.autoscaling.natsMonitoringEndpoint)").message("spec.workload.autoscaling.natsMonitoringEndpoint is required for NATS: KEDA reads the consumer from nats-server's monitoring endpoint"),
    validation = Rule::new("!has(self.spec.workload) || !has(self.spec.workload.autoscaling) || !has(self.spec.source.amqp) || has(self.spec.workload.autoscaling.triggerAuthenticationRef)").message("spec.workload.autoscaling.triggerAuthenticationRef is required for RabbitMQ: KEDA counts held messages through the management API, whose URL it takes as host"),
    validation = Rule::new("!has(self.spec.workload) || !has(self.spec.workload.autoscaling) || !has(self.spec.source.sqs) || (has(self.spec.source.sqs.queueUrl) && (has(self.spec.source.sqs.region) || self.spec.source.sqs.queueUrl.matches('^https://sqs[.][a-z0-9-]+[.]amazonaws[.]com/')))").message("spec.workload.autoscaling needs spec.source.sqs.queueUrl and a region (spec.source.sqs.region, or an AWS queue URL naming one): KEDA addresses the queue by URL and region"),
    validation = Rule::new("!has(self.spec.source.sqs) || !has(self.spec.delivery) || !has(self.spec.delivery.deadLetter) || !has(self.spec.delivery.deadLetter.retentionDays) || self.spec.delivery.deadLetter.retentionDays <= 14").message("spec.delivery.deadLetter.retentionDays: SQS keeps messages at most 14 days"),
    status = "QueueAdapterStatus",
    printcolumn = r#"{"name":"Source","type":"string","jsonPath":".status.source"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".status.mode"}"#,
    printcolumn = r#"{"name":"Queue","type":"string","jsonPath":".spec.target.queue"}"#,
    printcolumn = r#"{"name":"Enabled","type":"boolean","jsonPath":".spec.enabled"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Backlog","type":"integer","jsonPath":".status.observed.backlog"}"#,
    printcolumn = r#"{"name":"Oldest","type":"date","jsonPath":".status.observed.oldestSince"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct QueueAdapterSpec {
    /// Whether the adapter runs. `false` scales the worker to zero replicas and marks the adapter
    /// disabled in the database; messages stay in the broker until it is enabled again.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The broker to pull from: exactly one of [`BROKERS`]. The kind of source cannot be
    /// changed after creation: create a new QueueAdapter instead.
    #[schemars(description = source_description())]
    pub source: Source,
    /// Where the messages land.
    pub target: Target,
    /// How message bodies are turned into todo payloads.
    #[serde(default)]
    pub payload: Payload,
    /// Batching, redelivery and dead-letter settings.
    #[serde(default)]
    pub delivery: Delivery,
    /// The PostgreSQL database that holds the todos. Defaults to the operator's configured database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub database: Option<Database>,
    /// The worker Deployment's shape.
    #[serde(default)]
    pub workload: Workload,
}

/// A key in a Secret in the QueueAdapter's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Where messages land.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Target {
    /// The todo queue every message of this adapter is created in.
    #[schemars(length(min = 1, max = 200))]
    pub queue: String,
}

/// How message bodies become todo payloads.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Payload {
    /// `auto`: a body that parses as JSON is stored as that JSON, any other UTF-8 body as a JSON
    /// string. `json`: a body that is not valid JSON is dead-lettered.
    #[serde(default)]
    pub format: PayloadFormat,
    /// Bodies larger than this many bytes are dead-lettered.
    #[serde(default = "default_max_bytes")]
    #[schemars(range(min = 1, max = 268435456))]
    pub max_bytes: u32,
    /// The producer's envelope, whose own event id deduplicates a producer that publishes the
    /// same event twice (the broker gives each copy its own message id). `none`: the body is
    /// the payload and the broker's message id the key. `cloudevents`: every message is a
    /// CloudEvent, structured (the body is the event's JSON) or binary (attributes in `ce-*`,
    /// `ce_*` or `cloudEvents_*` headers, message attributes or stream fields); the key is its
    /// `source` and `id`, the payload its `data`, its attributes become `ce-*` headers. `sns`:
    /// every body is an SNS notification (an SQS queue subscribed to an SNS topic without raw
    /// message delivery); the key is its `MessageId`, the payload its `Message`, its message
    /// attributes become headers and its other fields `sns-*` headers. A message that does not
    /// fit the envelope is dead-lettered, naming what is missing.
    #[serde(default)]
    pub envelope: Envelope,
}

impl Default for Payload {
    fn default() -> Self {
        Self {
            format: PayloadFormat::default(),
            max_bytes: default_max_bytes(),
            envelope: Envelope::default(),
        }
    }
}

/// The producer's envelope around the payload.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Envelope {
    #[default]
    None,
    #[serde(rename = "cloudevents")]
    CloudEvents,
    Sns,
}

/// Payload parsing mode.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum PayloadFormat {
    #[default]
    Auto,
    Json,
}

/// Batching, redelivery and dead-letter settings.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Delivery {
    /// The most messages read in one call and stored in one database transaction.
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 10000))]
    pub batch_size: u32,
    /// A message delivered more often than this (its consumers kept dying before storing it) is
    /// dead-lettered instead of stored. In stream mode a message stored already (its ack was
    /// lost) is acknowledged instead.
    #[serde(default = "default_max_deliveries")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_deliveries: u32,
    /// Entries a consumer has held un-acknowledged for longer than this many seconds are taken
    /// over by a live consumer (mode `stream`). Also the heartbeat TTL of list consumers.
    #[serde(default = "default_claim_idle_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub claim_idle_seconds: u32,
    /// Where dead letters go.
    #[serde(default)]
    pub dead_letter: DeadLetter,
    /// The adapter's `Backlogged` condition turns True when its oldest unacknowledged message
    /// is older than this many seconds.
    #[serde(default = "default_alert_oldest_seconds")]
    #[schemars(range(min = 1, max = 604800))]
    pub alert_oldest_seconds: u32,
    /// Days a message's dedup marker is kept: a redelivery within this many days of the first
    /// delivery never creates a second todo; past it, it may. Must cover the broker's longest
    /// redelivery (SQS keeps a message at most 14 days; Kafka topics and JetStream streams as
    /// their retention says). Default: the operator's (Helm value `storage.dedupWindowDays`,
    /// 30). The events table is shared: the longest window of all adapters is kept.
    #[serde(
        default,
        rename = "dedupWindowDays",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1, max = 3650))]
    pub dedup_window_days: Option<u32>,
}

impl Default for Delivery {
    fn default() -> Self {
        Self {
            batch_size: default_batch_size(),
            max_deliveries: default_max_deliveries(),
            claim_idle_seconds: default_claim_idle_seconds(),
            dead_letter: DeadLetter::default(),
            alert_oldest_seconds: default_alert_oldest_seconds(),
            dedup_window_days: None,
        }
    }
}

/// Dead-letter destinations. Each dead letter carries the original body byte-for-byte plus
/// its origin, delivery count, last error and first/last seen times.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct DeadLetter {
    /// The stream dead letters are added to (mode `stream`). Default: `<stream>.dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub stream: Option<String>,
    /// The list dead letters are pushed to (mode `list`). Default: `<list>.dlq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub list: Option<String>,
    /// The SQS queue dead letters are sent to (source `sqs`). Default: the source queue's URL
    /// with `-dlq` appended to its name (`-dlq.fifo` for a FIFO queue). It must exist.
    #[serde(default, rename = "queueUrl", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub queue_url: Option<String>,
    /// The subject dead letters are published to (source `nats`). Default:
    /// `<stream>.dlq.<subject of the message>`. The worker creates a stream for it if none
    /// holds it (`<stream>_DLQ`, messages kept 14 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub subject: Option<String>,
    /// The exchange dead letters are published to (source `amqp`), with publisher confirms.
    /// Default: the durable queue `<queue>.dlq`, which the worker declares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub exchange: Option<String>,
    /// The routing key of dead letters published to `exchange` (source `amqp`). Default: the
    /// source queue's name.
    #[serde(
        default,
        rename = "routingKey",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(max = 255))]
    pub routing_key: Option<String>,
    /// The Kafka topic dead letters are produced to (source `kafka`), with `acks=all`: the
    /// record's key, value and headers byte-identical, plus `x-dlq-*` headers. Default:
    /// `<topic>.dlq` of each record's topic. It must exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 249))]
    pub topic: Option<String>,
    /// Days dead letters are kept before they are deleted (default 14). Enforced where the
    /// broker can: Redis streams are trimmed by age (MINID) and Redis lists from their oldest
    /// end; the NATS dead-letter stream keeps messages this long (MaxAge, raised on an
    /// existing stream that keeps them for less); an SQS dead-letter queue's
    /// MessageRetentionPeriod is raised to it (SQS allows at most 14 days); the RabbitMQ
    /// dead-letter queue the worker declares gets `x-message-ttl`; a Kafka dead-letter
    /// topic's `retention.ms` is raised to it. Where the worker cannot raise it, the worker
    /// exits naming this setting unless `acceptShorterRetention` is set.
    #[serde(
        default,
        rename = "retentionDays",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1, max = 3650))]
    pub retention_days: Option<u32>,
    /// Accept a dead-letter queue that keeps messages for less than `retentionDays` and that
    /// the worker may not change (a refused SetQueueAttributes, AlterConfigs or stream
    /// update, a RabbitMQ queue declared with a shorter `x-message-ttl`): the worker then
    /// warns instead of exiting. Default false.
    #[serde(
        default,
        rename = "acceptShorterRetention",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub accept_shorter_retention: bool,
}

/// Dead letters are kept this many days unless `deadLetter.retentionDays` says otherwise.
pub const DEFAULT_RETENTION_DAYS: u32 = 14;

impl DeadLetter {
    /// How long dead letters are kept.
    pub fn retention(&self) -> std::time::Duration {
        let days = self.retention_days.unwrap_or(DEFAULT_RETENTION_DAYS);
        std::time::Duration::from_secs(u64::from(days) * 86_400)
    }

    /// The fields that are set, by their path: each broker refuses the ones of the others.
    pub fn set_fields(&self) -> impl Iterator<Item = &'static str> {
        [
            ("spec.delivery.deadLetter.stream", self.stream.is_some()),
            ("spec.delivery.deadLetter.list", self.list.is_some()),
            (
                "spec.delivery.deadLetter.queueUrl",
                self.queue_url.is_some(),
            ),
            ("spec.delivery.deadLetter.subject", self.subject.is_some()),
            ("spec.delivery.deadLetter.exchange", self.exchange.is_some()),
            (
                "spec.delivery.deadLetter.routingKey",
                self.routing_key.is_some(),
            ),
            ("spec.delivery.deadLetter.topic", self.topic.is_some()),
        ]
        .into_iter()
        .filter_map(|(field, set)| set.then_some(field))
    }
}

/// Where the worker finds the database CA (`sslrootcert`): libpq's and sqlx's variable.
pub const DATABASE_CA_ENV: &str = "PGSSLROOTCERT";

/// The database holding the todos.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("!(has(self.caConfigMapRef) && has(self.caSecretRef))").message("spec.database: at most one of caConfigMapRef and caSecretRef may be set")
)]
#[serde(rename_all = "camelCase")]
pub struct Database {
    /// The Secret key holding the PostgreSQL URL, passed to the worker as `DATABASE_URL`. Use
    /// `sslmode=verify-full` for TLS with certificate verification.
    pub url_secret_ref: SecretKeyRef,
    /// The ConfigMap key holding the CA certificates (PEM) the database's certificate must
    /// chain to, mounted read-only in the worker pod (`PGSSLROOTCERT` is its path). Default:
    /// the operator's (Helm value `database.ca`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_config_map_ref: Option<ConfigMapKeyRef>,
    /// The Secret key holding those CA certificates (CloudNativePG's `<cluster>-ca`, key
    /// `ca.crt`), mounted read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

impl Database {
    /// This database's own CA, if it names one.
    pub fn ca(&self) -> Option<FileSource<'_>> {
        FileSource::ca(self.ca_config_map_ref.as_ref(), self.ca_secret_ref.as_ref())
    }
}

/// The worker Deployment's shape.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Workload {
    /// Worker pods. Several consumers share a stream's consumer group or a list.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 100))]
    pub replicas: i32,
    /// CPU and memory requests and limits of the worker container. Default: the operator's
    /// (Helm value `worker.resources`: requests and a memory limit, so a worker is not
    /// BestEffort); resources here replace them as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The worker image. Default: the operator's configured worker image. Another image runs
    /// only when the operator allows it (its allowed-worker-images setting); otherwise the
    /// adapter reports ImageNotAllowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Scale the worker with KEDA on the broker's backlog instead of a fixed `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// Secrets (in the adapter's namespace) for pulling the worker image from a private
    /// registry. Default: the operator's (Helm value `worker.imagePullSecrets`, else the chart's
    /// `imagePullSecrets`); a list here, even an empty one, replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Option<Vec<LocalObjectReference>>,
    /// The ServiceAccount the worker pods run as, e.g. one annotated for IRSA or workload
    /// identity. Its Kubernetes API token is never mounted (the worker does not call the API).
    /// Default: the operator's (Helm value `worker.serviceAccountName`), else the namespace's
    /// `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub service_account_name: Option<String>,
    /// Node labels a worker pod's node must have. Default: the operator's (Helm value
    /// `worker.nodeSelector`); a map here, even an empty one, replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Taints the worker pods tolerate. Default: the operator's (Helm value
    /// `worker.tolerations`); a list here, even an empty one, replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub tolerations: Option<Vec<Toleration>>,
    /// Node and pod (anti-)affinity of the worker pods. Default: the operator's (Helm value
    /// `worker.affinity`); an affinity here replaces it as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// How the worker pods spread over zones or nodes; select them with the label
    /// `app.kubernetes.io/instance: <adapter name>`. Default: the operator's (Helm value
    /// `worker.topologySpreadConstraints`); a list here, even an empty one, replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 8))]
    pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
    /// The PriorityClass of the worker pods. Default: the operator's (Helm value
    /// `worker.priorityClassName`), else none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// Extra annotations of the worker pods. The operator's own
    /// (`switchboard.dev/config-hash`) always wins.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_annotations: BTreeMap<String, String>,
    /// Extra labels of the worker pods. The operator's own labels (`app.kubernetes.io/name`,
    /// `instance`, `component`, `part-of`, `managed-by`, which select the pods) always win: the
    /// same keys here are ignored.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pod_labels: BTreeMap<String, String>,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            replicas: default_replicas(),
            resources: None,
            image: None,
            autoscaling: None,
            image_pull_secrets: None,
            service_account_name: None,
            node_selector: None,
            tolerations: None,
            affinity: None,
            topology_spread_constraints: None,
            priority_class_name: None,
            pod_annotations: BTreeMap::new(),
            pod_labels: BTreeMap::new(),
        }
    }
}

/// `kubectl explain`'s line for `spec.source`, listing the brokers of the registry.
fn source_description() -> String {
    format!(
        "The broker to pull from. Exactly one broker key must be set ({}). The kind of source cannot be changed after creation: create a new QueueAdapter instead.",
        broker_list("`")
    )
}

/// What the operator last observed.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct QueueAdapterStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Reconciled` and `Degraded`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Worker pods that are ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// `at-least-once` (Redis stream and list, SQS, NATS) or `at-most-once` (Redis pubsub).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery_guarantee: Option<String>,
    /// The broker kind: one of [`BROKERS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(description = format!("The broker kind: {}.", broker_list("`")))]
    pub source: Option<String>,
    /// The broker-specific mode: `stream`, `list`, `pubsub` (Redis), `standard` or `fifo` (SQS), `jetstream` (NATS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// What the running workers last reported about the queue (they report every few
    /// seconds; a worker that stopped reporting is left out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservedQueue>,
}

/// The queue as the workers see it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObservedQueue {
    /// Workers whose report is current.
    pub workers: u32,
    /// Messages not yet delivered to any worker (absent when the broker does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<u64>,
    /// Messages delivered and not yet acknowledged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<u64>,
    /// When the oldest unacknowledged message arrived (absent when none is pending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_since: Option<Time>,
    /// Messages in the dead-letter destination, waiting to be inspected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letters: Option<u64>,
}

/// The delivery guarantee a source mode gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryGuarantee {
    AtLeastOnce,
    AtMostOnce,
}

impl DeliveryGuarantee {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryGuarantee::AtLeastOnce => "at-least-once",
            DeliveryGuarantee::AtMostOnce => "at-most-once",
        }
    }
}

impl QueueAdapter {
    /// `namespace/name`: unique across a cluster, used in keys, the `adapters` row and metrics.
    pub fn adapter_name(&self) -> String {
        let namespace = self.metadata.namespace.as_deref().unwrap_or("default");
        let name = self.metadata.name.as_deref().unwrap_or_default();
        format!("{namespace}/{name}")
    }
}

fn default_true() -> bool {
    true
}
fn default_max_bytes() -> u32 {
    1024 * 1024
}
fn default_batch_size() -> u32 {
    100
}
fn default_max_deliveries() -> u32 {
    5
}
fn default_claim_idle_seconds() -> u32 {
    60
}
fn default_alert_oldest_seconds() -> u32 {
    300
}
fn default_replicas() -> i32 {
    1
}
