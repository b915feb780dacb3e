//! librdkafka clients: their configuration from the spec and the Secret-fed environment (the
//! consumer, the probe, the dead-letter producer), the one mapping of librdkafka errors to what
//! the worker does, and the consumer's callbacks (rebalances, commits, logs).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::{Offset, TopicPartitionList};
use switchboard_api::{KafkaSource, StartFrom};
use switchboard_telemetry::ErrorChain;

use super::offsets::{Offsets, TopicPartition};
use crate::metrics::adapter_counter;
use crate::transport::TransportError;

/// The environment variables the operator fills from the spec's Secret references.
pub const SASL_USERNAME_ENV: &str = "KAFKA_SASL_USERNAME";
pub const SASL_PASSWORD_ENV: &str = "KAFKA_SASL_PASSWORD";
pub const TLS_CA_ENV: &str = "KAFKA_TLS_CA_PEM";
/// How far librdkafka fetches ahead of the pipeline: records per partition
/// (`queued.min.messages`), KiB in all (`queued.max.messages.kbytes`) and bytes per partition
/// and fetch (`max.partition.fetch.bytes`, 1 MiB by default; a larger record still comes, alone).
/// A fetched record keeps its whole fetch response alive in librdkafka's threads' heaps: at
/// 10,000 / 8 MiB / 1 MiB the worker's peak RSS was 75 MiB in `make bench`, at these 64, with
/// the same msg/s (docs/PERFORMANCE.md).
const PREFETCH_RECORDS: u32 = 2_000;
const PREFETCH_KIB: u32 = 2 * 1024;
const FETCH_PARTITION_BYTES: u32 = 256 * 1024;

/// What every client of the adapter shares: brokers, TLS, SASL.
pub fn base_config(spec: &KafkaSource, client_id: &str) -> Result<ClientConfig, TransportError> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &spec.bootstrap_servers)
        .set("client.id", client_id)
        .set("socket.keepalive.enable", "true")
        .set_log_level(RDKafkaLogLevel::Warning);
    let protocol = match (spec.tls.is_some(), spec.sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    config.set("security.protocol", protocol);
    if let Some(tls) = &spec.tls {
        // librdkafka verifies the certificate and the host name by default; said explicitly.
        config
            .set("enable.ssl.certificate.verification", "true")
            .set("ssl.endpoint.identification.algorithm", "https");
        if tls.ca_secret_ref.is_some() {
            config.set("ssl.ca.pem", secret_env(TLS_CA_ENV)?);
        }
    }
    if let Some(sasl) = &spec.sasl {
        config
            .set("sasl.mechanism", sasl.mechanism.as_str())
            .set("sasl.username", secret_env(SASL_USERNAME_ENV)?)
            .set("sasl.password", secret_env(SASL_PASSWORD_ENV)?);
    }
    Ok(config)
}

/// The group member's consumer: cooperative-sticky assignment, no auto-commit, a bounded
/// prefetch.
pub fn consumer_config(
    spec: &KafkaSource,
    client_id: &str,
    group: &str,
) -> Result<ClientConfig, TransportError> {
    let session_ms = u64::from(spec.session_timeout_seconds) * 1000;
    let start_from = match spec.start_from {
        StartFrom::Earliest => "earliest",
        StartFrom::Latest => "latest",
    };
    let mut config = base_config(spec, client_id)?;
    config
        .set("group.id", group)
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", start_from)
        .set("session.timeout.ms", session_ms.to_string())
        .set(
            "heartbeat.interval.ms",
            (session_ms / 3).min(3000).to_string(),
        )
        .set("enable.partition.eof", "false")
        // librdkafka prefetches up to 100,000 records or 64 MiB by default; a fraction of
        // a second of what one worker stores is plenty, and keeps the pod within its memory
        // limit.
        .set("queued.min.messages", PREFETCH_RECORDS.to_string())
        .set("queued.max.messages.kbytes", PREFETCH_KIB.to_string())
        .set(
            "max.partition.fetch.bytes",
            FETCH_PARTITION_BYTES.to_string(),
        )
        // A partition whose prefetch is full is fetched again after this (default 1 s,
        // which starves a worker that drains its prefetch in a fraction of that).
        .set("fetch.queue.backoff.ms", "10");
    Ok(config)
}

