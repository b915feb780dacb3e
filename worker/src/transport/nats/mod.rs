//! NATS JetStream: a durable pull consumer, `fetch` → (store) → acknowledgement confirmed by
//! the server.
//!
//! - **Connection**: `NATS_URL` (one or more servers; `tls://` requires TLS, certificates
//!   verified) and at most one of `NATS_CREDENTIALS`, `NATS_NKEY`, `NATS_USER`/`NATS_PASSWORD`,
//!   `NATS_TOKEN`, from the Secret refs (see `connect.rs`). Refused credentials are fatal; the
//!   client reconnects by itself after the first connection.
//! - **`prepare`** reads the stream (missing: fatal), makes sure a stream holds the dead-letter
//!   subject (creating `<stream>_DLQ`, kept `deadLetter.retentionDays`, if none does; the source stream itself is
//!   refused) and binds the consumer: created if missing, refused if an existing one differs
//!   in a setting that matters (`consumer.rs`).
//! - **Receive**: one `fetch` of up to the batch size; when the loop may block it waits at most
//!   [`FETCH_EXPIRY`] for the first message (shutdown stays prompt), and every wait for the
//!   next message has a deadline ([`NEXT_DEADLINE`]: a connection cut after a pull request
//!   never wedges the worker). The delivery count is the server's `num_delivered`; the key is
//!   `nats:{adapter}:{stream}:{incarnation}:{stream_seq}`, the incarnation being the stream's
//!   creation time (Unix ns): a stream deleted and created again restarts its sequences at 1,
//!   and its messages are new ones, not redeliveries. Headers (`Nats-Msg-Id` included) and the
//!   subject become event headers; the stream sequence is the checkpoint position (partition:
//!   the incarnation).
//! - **Delivery limit**: the consumer has none (MaxDeliver -1; the limit older workers set is
//!   lifted in place): the worker counts deliveries and dead-letters past
//!   `delivery.maxDeliveries`, so the server never drops a message the worker has neither
//!   stored nor dead-lettered.
//! - **Re-binding**: after a reconnection or a failed fetch, the stream and the consumer are
//!   looked up again before the next fetch; a consumer that delivers nothing for
//!   2 × [`FETCH_EXPIRY`] while the server says messages are pending is re-bound as well
//!   (`nats_consumer_rebinds_total`). A stream with another creation time was re-created: said
//!   once, in a warning, and read from its first message. A lost consumer is re-created after
//!   the highest stream sequence stored (never at `deliverPolicy: new`, which would skip the
//!   backlog), or, with nothing stored yet, at the creation time of the `new` consumer it
//!   replaces.
//! - **Undecodable frames**: a header block the client cannot parse (a value or name that is
//!   not UTF-8, a line without `:`: a Go producer can publish any of these) or a subject that
//!   is not UTF-8 (the server does not check) never costs the connection: the workspace builds
//!   a patched `async-nats` that hands over the raw bytes (`vendor/async-nats/PATCH.md`;
//!   upstream drops the connection and every delivery after it). The worker reads such a
//!   block as bytes (`headers.rs`): values that are not UTF-8, and such a subject, are stored
//!   encoded; a block it cannot read either makes the message undecodable: dead-lettered, its
//!   body byte-identical and the block in base64 ([`RAW_HEADERS`]), then terminated.
//! - **Acknowledge**: `+ACK` (or `+TERM` for a message just dead-lettered), the last of a batch
//!   with a reply subject: the server processes one connection's acknowledgements of a consumer
//!   in order, so its confirmation of the last confirms the batch ("double ack" at one reply per
//!   batch); an unconfirmed batch is acknowledged again by the pipeline. **Lease**: AckWait;
//!   `+WPI` (in progress) extends it while a batch is stored.
//! - **Dead letters**: published to `deadLetter.subject` (default `<stream>.dlq.<subject>`),
//!   the body byte-identical, context in `Switchboard-*` headers; every PubAck is awaited
//!   (with a deadline) before the originals are terminated (`dead_letter.rs`). A letter the
//!   server can never take (over its max payload, over the dead-letter stream's max message
//!   size) is refused for good: the pipeline keeps it in PostgreSQL.
//! - **Shutdown**: messages received and not acknowledged are handed back with a delayed NAK
//!   ([`NAK_DELAY`]), never a bare NAK that would burn through MaxDeliver.
//! - **Queue health**: the consumer's `num_pending` (backlog) and `num_ack_pending` (pending),
//!   and the age of the first message above its ack floor, read on the probe's own connection.

