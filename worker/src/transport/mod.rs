//! The front half of the pipeline: the transport contract every broker implements, and one
//! folder per broker behind it.
//!
//! - **Typed receipts**: each transport names its own [`Transport::Receipt`] (a stream entry id,
//!   an SQS receipt handle, …), carried by every [`Message`] it delivers.
//! - **Errors say what to do** ([`ErrorKind`]): transient (back off, readiness false), a stale
//!   receipt (the acknowledgement can never succeed: count it, drop it; the broker redelivers and
//!   the idempotency key deduplicates), fatal (misconfiguration: the worker exits non-zero with
//!   a line naming the setting). A message the transport cannot decode is delivered with
//!   [`Message::undecodable`] set: it is that message's poison, never an outage.
//! - **Settle order lives in the pipeline only**: it stores a batch, then has the transport
//!   *write* the batch's dead letters ([`Transport::write_dead_letters`], confirmed by the
//!   broker), then acknowledges everything settled once, in receive order ([`Transport::ack`]).
//!   A transport never acknowledges on its own.
//! - **Slow batches keep their lease**: a transport whose broker hides delivered messages for a
//!   while ([`Transport::lease`]) is asked to extend it ([`Transport::extend_lease`]) while a
//!   batch is still being stored past half of it.
//! - **Queue health is read on its own schedule** by a [`QueueProbe`] on its own task and
//!   connection, so the gauges keep moving while the database is down.

pub mod amqp;
pub mod dead_letter;
pub mod endpoint;
pub mod gateway;
pub mod identity;
pub mod kafka;
pub mod nats;
pub mod reader;
pub mod redis;
pub mod retention;
pub mod sqs;

use std::future::Future;
use std::time::Duration;

use switchboard_store::Dedup;
pub use switchboard_store::Position;

pub use self::retention::SourceRetention;

use crate::health::Dependency;
use crate::payload::PoisonReason;
pub(crate) use crate::text::truncate;

/// Batches stored concurrently: they keep PostgreSQL busy while the loop waits on the broker
/// (a NATS acknowledgement's confirmation, a fetch). Three left a quarter of the CPU idle
/// behind NATS and Kafka on 2 cores (docs/PERFORMANCE.md).
pub const IN_FLIGHT: usize = 4;

/// Batches received and not yet acknowledged: those being stored, and stored ones waiting for
/// an older batch's commit (acknowledgements go in receive order). A transport sizes what it
/// lets the broker hand out by it (AMQP's prefetch).
pub const HELD: usize = IN_FLIGHT + 2;

/// One message received from a broker and not yet acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<R> {
    /// What the broker needs to acknowledge (or extend) this delivery.
    pub receipt: R,
    /// The message's id, unique within the source: the native id, else a body hash.
    pub external_id: String,
    /// The todo idempotency key (`{kind}:{adapter}:{id}`).
    pub idempotency_key: String,
    /// The body, byte-for-byte.
    pub body: Vec<u8>,
    /// Other fields, attributes or headers of the message, byte-for-byte.
    pub headers: Vec<(String, Vec<u8>)>,
    /// How many times the broker has delivered this message, this delivery included.
    pub delivery_count: u64,
    /// When the broker accepted the message (Unix ms), if it says.
    pub enqueued_at_ms: Option<u64>,
    /// The message's native position, for the source's checkpoint, if the broker has one.
    pub position: Option<Position>,
    /// Why the transport could not decode this message, if it could not: the message is
    /// dead-lettered (with what could be read of it) instead of stored.
    pub undecodable: Option<String>,
}

/// A message to move to the dead-letter destination, with why and the attempts it went through.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a, R> {
    pub message: &'a Message<R>,
    pub reason: PoisonReason,
    pub error: String,
    pub attempts: Attempts,
}

/// The header (stream field, message attribute) in which a redriven message carries its
/// original idempotency key (`switchboard-worker dlq redrive`): on a broker with native ids the
/// copy put back has a new id, and the key makes it deduplicate against the original. The
/// worker honours it only when it names the worker's own source (`{kind}:{adapter}:…`).
pub const IDEMPOTENCY_KEY_HEADER: &str = "x-switchboard-idempotency-key";

/// How many attempts a dead letter carries: the most recent ones ([`Attempts::total`] counts
/// them all).
pub const MAX_ATTEMPTS: usize = switchboard_store::MAX_ATTEMPTS as usize;
/// The error text kept per attempt.
const MAX_ATTEMPT_ERROR_BYTES: usize = 512;

/// One delivery of a message the worker saw.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attempt {
    /// Which delivery this was (1 is the first), as the broker counted it.
    pub delivery: u64,
    /// When the worker received it (RFC 3339).
    pub at: String,
    pub consumer: String,
    /// `unsettled` (delivered, then neither stored nor dead-lettered: the worker stopped,
    /// crashed or lost the lease), or the dead-letter reason for the last attempt.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What an attempt recorded at receive time says until its message settles.
pub const UNSETTLED: &str = "unsettled";