/// The probe's client: reads the group's committed offsets and describes the topics read (on
/// connections of its own, never behind a fetch), never joins the group, never commits.
pub fn probe_config(
    spec: &KafkaSource,
    client_id: &str,
    group: &str,
) -> Result<ClientConfig, TransportError> {
    let mut config = base_config(spec, &format!("{client_id}-probe"))?;
    config
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    Ok(config)
}

/// The dead-letter producer: every letter acknowledged by all in-sync replicas, idempotent,
/// given up after `timeout`.
pub fn producer_config(
    spec: &KafkaSource,
    client_id: &str,
    timeout: Duration,
) -> Result<ClientConfig, TransportError> {
    let mut config = base_config(spec, client_id)?;
    config
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", timeout.as_millis().to_string());
    Ok(config)
}

fn secret_env(name: &'static str) -> Result<String, TransportError> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.is_empty())
        .ok_or_else(|| {
            TransportError::fatal(
                name,
                "is not set (the operator sets it from the spec's Secret reference)",
                None,
            )
        })
}

/// Which setting an error is about, for the ones retrying cannot fix.
#[derive(Debug, Clone, Copy)]
pub enum Setting {
    Topics,
    DeadLetterTopic,
}

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Topics => "spec.source.kafka.topics",
            Setting::DeadLetterTopic => "spec.delivery.deadLetter.topic",
        }
    }
}

/// The one mapping of librdkafka errors: refused credentials, denied access and invalid
/// configuration are fatal and name the setting; everything else (brokers down, timeouts,
/// leadership moving) is transient.
pub fn classify(err: KafkaError, context: &str, about: Setting) -> TransportError {
    use RDKafkaErrorCode as Code;
    let code = err.rdkafka_error_code();
    let fatal = |setting: &str, what: &str| {
        TransportError::fatal(
            setting,
            format!("{context}: {what}"),
            Some(Box::new(err.clone())),
        )
    };
    match (&err, code) {
        (_, Some(Code::Authentication | Code::SaslAuthenticationFailed)) => fatal(
            SASL_PASSWORD_ENV,
            "the brokers refused the credentials (check the SASL mechanism, user name and password)",
        ),
        (_, Some(Code::SSL)) => fatal(
            "spec.source.kafka.tls",
            "the TLS handshake failed (check the brokers' certificate and the CA)",
        ),
        (_, Some(Code::TopicAuthorizationFailed)) => {
            fatal(about.name(), "access to the topic is denied")
        }
        (_, Some(Code::GroupAuthorizationFailed)) => fatal(
            "spec.source.kafka.groupId",
            "access to the consumer group is denied",
        ),
        (_, Some(Code::InvalidGroupId)) => {
            fatal("spec.source.kafka.groupId", "the group id is invalid")
        }
        (
            KafkaError::MessageProduction(_),
            Some(Code::UnknownTopic | Code::UnknownTopicOrPartition),
        ) => fatal(about.name(), "the dead-letter topic does not exist"),
        (KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_), _) => {
            fatal("spec.source.kafka", "librdkafka refused the configuration")
        }
        (KafkaError::MessageConsumptionFatal(_), _) => {
            fatal("spec.source.kafka", "librdkafka reported a fatal error")
        }
        _ => TransportError::transient(context.to_owned(), err),
    }
}

/// What the consumer's callbacks update.
#[derive(Debug)]
pub struct ConsumerState {
    pub offsets: Mutex<Offsets>,
    pub rebalances: Counter,
    pub abandoned: Counter,
    pub commit_failures: Counter,
    pub fetch_restarts: Counter,
}

impl ConsumerState {
    /// The state of a new consumer, its counters registered in `registry`.
    pub fn register(registry: &mut Registry, adapter: &str) -> Self {
        Self {
            offsets: Mutex::new(Offsets::default()),
            rebalances: adapter_counter(
                registry,
                "kafka_rebalances",
                "Partition assignments and revocations this worker took part in",
                adapter,
            ),
            abandoned: adapter_counter(
                registry,
                "kafka_abandoned_records",
                "Records of revoked partitions still being stored at the revocation (redelivered to the new owner and deduplicated)",
                adapter,
            ),
            commit_failures: adapter_counter(
                registry,
                "kafka_commit_failures",
                "Offset commits the brokers refused or did not answer (sent again)",
                adapter,
            ),
            fetch_restarts: adapter_counter(
                registry,
                "kafka_fetch_restarts",
                "Fetches restarted of partitions that held a backlog and delivered nothing",
                adapter,
            ),
        }
    }

