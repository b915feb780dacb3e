//! Amazon SQS (standard and FIFO queues, or an SQS-compatible server such as ElasticMQ):
//! `ReceiveMessage` → (store) → `DeleteMessageBatch`.
//!
//! - **Client**: the default AWS credential chain (the `AWS_*` variables the operator sets from
//!   the Secret refs, else IRSA web identity, ECS/EC2 roles); region from `spec.region`, else
//!   `AWS_REGION`, else the queue URL's host, else the shared config file; `spec.endpoint`
//!   overrides the endpoint. Every call has connect, attempt and operation timeouts (a long
//!   poll gets its `waitTimeSeconds` plus a margin), so a hung server is a transient failure.
//! - **`prepare`** resolves a `queueName` (GetQueueUrl), reads the queue's visibility timeout,
//!   `RedrivePolicy` and `FifoQueue`, checks that the dead-letter queue exists (default: the
//!   queue's name with `-dlq`, before `.fifo`) and that credentials resolve. What cannot work
//!   (no queue, no credentials, refused credentials, no region) is fatal and names the setting;
//!   see `classify.rs` for the one mapping of error codes used by every call. A source queue
//!   that goes missing later (deleted, maybe created again: AWS asks for 60 s between the two)
//!   is waited for, readiness false, and fatal only once it has been missing for 120 s.
//! - **Receive**: long polls of at most ten messages; a larger batch is gathered from
//!   concurrent receives. All system and message attributes are read; the key is
//!   `sqs:{adapter}:{MessageId}`.
//! - **Acknowledge**: `DeleteMessageBatch` in calls of ten, reading each entry's result (a 200
//!   response can still fail entries): an invalid receipt handle is stale, anything else is
//!   retried. **Lease**: `ChangeMessageVisibilityBatch` to the visibility timeout.
//! - **Dead letters**: `SendMessageBatch` to the dead-letter queue, the body unchanged, the
//!   context as `x-dlq-*` message attributes. A queue with its own `RedrivePolicy` counts
//!   deliveries itself; poison still goes to the dead-letter queue at once.
//! - **Queue health**: `GetQueueAttributes` depth figures, and the age of the oldest message
//!   this worker holds (see [`SqsProbe`]).
//!
//! **FIFO queues** keep each `MessageGroupId`'s order:
//! - SQS hands out a group's messages only once its earlier ones are deleted or visible
//!   again, so two receives (concurrent ones included) never hold messages of the same group,
//!   and receives retried by the SDK carry a `ReceiveRequestAttemptId` (they return the same
//!   messages instead of locking the group until its visibility expires).
//! - Acknowledgement never deletes a group's later message before an earlier one: at most one
//!   message per group per call, calls in order; when an entry fails, the group's later
//!   messages of that acknowledgement are not sent and are reported with the same outcome
//!   (retried or stale) — see `delete_plan.rs`.
//! - At receive time, the only failure that concerns a single message is one that cannot be
//!   delivered to the pipeline at all: SQS sent it without a receipt handle, so it can be
//!   neither deleted nor dead-lettered and comes back only when its visibility expires. The
//!   group's later messages of that receive are then made visible again
//!   (`ChangeMessageVisibility` 0, best effort: if that fails they come back when their
//!   visibility expires) and dropped from the batch, so nothing of the group is stored before
//!   it. An undecodable message *with* a receipt, and any poison the pipeline finds, stays in
//!   its place in the batch: it is dead-lettered and acknowledged in receive order, which keeps
//!   the group's order without holding the group back. A whole receive that fails returns
//!   nothing; whatever SQS had handed out is redelivered in order.

pub(crate) mod classify;
mod client;
pub(crate) mod dead_letter;
mod dead_letter_writer;
mod delete;
pub(crate) mod delete_plan;
pub(crate) mod gather;
pub(crate) mod in_flight;
mod letter_queue;
mod metrics;
mod poll;
mod probe;
mod queues;
pub mod reader;
mod receive;
mod send;
mod visibility;

use std::time::{Duration, Instant};

use aws_config::timeout::TimeoutConfig;
use aws_sdk_sqs::Client;
use prometheus_client::registry::Registry;
use switchboard_api::QueueAdapter;
use switchboard_store::Dedup;

use self::in_flight::InFlight;
use self::metrics::SqsMetrics;
pub use self::probe::SqsProbe;
use self::queues::Queues;
pub use self::receive::Receipt;
use self::receive::SqsDelivery;
use crate::transport::retention::Retention;
use crate::transport::{Acked, DeadLetter, SourceRetention, Transport, TransportError};

/// The visibility timeout SQS gives a queue that does not say.
const DEFAULT_VISIBILITY_SECONDS: u32 = 30;
/// How often `maintain` (a no-op) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);

