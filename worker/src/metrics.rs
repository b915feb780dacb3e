//! Every metric the worker exports, registered in one place. Labels are bounded: the adapter
//! name, a dead-letter reason, a dependency, a delivery guarantee — never message ids.

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::TypedMetric;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::exemplar::HistogramWithExemplars;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use std::sync::atomic::AtomicU64;
use switchboard_api::{DeliveryGuarantee, QueueAdapter};
use switchboard_telemetry::metrics::{create_series, register, register_aliased};

use crate::health::Dependency;
use crate::payload::PoisonReason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdapterLabels {
    adapter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    adapter: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DependencyLabels {
    adapter: String,
    dependency: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuaranteeLabels {
    adapter: String,
    guarantee: String,
}

/// What `switchboard_adapter_info` says of an adapter, in OpenTelemetry's messaging terms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InfoLabels {
    /// `namespace/name`, as on every other series.
    adapter: String,
    namespace: String,
    name: String,
    /// `messaging.system`: `redis`, `aws_sqs`, `nats`, `rabbitmq`, `kafka` (the gateway fronts
    /// an SQS queue: `aws_sqs`).
    system: &'static str,
    /// `messaging.destination.name`: the stream, list, channel, queue, or topics (comma-separated,
    /// or the pattern).
    destination: String,
    /// `messaging.consumer.group.name`: the Redis stream group, NATS durable consumer or Kafka
    /// group; empty where the broker has none.
    consumer_group: String,
}

impl InfoLabels {
    fn of(adapter: &QueueAdapter) -> Self {
        let name = adapter.adapter_name();
        let messaging = adapter.spec.source.broker().map(|b| b.messaging(&name));
        let (system, destination, consumer_group) = match messaging {
            Some(m) => (
                m.system,
                m.destination,
                m.consumer_group.unwrap_or_default(),
            ),
            None => ("", String::new(), String::new()),
        };
        Self {
            adapter: name,
            namespace: adapter.metadata.namespace.clone().unwrap_or_default(),
            name: adapter.metadata.name.clone().unwrap_or_default(),
            system,
            destination,
            consumer_group,
        }
    }
}

/// Registers `switchboard_adapter_info` (always 1) for `adapter` in `registry`: what it reads,
/// so that series can be joined on `adapter` and selected by system, destination or group.
pub fn register_adapter_info(registry: &mut Registry, adapter: &QueueAdapter) {
    let info: Family<InfoLabels, Gauge> = register(
        registry,
        "adapter_info",
        "What this adapter reads, in OpenTelemetry's messaging terms (value is always 1)",
        Family::default(),
    );
    info.get_or_create(&InfoLabels::of(adapter)).set(1);
}

/// The worker's metrics for one adapter.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    adapter: String,
    pub received: Counter,
    pub stored: Counter,
    pub duplicates: Counter,
    pub acked: Counter,
    pub redelivered: Counter,
    pub stale_receipts: Counter,
    pub leases_extended: Counter,
    /// Dead letters the broker's dead-letter destination refused for good, kept in
    /// PostgreSQL's `dead_letters` table instead (also counted by reason as dead-lettered).
    pub kept_in_database: Counter,
    /// Messages whose `traceparent` (or `AWSTraceHeader`) is not valid: stored without a
    /// trace context.
    pub malformed_trace_contexts: Counter,
    dead_lettered: Family<ReasonLabels, Counter>,
    errors: Family<DependencyLabels, Counter>,
    dependency_up: Family<DependencyLabels, Gauge>,
    pub batch_size: Histogram,
    /// With the trace of a batch that observed the bucket, when spans are exported.
    pub commit_seconds: LatencyHistogram,
    pub end_to_end_seconds: LatencyHistogram,
    pub backlog: Gauge,
    pub pending: Gauge,
    pub oldest_pending_age_seconds: Gauge<f64, AtomicU64>,
    pub dead_letters: Gauge,
    pub oldest_dead_letter_age_seconds: Gauge<f64, AtomicU64>,
    /// 1 while `/readyz` answers 200 (set on every scrape).
    pub ready: Gauge,
}