impl Attempt {
    pub fn new(delivery: u64, consumer: &str, outcome: &str, error: Option<&str>) -> Self {
        Self {
            delivery,
            at: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            consumer: consumer.to_owned(),
            outcome: outcome.to_owned(),
            error: error.map(|error| truncate(error, MAX_ATTEMPT_ERROR_BYTES)),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The attempts a dead letter carries: the most recent [`MAX_ATTEMPTS`] the worker saw (a first
/// delivery that was never settled is counted but not recorded: recording every first delivery
/// would cost a write per message), and how many deliveries there were in all.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Attempts {
    pub total: u64,
    pub recent: Vec<Attempt>,
}

impl Attempts {
    /// The recorded attempts (a JSON array's text, as the store keeps them) followed by `last`,
    /// which replaces a recorded attempt of the same delivery.
    pub fn ending_with(recorded: Option<&str>, last: Attempt) -> Self {
        let mut recent: Vec<Attempt> = recorded
            .and_then(|text| serde_json::from_str::<Vec<Attempt>>(text).ok())
            .unwrap_or_default();
        recent.retain(|attempt| attempt.delivery < last.delivery);
        let total = last.delivery;
        recent.push(last);
        let skip = recent.len().saturating_sub(MAX_ATTEMPTS);
        recent.drain(..skip);
        Self { total, recent }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What a broker says about its queue, for the gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueHealth {
    /// Messages not yet delivered to any consumer.
    pub backlog: Option<u64>,
    /// Messages delivered and not yet acknowledged.
    pub pending: Option<u64>,
    /// Age of the oldest unacknowledged message.
    pub oldest_pending_age: Option<Duration>,
    /// Messages in the dead-letter destination.
    pub dead_letters: Option<u64>,
    /// How long the oldest dead letter has been there, where the broker tells.
    pub oldest_dead_letter_age: Option<Duration>,
}

/// What to do about a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// The dependency is unavailable: back off and retry; readiness is false meanwhile.
    Transient,
    /// The receipts of the call can never be acknowledged (the broker already gave the messages
    /// to someone else, or the channel they came on is gone): count them, drop them. The broker
    /// redelivers and the idempotency key deduplicates.
    StaleReceipt,
    /// Misconfiguration that retrying cannot fix (a missing queue, denied credentials, a wrong
    /// region): the worker exits non-zero. `setting` names what to fix.
    Fatal { setting: String },
    /// The dead-letter destination permanently refused these letters (indexes into the letters
    /// given to [`Transport::write_dead_letters`]; the others were written): too large for it,
    /// a publish it rejects however often it is retried. The pipeline keeps them in
    /// PostgreSQL's dead-letter table instead, so their originals can still be acknowledged.
    DeadLettersRefused { letters: Vec<usize> },
}

/// A failure of a broker (or of the database, while the transport reads its checkpoint).
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct TransportError {
    kind: ErrorKind,
    dependency: Dependency,
    context: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TransportError {
    fn new(
        kind: ErrorKind,
        dependency: Dependency,
        context: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            dependency,
            context: context.into(),
            source,
        }
    }

    /// The broker is unavailable; `context` says what was attempted.
    pub fn transient(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::new(
            ErrorKind::Transient,
            Dependency::Broker,
            context,
            Some(Box::new(source)),
        )
    }

    /// The broker answered something the transport does not understand (retried: a server in
    /// the middle of a restart, a proxy).
    pub fn protocol(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::Transient, Dependency::Broker, context, None)
    }

    /// The receipts of the call can never be acknowledged.
    pub fn stale(
        context: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::new(ErrorKind::StaleReceipt, Dependency::Broker, context, source)
    }

    /// Misconfiguration: `setting` names what to fix (`spec.source.sqs.queueUrl`,
    /// `AWS_ACCESS_KEY_ID`, …); `context` says what went wrong.
    pub fn fatal(
        setting: impl Into<String>,
        context: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        let setting = setting.into();
        let context = format!("{setting}: {}", context.into());
        Self::new(
            ErrorKind::Fatal { setting },
            Dependency::Broker,
            context,
            source,
        )
    }

    /// The dead-letter destination permanently refused `letters` (indexes into the letters
    /// given; the others were written); `context` says what the broker answered.
    pub fn dead_letters_refused(
        letters: Vec<usize>,
        context: impl Into<String>,
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::new(
            ErrorKind::DeadLettersRefused { letters },
            Dependency::Broker,
            context,
            source,
        )
    }

    /// The database failed while the transport read its checkpoint.
    pub fn checkpoint(source: switchboard_store::StoreError) -> Self {
        Self::database("could not read the stored checkpoint", source)
    }

    /// The database failed while the transport read or wrote its own state (a checkpoint,
    /// delivery counts); `context` says what was attempted.
    pub fn database(context: impl Into<String>, source: switchboard_store::StoreError) -> Self {
        let kind = if source.is_retryable() {
            ErrorKind::Transient
        } else {
            ErrorKind::Fatal {
                setting: "DATABASE_URL".to_owned(),
            }
        };
        Self::new(kind, Dependency::Database, context, Some(Box::new(source)))
    }

    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// The dependency whose failure this is.
    pub fn dependency(&self) -> Dependency {
        self.dependency
    }

    pub fn is_fatal(&self) -> bool {
        matches!(self.kind, ErrorKind::Fatal { .. })
    }
}

/// The outcome of one acknowledgement call, by index into the messages it was given.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Acked {
    /// Receipts the broker refused as no longer valid (see [`ErrorKind::StaleReceipt`]).
    pub stale: Vec<usize>,
    /// Receipts the broker failed to take this time; the pipeline retries them with backoff.
    pub retry: Vec<usize>,
}

impl Acked {
    /// Every receipt was taken.
    pub fn all() -> Self {
        Self::default()
    }
}

/// A Unix time in milliseconds as RFC 3339 (`2026-12-01T17:12:30.123Z`).
pub(crate) fn rfc3339_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Reads a queue's health on its own task and connection, on its own schedule.
pub trait QueueProbe: Send + 'static {
    fn queue_health(&mut self) -> impl Future<Output = Result<QueueHealth, TransportError>> + Send;
}

/// A broker connection that delivers batches, writes dead letters and takes acknowledgements.
#[allow(async_fn_in_trait)]
pub trait Transport {
    /// What the broker needs to acknowledge one delivery.
    type Receipt: std::fmt::Debug + Clone + Send + Sync + 'static;
    /// This transport's queue-health reader.
    type Probe: QueueProbe;

