//! The front half of the pipeline: one module per broker behind one trait.
//!
//! The trait is shaped for every broker the project plans: an opaque `receipt` carries what the
//! broker needs to acknowledge (a stream entry id, an SQS receipt handle, a NATS reply subject,
//! an AMQP delivery tag), `delivery_count` carries the broker's redelivery counter, and
//! `dead_letter` moves poison aside and acknowledges it in one step.

mod redis_conn;
pub mod redis_list;
pub mod redis_pubsub;
pub mod redis_stream;

use std::time::Duration;

use switchboard_store::Dedup;

use crate::health::Dependency;
use crate::payload::PoisonReason;

/// One message received from a broker and not yet acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// What the broker needs to acknowledge this delivery.
    pub receipt: String,
    /// The message's id, unique within the source: the native id, else a body hash.
    pub external_id: String,
    /// The todo idempotency key (`redis:{adapter}:{id}`).
    pub idempotency_key: String,
    /// The body, byte-for-byte.
    pub body: Vec<u8>,
    /// Other fields or headers of the message, byte-for-byte.
    pub headers: Vec<(String, Vec<u8>)>,
    /// How many times the broker has delivered this message, this delivery included.
    pub delivery_count: u64,
    /// When the broker accepted the message (Unix ms), if it says.
    pub enqueued_at_ms: Option<u64>,
    /// The native position (`ms`, `seq`) for the source checkpoint, if the broker has one.
    pub position: Option<(u64, u64)>,
}

/// A message to move to the dead-letter destination, with why.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    pub message: &'a Message,
    pub reason: PoisonReason,
    pub error: String,
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
}

/// A broker failure. All of them are treated as transient: back off and retry.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("redis command {command} failed")]
    Redis {
        command: &'static str,
        #[source]
        source: redis::RedisError,
    },
    #[error("redis reply to {command} was not understood: {detail}")]
    Protocol {
        command: &'static str,
        detail: String,
    },
    #[error("could not read the stored checkpoint")]
    Checkpoint(#[source] switchboard_store::StoreError),
}

impl TransportError {
    /// The dependency whose failure this is.
    pub fn dependency(&self) -> Dependency {
        match self {
            TransportError::Checkpoint(_) => Dependency::Database,
            TransportError::Redis { .. } | TransportError::Protocol { .. } => Dependency::Broker,
        }
    }
}

/// A broker connection that delivers batches and takes acknowledgements.
#[allow(async_fn_in_trait)]
pub trait Transport {
    /// The event source name (`redis:{adapter}`).
    fn source(&self) -> &str;

    /// How the store deduplicates this transport's messages.
    fn dedup(&self) -> Dedup;

    /// Connects and creates what the broker needs (consumer group, …). Idempotent.
    async fn prepare(&mut self) -> Result<(), TransportError>;

    /// Up to `max` messages. With `block`, waits a bounded time (about a second) when there are
    /// none; without, returns at once. Dropping the future is safe: undelivered entries stay
    /// with the broker.
    async fn receive(&mut self, max: usize, block: bool) -> Result<Vec<Message>, TransportError>;

    /// Acknowledges messages whose todos are committed.
    async fn ack(&mut self, messages: &[&Message]) -> Result<(), TransportError>;

    /// Writes dead letters with their context, then acknowledges the originals.
    async fn dead_letter(&mut self, letters: &[DeadLetter<'_>]) -> Result<(), TransportError>;

    /// Periodic upkeep: take over messages of dead consumers, tidy up, and report queue health.
    async fn maintain(&mut self) -> Result<QueueHealth, TransportError>;

    /// How often `maintain` should run.
    fn maintenance_interval(&self) -> Duration;

    /// After the loop stopped gracefully: hand back what was received and not acknowledged,
    /// where the broker needs that (a list's processing list). Best effort.
    async fn shutdown(&mut self) {}
}