/// The registry's prefix: every series is `switchboard_…`.
const PREFIX: &str = "switchboard";

/// The series of `adapter` in `family`, registered under `name` and, when there is one, its old
/// name (see [`register_aliased`]).
fn adapter_series<M, C>(
    registry: &mut Registry,
    name: &str,
    alias: Option<&str>,
    help: &str,
    family: Family<AdapterLabels, M, C>,
    adapter: &str,
) -> M
where
    Family<AdapterLabels, M, C>: Metric + Clone,
    M: Clone,
    C: MetricConstructor<M>,
{
    let family = match alias {
        Some(alias) => register_aliased(registry, PREFIX, name, alias, help, family),
        None => register(registry, name, help, family),
    };
    family.get_or_create_owned(&AdapterLabels {
        adapter: adapter.to_owned(),
    })
}

/// A counter labelled with the adapter, registered in `registry` (transports register their own).
pub fn adapter_counter(registry: &mut Registry, name: &str, help: &str, adapter: &str) -> Counter {
    adapter_series(registry, name, None, help, Family::default(), adapter)
}

/// A gauge labelled with the adapter, registered in `registry` (transports register their own).
pub fn adapter_gauge<N, A>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    adapter: &str,
) -> Gauge<N, A>
where
    Gauge<N, A>: prometheus_client::encoding::EncodeMetric + Default + Clone + std::fmt::Debug,
    N: std::fmt::Debug + Send + Sync + 'static,
    A: std::fmt::Debug + Send + Sync + 'static,
{
    adapter_series(registry, name, None, help, Family::default(), adapter)
}

/// A metric labelled with the adapter (a counter or a gauge), registered under `name` and,
/// for one release, under its old name `alias` too: one series under both names, so dashboards
/// and alerts on the old name keep working.
pub fn adapter_aliased<M>(
    registry: &mut Registry,
    name: &str,
    alias: &str,
    help: &str,
    adapter: &str,
) -> M
where
    M: EncodeMetric + TypedMetric + Default + Clone + std::fmt::Debug + Send + Sync + 'static,
{
    let family = Family::default();
    adapter_series(registry, name, Some(alias), help, family, adapter)
}

/// The one name of a broker's reconnections, the same for every broker that reconnects:
/// connections (or subscriptions) re-established after they were lost, never the first one.
/// `alias`: the broker's old name of the same count, kept one release.
pub fn broker_reconnects(registry: &mut Registry, adapter: &str, alias: Option<&str>) -> Counter {
    adapter_series(
        registry,
        "broker_reconnects",
        alias,
        "Connections (or subscriptions) to the broker re-established after they were lost (the first connection is not counted)",
        Family::default(),
        adapter,
    )
}

fn adapter_histogram<M>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    adapter: &str,
    constructor: fn() -> M,
) -> M
where
    Family<AdapterLabels, M, fn() -> M>: Metric + Clone,
    M: Clone,
{
    let family = Family::<AdapterLabels, M, fn() -> M>::new_with_constructor(constructor);
    adapter_series(registry, name, None, help, family, adapter)
}

/// An exemplar's label: the trace of the batch whose value it is (OpenMetrics exposition only,
/// never a series label).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TraceExemplar {
    pub trace_id: String,
}

/// A latency histogram whose buckets keep an exemplar with a trace id.
pub type LatencyHistogram = HistogramWithExemplars<TraceExemplar>;

/// The adapter's message counters in the order of [`Metrics`]' fields: name and help.
const MESSAGE_COUNTERS: [(&str, &str); 9] = [
    ("messages_received", "Messages received from the broker"),
    ("messages_stored", "Messages stored as new todos"),
    (
        "messages_duplicate",
        "Redelivered messages whose event was already stored (no second todo)",
    ),
    (
        "messages_acked",
        "Messages acknowledged to the broker after commit",
    ),
    (
        "messages_redelivered",
        "Messages received with a delivery count above one",
    ),
    (
        "stale_receipts",
        "Acknowledgements the broker refused as no longer valid (the message is redelivered and deduplicated)",
    ),
    (
        "leases_extended",
        "Message leases (visibility timeouts) extended while their batch was still being stored",
    ),
    (
        "dead_letters_kept_in_database",
        "Dead letters the broker's dead-letter destination refused for good, kept in PostgreSQL's dead_letters table instead (`switchboard-worker dlq list` shows them)",
    ),
    (
        "trace_contexts_malformed",
        "Messages whose traceparent (or AWSTraceHeader) is not valid W3C trace context: stored without one",
    ),
];