    /// The event source name (`{kind}:{adapter}`).
    fn source(&self) -> &str;

    /// Where the broker is, for the line that says it cannot be reached: `host:port` (several
    /// comma-separated), never credentials ([`endpoint::endpoints`]).
    fn endpoint(&self) -> String;

    /// What a message's external id is unique within, the first part of its idempotency key
    /// ([`identity::idempotency_key`]): the source, unless the broker's ids are unique only
    /// within something narrower.
    fn key_scope(&self) -> &str {
        self.source()
    }

    /// How the store deduplicates this transport's messages.
    fn dedup(&self) -> Dedup;

    /// Whether [`Message::enqueued_at_ms`] is a time the broker gave a message whose id it
    /// also gave, repeated by every delivery: the store then looks for an earlier delivery
    /// only among the events that arrived since (docs/storage.md). Not where a producer names
    /// the message (RabbitMQ's `message-id`): its retry repeats the id with another time.
    fn stable_enqueue_time(&self) -> bool {
        false
    }

    /// Connects and creates what the broker needs (consumer group, …). Idempotent. Fails
    /// fatally when the configuration cannot work (a queue that does not exist, …).
    async fn prepare(&mut self) -> Result<(), TransportError>;

    /// Up to `max` messages. With `block`, waits a bounded time (at most a few seconds) when
    /// there are none; without, returns at once. Dropping the future is safe: undelivered
    /// messages stay with the broker.
    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<Message<Self::Receipt>>, TransportError>;

    /// Writes dead letters with their context, waiting for the broker's confirmation. Does
    /// **not** acknowledge the originals: the pipeline does, once they are written.
    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Self::Receipt>],
    ) -> Result<(), TransportError>;

    /// Acknowledges settled messages (stored, duplicate or dead-lettered), given in receive
    /// order. An error applies to the whole call (retried if transient, dropped if stale).
    async fn ack(&mut self, messages: &[&Message<Self::Receipt>]) -> Result<Acked, TransportError>;

    /// How long the broker keeps a delivered message from others without an acknowledgement,
    /// where it has such a lease (SQS visibility timeout, NATS AckWait).
    fn lease(&self) -> Option<Duration> {
        None
    }

    /// Extends the lease of messages still being stored by another [`Transport::lease`].
    async fn extend_lease(
        &mut self,
        _messages: &[&Message<Self::Receipt>],
    ) -> Result<(), TransportError> {
        Ok(())
    }

    /// Whether the broker itself moves a message delivered too often to its own dead-letter
    /// queue (an SQS `RedrivePolicy`): the pipeline then leaves counting deliveries to it.
    /// Asked once, after [`Transport::prepare`].
    fn broker_dead_letters(&self) -> bool {
        false
    }

    /// How long the broker keeps the source's messages, where the worker read it. Asked once,
    /// after [`Transport::prepare`].
    fn source_retention(&self) -> SourceRetention {
        SourceRetention::Unknown
    }

    /// Periodic upkeep: take over messages of dead consumers, tidy up.
    async fn maintain(&mut self) -> Result<(), TransportError>;

    /// How often `maintain` runs, and the queue-health probe with it.
    fn maintenance_interval(&self) -> Duration;

    /// A queue-health reader with its own connection.
    fn probe(&self) -> Self::Probe;

    /// After the loop stopped gracefully: hand back what was received and not acknowledged,
    /// where the broker needs that (a list's processing list). Best effort.
    async fn shutdown(&mut self) {}
}