/// Everything the SQS transport needs to know.
#[derive(Debug, Clone)]
pub struct SqsSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    /// The pod name, recorded in dead letters.
    pub consumer: String,
    pub spec: switchboard_api::SqsSource,
    /// `spec.delivery.deadLetter.queueUrl`; default: the queue's URL with `-dlq`.
    pub dead_letter_queue_url: Option<String>,
    pub batch_size: usize,
    /// `spec.delivery.deadLetter.retentionDays` and `acceptShorterRetention`: a dead-letter
    /// queue keeping messages for less has its `MessageRetentionPeriod` raised.
    pub dead_letter_retention: Retention,
}

/// The SQS transport.
#[derive(Debug)]
pub struct Sqs {
    settings: SqsSettings,
    source: String,
    client: Client,
    config: aws_config::SdkConfig,
    errors: classify::Settings,
    receive_timeouts: TimeoutConfig,
    metrics: SqsMetrics,
    /// `None` until `prepare` succeeded.
    queues: Option<Queues>,
    /// Since when loading credentials has failed, while `prepare` keeps failing.
    credentials_failing_since: Option<Instant>,
    /// What this worker holds, for the probe's oldest-pending age.
    held: InFlight,
}

impl Sqs {
    /// Builds the client (no network yet). Fails fatally when the region cannot be found or
    /// the endpoint is not a URL.
    pub async fn new(
        settings: SqsSettings,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let spec = &settings.spec;
        let (region, origin) = client::resolve_region(spec).await?;
        let endpoint = spec.endpoint.as_deref().filter(|e| !e.is_empty());
        if let (Some(url), None) = (spec.queue_url.as_deref(), endpoint)
            && let Some(in_url) = client::region_from_queue_url(url)
            && in_url != region.as_ref()
        {
            return Err(TransportError::fatal(
                "spec.source.sqs.region",
                format!(
                    "the queue URL is in region {in_url} but the worker would call SQS in {region} (from {}); set spec.source.sqs.region to {in_url}",
                    origin.setting()
                ),
                None,
            ));
        }
        let config = client::load_config(spec, region.clone()).await?;
        let client = Client::new(&config);
        let (source_setting, source_queue) = match (&spec.queue_url, &spec.queue_name) {
            (Some(url), _) if !url.is_empty() => ("spec.source.sqs.queueUrl", url.clone()),
            (_, Some(name)) if !name.is_empty() => ("spec.source.sqs.queueName", name.clone()),
            _ => {
                return Err(TransportError::fatal(
                    "spec.source.sqs",
                    "exactly one of queueUrl and queueName must be set",
                    None,
                ));
            }
        };
        let dead_letter_queue = settings
            .dead_letter_queue_url
            .clone()
            .or_else(|| {
                spec.queue_url
                    .as_deref()
                    .map(client::default_dead_letter_url)
            })
            .unwrap_or_else(|| format!("{source_queue}-dlq"));
        let errors = classify::Settings {
            source_setting,
            source_queue,
            region: region.to_string(),
            dead_letter_queue,
            source_absence: classify::QueueAbsence::default(),
        };
        Ok(Self {
            source: format!("sqs:{}", settings.adapter),
            metrics: SqsMetrics::register(registry, &settings.adapter),
            receive_timeouts: client::receive_timeouts(spec.wait_time_seconds),
            settings,
            client,
            config,
            errors,
            queues: None,
            credentials_failing_since: None,
            held: InFlight::default(),
        })
    }

    /// The transport of `adapter` for a command (`dlq`, `send`) run as `consumer`: connected,
    /// its queues checked as the worker does.
    pub async fn for_command(
        adapter: &QueueAdapter,
        consumer: &str,
    ) -> Result<Self, TransportError> {
        let Some(spec) = adapter.spec.source.sqs.clone() else {
            return Err(TransportError::fatal(
                "spec.source.sqs",
                "not an SQS adapter",
                None,
            ));
        };
        let settings = SqsSettings {
            adapter: adapter.adapter_name(),
            consumer: consumer.to_owned(),
            spec,
            dead_letter_queue_url: adapter.spec.delivery.dead_letter.queue_url.clone(),
            batch_size: 10,
            // Reading letters must not fail on (nor change) the queue's retention.
            dead_letter_retention: Retention {
                accept_shorter: true,
                ..Retention::of(&adapter.spec.delivery.dead_letter)
            },
        };
        let mut sqs = Self::new(settings, &mut Registry::default()).await?;
        sqs.prepare().await?;
        Ok(sqs)
    }

    fn queues(&self) -> Result<&Queues, TransportError> {
        self.queues
            .as_ref()
            .ok_or_else(|| TransportError::protocol("SQS transport used before prepare"))
    }