/// Dead letters by reason, dependency errors and dependency health: labelled beyond the adapter.
#[allow(clippy::type_complexity)]
fn register_labelled_families(
    r: &mut Registry,
) -> (
    Family<ReasonLabels, Counter>,
    Family<DependencyLabels, Counter>,
    Family<DependencyLabels, Gauge>,
) {
    let dead_lettered = register(
        r,
        "messages_dead_lettered",
        "Messages dead-lettered, by reason",
        Family::default(),
    );
    let errors = register(
        r,
        "dependency_errors",
        "Failed calls to the broker or the database",
        Family::default(),
    );
    let dependency_up = register(
        r,
        "dependency_up",
        "1 while the dependency answers, 0 while it is down",
        Family::default(),
    );
    (dead_lettered, errors, dependency_up)
}

/// Batch size, commit duration and end-to-end latency.
fn register_histograms(
    r: &mut Registry,
    adapter: &str,
) -> (Histogram, LatencyHistogram, LatencyHistogram) {
    let batch_size = adapter_histogram(
        r,
        "batch_size",
        "Messages per received batch",
        adapter,
        || {
            Histogram::new([
                1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
                10000.0,
            ])
        },
    );
    let commit_seconds = adapter_histogram(
        r,
        "commit_duration_seconds",
        "Time to store one batch (one transaction)",
        adapter,
        || LatencyHistogram::new(exponential_buckets(0.0005, 2.0, 14)),
    );
    let end_to_end_seconds = adapter_histogram(
        r,
        "end_to_end_latency_seconds",
        "From the broker's enqueue time to the commit of its todo: the entry id's time for \
         Redis streams, SentTimestamp for SQS; Redis lists and pub/sub carry no enqueue time, \
         so there it is measured from the worker's first sight of the message (its first \
         delivery)",
        adapter,
        || LatencyHistogram::new(exponential_buckets(0.001, 2.0, 18)),
    );
    (batch_size, commit_seconds, end_to_end_seconds)
}

/// What the queue probe reads from the broker.
struct QueueGauges {
    backlog: Gauge,
    pending: Gauge,
    oldest_pending_age_seconds: Gauge<f64, AtomicU64>,
    dead_letters: Gauge,
    oldest_dead_letter_age_seconds: Gauge<f64, AtomicU64>,
}

impl QueueGauges {
    fn register(r: &mut Registry, adapter: &str) -> Self {
        Self {
            backlog: adapter_gauge(
                r,
                "backlog_messages",
                "Messages in the broker not yet delivered to the consumer group (group lag)",
                adapter,
            ),
            pending: adapter_gauge(
                r,
                "pending_messages",
                "Messages delivered to a consumer and not yet acknowledged",
                adapter,
            ),
            oldest_pending_age_seconds: adapter_gauge(
                r,
                "oldest_pending_age_seconds",
                "Age of the oldest unacknowledged message",
                adapter,
            ),
            dead_letters: adapter_gauge(
                r,
                "dead_letter_messages",
                "Messages in the dead-letter destination (read from the broker)",
                adapter,
            ),
            oldest_dead_letter_age_seconds: adapter_gauge(
                r,
                "oldest_dead_letter_age_seconds",
                "How long the oldest dead letter has waited to be redriven or purged (0 when there is none; \
                 exported where the broker tells: Redis streams and lists, NATS, Kafka, RabbitMQ)",
                adapter,
            ),
        }
    }
}