    pub fn offsets(&self) -> std::sync::MutexGuard<'_, Offsets> {
        self.offsets.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The consumer's callbacks, run by librdkafka inside the consumer's poll.
#[derive(Debug, Clone)]
pub struct KafkaContext {
    pub state: Arc<ConsumerState>,
    /// The span the consumer was made in (the adapter's): librdkafka calls back on its own
    /// threads, and their lines name the adapter too.
    pub span: tracing::Span,
}

fn partitions(list: &TopicPartitionList) -> Vec<TopicPartition> {
    list.elements()
        .iter()
        .map(|element| TopicPartition {
            topic: Arc::from(element.topic()),
            partition: element.partition(),
        })
        .collect()
}

/// The context of the worker's other Kafka clients (the dead-letter producer, the probe): only
/// their log lines, in the span they were made in.
pub struct LogContext {
    pub span: tracing::Span,
}

impl LogContext {
    /// A context in the current span.
    pub fn current() -> Self {
        Self {
            span: tracing::Span::current(),
        }
    }
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        log(&self.span, level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        log_error(&self.span, &error, reason);
    }
}

impl ConsumerContext for LogContext {}

impl ClientContext for KafkaContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        log(&self.span, level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        log_error(&self.span, &error, reason);
    }
}

/// A librdkafka line (it logs on its own threads) in `span`. Broker outages are reported by the
/// pipeline, once per outage; librdkafka's own lines (one per connection attempt, a coordinator
/// still loading) are for debugging.
fn log(span: &tracing::Span, level: RDKafkaLogLevel, facility: &str, message: &str) {
    let _span = span.enter();
    match level {
        RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
            tracing::warn!(facility, message, "librdkafka")
        }
        _ => tracing::debug!(facility, message, "librdkafka"),
    }
}

fn log_error(span: &tracing::Span, error: &KafkaError, reason: &str) {
    let _span = span.enter();
    tracing::debug!(error = %error, reason, "librdkafka error");
}

impl ConsumerContext for KafkaContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let _span = self.span.enter();
        self.state.rebalances.inc();
        match rebalance {
            Rebalance::Assign(list) => {
                let mut offsets = self.state.offsets();
                for partition in partitions(list) {
                    offsets.assign(partition);
                }
                tracing::info!(partitions = ?names(list), "partitions assigned");
            }
            Rebalance::Revoke(list) => {
                // A lost assignment (the session expired) may already belong to another
                // worker: nothing is committed for it.
                let lost = consumer.assignment_lost();
                let mut commit = TopicPartitionList::new();
                let mut abandoned = 0;
                {
                    let mut offsets = self.state.offsets();
                    for partition in partitions(list) {
                        let (up_to, unsettled) = offsets.revoke(&partition);
                        abandoned += unsettled;
                        if let (Some(up_to), false) = (up_to, lost) {
                            let _ = commit.add_partition_offset(
                                &partition.topic,
                                partition.partition,
                                Offset::Offset(up_to),
                            );
                        }
                    }
                }
                self.state.abandoned.inc_by(abandoned as u64);
                if commit.count() > 0
                    && let Err(err) = consumer.commit(&commit, CommitMode::Sync)
                {
                    self.state.commit_failures.inc();
                    tracing::warn!(error = %ErrorChain(&err), "could not commit the settled offsets of revoked partitions; their records are redelivered and deduplicated");
                }
                tracing::info!(partitions = ?names(list), lost, abandoned, "partitions revoked");
            }
            Rebalance::Error(err) => {
                tracing::warn!(error = %ErrorChain(err), "rebalance failed")
            }
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        let _span = self.span.enter();
        if let Err(err) = result {
            self.state.commit_failures.inc();
            tracing::debug!(error = %ErrorChain(&err), "offset commit failed; it is sent again");
            let mut owned = self.state.offsets();
            for partition in partitions(offsets) {
                owned.recommit(&partition);
            }
        }
    }
}

fn names(list: &TopicPartitionList) -> Vec<String> {
    partitions(list).iter().map(TopicPartition::name).collect()
}