mod ack;
mod bind;
mod connect;
mod consumer;
mod dead_letter;
mod headers;
mod probe;
pub mod reader;
mod receive;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use async_nats::datetime::DateTime;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, stream};
use async_nats::{Client, Subject};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use switchboard_store::{Dedup, Store};

use self::connect::ConnectionEvents;
pub use self::connect::{Auth, Connector};
pub use self::probe::NatsProbe;
pub use self::receive::Identity;
use crate::metrics::{adapter_counter, broker_reconnects};
use crate::transport::retention::Retention;
use crate::transport::{Acked, DeadLetter, Message, SourceRetention, Transport, TransportError};

/// A wait for the next message of a fetch: the fetch's expiry and a request's time.
pub const NEXT_DEADLINE: Duration = Duration::from_secs(6);
/// How long a publish (a dead letter, a batch of acknowledgements) may wait to be sent.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a blocking fetch waits for its first message.
pub const FETCH_EXPIRY: Duration = Duration::from_secs(1);
/// The redelivery delay of messages handed back at shutdown.
pub const NAK_DELAY: Duration = Duration::from_secs(1);
/// How often `maintain` (a no-op) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// The settings fatal errors name.
const DEAD_LETTER_SETTING: &str = "spec.delivery.deadLetter.subject";
const STREAM_SETTING: &str = "spec.source.nats.stream";
const CONSUMER_SETTING: &str = "spec.source.nats.consumer";

/// Everything the NATS transport needs to know.
#[derive(Debug, Clone)]
pub struct NatsSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    /// The pod name, recorded in dead letters and shown as the client name.
    pub consumer: String,
    pub spec: switchboard_api::NatsSource,
    pub connector: Connector,
    /// `spec.delivery.deadLetter.subject`; default `<stream>.dlq.<subject>`.
    pub dead_letter_subject: Option<String>,
    /// `spec.delivery.maxDeliveries`.
    pub max_deliveries: u64,
    /// `spec.delivery.deadLetter.retentionDays` and `acceptShorterRetention`: the MaxAge of
    /// the dead-letter stream.
    pub dead_letter_retention: Retention,
}

/// What the server needs to acknowledge one delivery, and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The delivery's `$JS.ACK…` reply subject.
    pub reply: Subject,
    pub stream_sequence: u64,
    /// The message's subject.
    pub subject: Subject,
}

pub type NatsDelivery = Message<Receipt>;

/// The NATS transport's own counters.
#[derive(Debug, Clone)]
struct NatsMetrics {
    rebinds: Counter,
}

/// The stream dead letters go to, and the subjects of this adapter's letters in it.
#[derive(Debug, Clone)]
pub struct DeadLetterStream {
    name: String,
    subjects: String,
}

/// Which incarnation of the stream the worker reads: the stream's creation time. A stream
/// deleted and created again has another one, and restarts its sequences at 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incarnation {
    created: DateTime,
    /// The creation time in Unix nanoseconds: in idempotency keys, dead-letter ids and the
    /// checkpoint partition.
    tag: String,
}

impl Incarnation {
    fn new(created: DateTime) -> Self {
        Self {
            created,
            tag: created.unix_timestamp_nanos().to_string(),
        }
    }
}

/// What `prepare` bound.
#[derive(Debug)]
struct Bound {
    client: Client,
    js: jetstream::Context,
    stream: stream::Stream,
    consumer: PullConsumer,
}