    /// The visibility timeout receives ask for (`spec.visibilityTimeoutSeconds`, else the
    /// queue's).
    fn visibility_seconds(&self) -> u32 {
        self.settings
            .spec
            .visibility_timeout_seconds
            .or(self.queues.as_ref().map(|q| q.visibility_seconds))
            .unwrap_or(DEFAULT_VISIBILITY_SECONDS)
    }
}

impl Transport for Sqs {
    type Receipt = Receipt;
    type Probe = SqsProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        let spec = &self.settings.spec;
        match [&spec.endpoint, &spec.queue_url]
            .into_iter()
            .flatten()
            .find(|url| !url.is_empty())
        {
            Some(url) => crate::transport::endpoint::endpoints(url),
            None => format!(
                "sqs.{}.amazonaws.com",
                self.client
                    .config()
                    .region()
                    .map_or("?", |region| region.as_ref())
            ),
        }
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    fn stable_enqueue_time(&self) -> bool {
        true
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.discover_queues().await
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<SqsDelivery>, TransportError> {
        let queues = self.queues()?;
        let wait = if block {
            self.settings.spec.wait_time_seconds
        } else {
            0
        };
        let raw = gather::gather(max, block, wait, |count, wait| {
            self.receive_once(queues, count, wait)
        })
        .await?;
        Ok(self.deliver(queues, raw).await)
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        self.write_letters(letters).await
    }

    async fn ack(&mut self, messages: &[&SqsDelivery]) -> Result<Acked, TransportError> {
        self.delete(messages).await
    }

    /// The source queue's `MessageRetentionPeriod` (at most 14 days).
    fn source_retention(&self) -> SourceRetention {
        match self.queues.as_ref().and_then(|queues| queues.kept) {
            Some(kept) => SourceRetention::Bounded {
                kept,
                setting: "MessageRetentionPeriod of the source queue".to_owned(),
            },
            None => SourceRetention::Unknown,
        }
    }

    fn lease(&self) -> Option<Duration> {
        match self.visibility_seconds() {
            0 => None,
            seconds => Some(Duration::from_secs(u64::from(seconds))),
        }
    }

    async fn extend_lease(&mut self, messages: &[&SqsDelivery]) -> Result<(), TransportError> {
        self.extend_visibility(messages).await
    }

    fn broker_dead_letters(&self) -> bool {
        self.queues.as_ref().is_some_and(|q| q.redrive)
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        MAINTENANCE_INTERVAL
    }

    fn probe(&self) -> SqsProbe {
        self.new_probe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(spec: serde_json::Value) -> SqsSettings {
        SqsSettings {
            adapter: "shop/orders".into(),
            consumer: "worker-0".into(),
            spec: serde_json::from_value(spec).expect("spec"),
            dead_letter_queue_url: None,
            batch_size: 10,
            dead_letter_retention: Retention::of(&switchboard_api::DeadLetter::default()),
        }
    }

    fn fatal_setting(result: Result<Sqs, TransportError>) -> String {
        match result.map(drop).expect_err("fatal").kind() {
            crate::transport::ErrorKind::Fatal { setting } => setting.clone(),
            other => panic!("expected a fatal error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn queue_url_in_another_region_than_the_client_is_fatal() {
        let settings = settings(serde_json::json!({
            "queueUrl": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders",
            "region": "us-east-1",
        }));
        let result = Sqs::new(settings, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.region");
    }

    #[tokio::test]
    async fn malformed_region_and_endpoint_are_fatal() {
        let bad_region = settings(serde_json::json!({"queueName": "orders", "region": "EU West"}));
        let result = Sqs::new(bad_region, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.region");
        let bad_endpoint = settings(serde_json::json!({
            "queueName": "orders", "region": "eu-west-1", "endpoint": "elasticmq:9324",
        }));
        let result = Sqs::new(bad_endpoint, &mut Registry::default()).await;
        assert_eq!(fatal_setting(result), "spec.source.sqs.endpoint");
    }

    #[tokio::test]
    async fn client_builds_without_network_and_names_its_source() {
        let settings = settings(serde_json::json!({
            "queueUrl": "https://sqs.ap-south-1.amazonaws.com/123456789012/orders.fifo",
            "region": "ap-south-1",
        }));
        let sqs = Sqs::new(settings, &mut Registry::default())
            .await
            .expect("builds");
        assert_eq!(sqs.source(), "sqs:shop/orders");
        assert_eq!(sqs.dedup(), Dedup::NativeId);
        assert_eq!(
            sqs.lease(),
            Some(Duration::from_secs(30)),
            "the SQS default until prepared"
        );
        assert!(!sqs.broker_dead_letters());
        assert!(sqs.queues().is_err(), "calls before prepare are refused");
    }
}