/// The adapter's delivery guarantee as an info gauge (always 1), under its old name too for one
/// release.
fn register_delivery_guarantee(r: &mut Registry, adapter: &str, guarantee: DeliveryGuarantee) {
    let info: Family<GuaranteeLabels, Gauge> = register_aliased(
        r,
        PREFIX,
        "delivery_guarantee_info",
        "delivery_guarantee",
        "The delivery guarantee of this adapter's source mode (value is always 1)",
        Family::default(),
    );
    info.get_or_create(&GuaranteeLabels {
        adapter: adapter.to_owned(),
        guarantee: guarantee.as_str().replace('-', "_"),
    })
    .set(1);
}

impl Metrics {
    /// A registry with the `switchboard` prefix, for the transport to register its own metrics in
    /// before [`Metrics::new`] adds the common ones.
    pub fn registry() -> Registry {
        Registry::with_prefix(PREFIX)
    }

    pub fn new(adapter: &str, guarantee: DeliveryGuarantee, mut registry: Registry) -> Self {
        let r = &mut registry;
        let [
            received,
            stored,
            duplicates,
            acked,
            redelivered,
            stale_receipts,
            leases_extended,
            kept_in_database,
            malformed_trace_contexts,
        ] = MESSAGE_COUNTERS.map(|(name, help)| adapter_counter(r, name, help, adapter));
        let (dead_lettered, errors, dependency_up) = register_labelled_families(r);
        let (batch_size, commit_seconds, end_to_end_seconds) = register_histograms(r, adapter);
        let queue = QueueGauges::register(r, adapter);
        let ready = adapter_gauge(
            r,
            "worker_ready",
            "1 while the worker is ready (its loop started, broker and database answer), else 0",
            adapter,
        );
        register_delivery_guarantee(r, adapter, guarantee);
        let metrics = Self {
            registry,
            adapter: adapter.to_owned(),
            received,
            stored,
            duplicates,
            acked,
            redelivered,
            stale_receipts,
            leases_extended,
            kept_in_database,
            malformed_trace_contexts,
            dead_lettered,
            errors,
            dependency_up,
            batch_size,
            commit_seconds,
            end_to_end_seconds,
            backlog: queue.backlog,
            pending: queue.pending,
            oldest_pending_age_seconds: queue.oldest_pending_age_seconds,
            dead_letters: queue.dead_letters,
            oldest_dead_letter_age_seconds: queue.oldest_dead_letter_age_seconds,
            ready,
        };
        metrics.create_labelled_series();
        metrics
    }

    /// Every reason's and every dependency's series, so that they are exported at zero (and
    /// every dependency up) before anything happens.
    fn create_labelled_series(&self) {
        create_series(
            &self.dead_lettered,
            PoisonReason::ALL.map(|reason| self.reason_labels(reason)),
        );
        create_series(
            &self.errors,
            Dependency::ALL.map(|dependency| self.dependency_labels(dependency)),
        );
        for dependency in Dependency::ALL {
            self.set_up(dependency, true);
        }
    }

    fn reason_labels(&self, reason: PoisonReason) -> ReasonLabels {
        ReasonLabels {
            adapter: self.adapter.clone(),
            reason: reason.as_str().to_owned(),
        }
    }

    fn dependency_labels(&self, dependency: Dependency) -> DependencyLabels {
        DependencyLabels {
            adapter: self.adapter.clone(),
            dependency: dependency.as_str().to_owned(),
        }
    }

    pub fn dead_lettered(&self, reason: PoisonReason) {
        self.dead_lettered
            .get_or_create(&self.reason_labels(reason))
            .inc();
    }

    pub fn dependency_error(&self, dependency: Dependency) {
        self.errors
            .get_or_create(&self.dependency_labels(dependency))
            .inc();
    }

    pub fn set_up(&self, dependency: Dependency, up: bool) {
        self.dependency_up
            .get_or_create(&self.dependency_labels(dependency))
            .set(i64::from(up));
    }

    /// The Prometheus text exposition (OpenMetrics).
    pub fn encode(&self) -> String {
        switchboard_telemetry::encode(&self.registry)
    }
}