/// The NATS JetStream transport.
#[derive(Debug)]
pub struct Nats {
    settings: NatsSettings,
    source: String,
    /// Where the highest stored stream sequence is read when a consumer is re-created.
    store: Store,
    /// The stream incarnation read, once known.
    incarnation: Option<Incarnation>,
    /// When the consumer the worker bound was created: where a `deliverPolicy: new` consumer
    /// lost before anything was stored starts again.
    consumer_created: Option<DateTime>,
    events: ConnectionEvents,
    metrics: NatsMetrics,
    client: Option<Client>,
    /// `None` until `prepare` succeeded.
    bound: Option<Bound>,
    /// Set after a reconnection or a failed fetch: look the consumer up again first.
    rebind_due: bool,
    /// Since when blocking fetches have returned nothing.
    quiet_since: Option<Instant>,
    /// Whether the dead-letter stream is known to exist.
    dead_letter_ready: bool,
    /// The stream holding the dead letters, once known.
    dead_letter_stream: Option<DeadLetterStream>,
    /// Stream sequences dead-lettered and not yet terminated.
    dead_lettered: BTreeSet<u64>,
    /// Received and not acknowledged (stream sequence → reply subject), for the hand-back at
    /// shutdown. Ordered: sequences arrive mostly ascending and leave in the same order.
    held: BTreeMap<u64, Subject>,
}

impl Nats {
    /// Builds the transport (no network yet).
    pub fn new(settings: NatsSettings, store: Store, registry: &mut Registry) -> Self {
        let adapter = settings.adapter.clone();
        let events = ConnectionEvents::new(broker_reconnects(
            registry,
            &adapter,
            Some("nats_reconnects"),
        ));
        Self {
            source: format!("nats:{adapter}"),
            store,
            incarnation: None,
            consumer_created: None,
            events,
            metrics: NatsMetrics {
                rebinds: adapter_counter(
                    registry,
                    "nats_consumer_rebinds",
                    "Times the consumer was looked up again (or re-created) after a reconnection, a failed fetch, or while it delivered nothing with messages pending",
                    &adapter,
                ),
            },
            settings,
            client: None,
            bound: None,
            rebind_due: false,
            quiet_since: None,
            dead_letter_ready: false,
            dead_letter_stream: None,
            dead_lettered: BTreeSet::new(),
            held: BTreeMap::new(),
        }
    }

    fn bound(&self) -> Result<&Bound, TransportError> {
        self.bound
            .as_ref()
            .ok_or_else(|| TransportError::protocol("NATS transport used before prepare"))
    }

    async fn client(&mut self) -> Result<Client, TransportError> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let client = self
            .settings
            .connector
            .connect(Some(self.events.clone()))
            .await?;
        self.client = Some(client.clone());
        Ok(client)
    }

    fn incarnation(&self) -> Result<&Incarnation, TransportError> {
        self.incarnation
            .as_ref()
            .ok_or_else(|| TransportError::protocol("NATS stream used before it was read"))
    }
}

impl Transport for Nats {
    type Receipt = Receipt;
    type Probe = NatsProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        crate::transport::endpoint::endpoints(&self.settings.connector.url)
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    fn stable_enqueue_time(&self) -> bool {
        true
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.bind().await
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<NatsDelivery>, TransportError> {
        self.fetch_deliveries(max, block).await
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        self.publish_dead_letters(letters).await
    }

    async fn ack(&mut self, messages: &[&NatsDelivery]) -> Result<Acked, TransportError> {
        self.acknowledge(messages).await
    }

    fn lease(&self) -> Option<Duration> {
        Some(Duration::from_secs(u64::from(
            self.settings.spec.ack_wait_seconds,
        )))
    }

    async fn extend_lease(&mut self, messages: &[&NatsDelivery]) -> Result<(), TransportError> {
        self.mark_in_progress(messages).await
    }

    /// The stream's `max_age` (0: kept until its limits or a consumer remove them).
    fn source_retention(&self) -> SourceRetention {
        let Some(bound) = &self.bound else {
            return SourceRetention::Unknown;
        };
        let setting = format!("max_age of stream {}", self.settings.spec.stream);
        match bound.stream.cached_info().config.max_age {
            age if age.is_zero() => SourceRetention::Unbounded { setting },
            kept => SourceRetention::Bounded { kept, setting },
        }
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        MAINTENANCE_INTERVAL
    }

    fn probe(&self) -> NatsProbe {
        NatsProbe {
            connector: self.settings.connector.clone(),
            stream: self.settings.spec.stream.clone(),
            consumer: self.settings.spec.consumer.clone(),
            filter: self.settings.spec.filter_subject.clone(),
            dead_letter_stream: self.dead_letter_stream.clone(),
            client: None,
        }
    }

    async fn shutdown(&mut self) {
        self.hand_back().await;
    }
}