/// Asserts that `registry` exports every one of `lines` (`name{labels} value`), for tests.
#[cfg(test)]
pub(crate) fn assert_exported(registry: &Registry, lines: &[&str]) {
    let text = switchboard_telemetry::encode(registry);
    for line in lines {
        assert!(text.lines().any(|l| l == *line), "{line} in\n{text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `switchboard_adapter_info` line of adapter `shop/orders` reading `source`.
    fn info_line(source: &str) -> String {
        let adapter = switchboard_api::load_manifest(&format!(
            "apiVersion: switchboard.dev/v1alpha1\nkind: QueueAdapter\n\
             metadata: {{name: orders, namespace: shop}}\n\
             spec:\n  source: {{{source}}}\n  target: {{queue: orders}}\n"
        ))
        .expect("a valid manifest");
        let mut registry = Metrics::registry();
        register_adapter_info(&mut registry, &adapter);
        let text = switchboard_telemetry::encode(&registry);
        text.lines()
            .find(|line| line.starts_with("switchboard_adapter_info{"))
            .unwrap_or_else(|| panic!("no adapter_info in {text}"))
            .to_owned()
    }

    #[test]
    fn adapter_info_names_system_destination_and_consumer_group_of_every_broker() {
        let labels = |system: &str, destination: &str, group: &str| {
            format!(
                r#"switchboard_adapter_info{{adapter="shop/orders",namespace="shop",name="orders",system="{system}",destination="{destination}",consumer_group="{group}"}} 1"#
            )
        };
        for (source, expected) in [
            (
                "redis: {mode: stream, stream: orders, group: workers}",
                labels("redis", "orders", "workers"),
            ),
            (
                "redis: {mode: list, list: jobs}",
                labels("redis", "jobs", ""),
            ),
            (
                "sqs: {queueUrl: 'http://localhost:9324/000000000000/orders.fifo'}",
                labels("aws_sqs", "orders.fifo", ""),
            ),
            (
                "nats: {stream: ORDERS, consumer: switchboard}",
                labels("nats", "ORDERS", "switchboard"),
            ),
            ("amqp: {queue: orders}", labels("rabbitmq", "orders", "")),
            (
                "kafka: {bootstrapServers: 'k:9092', topics: [a, b]}",
                labels("kafka", "a,b", "switchboard-shop-orders"),
            ),
        ] {
            assert_eq!(info_line(source), expected, "{source}");
        }
    }

    #[test]
    fn delivery_guarantee_info_keeps_its_old_name_for_one_release() {
        let metrics = Metrics::new("a/b", DeliveryGuarantee::AtLeastOnce, Metrics::registry());
        let text = metrics.encode();
        for line in [
            r#"switchboard_delivery_guarantee_info{adapter="a/b",guarantee="at_least_once"} 1"#,
            r#"switchboard_delivery_guarantee{adapter="a/b",guarantee="at_least_once"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(
            text.contains("deprecated name of switchboard_delivery_guarantee_info"),
            "{text}"
        );
    }

    #[test]
    fn an_aliased_counter_is_one_series_under_both_names() {
        let mut registry = Metrics::registry();
        let counter: Counter = adapter_aliased(
            &mut registry,
            "redis_messages_reaped",
            "messages_reaped",
            "Items moved back",
            "a/b",
        );
        counter.inc_by(3);
        assert_exported(
            &registry,
            &[
                r#"switchboard_redis_messages_reaped_total{adapter="a/b"} 3"#,
                r#"switchboard_messages_reaped_total{adapter="a/b"} 3"#,
            ],
        );
        let text = switchboard_telemetry::encode(&registry);
        assert!(text.contains("deprecated name of switchboard_redis_messages_reaped"));
    }

    #[test]
    fn nats_reconnects_is_the_deprecated_name_of_broker_reconnects() {
        let mut registry = Metrics::registry();
        broker_reconnects(&mut registry, "a/b", Some("nats_reconnects")).inc();
        assert_exported(
            &registry,
            &[
                r#"switchboard_broker_reconnects_total{adapter="a/b"} 1"#,
                r#"switchboard_nats_reconnects_total{adapter="a/b"} 1"#,
            ],
        );
    }
}
