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

mod connect;
mod consumer;
mod dead_letter;
mod headers;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use async_nats::datetime::DateTime;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::{
    ConsumerInfoErrorKind, CreateStreamErrorKind, GetStreamByNameErrorKind, GetStreamErrorKind,
    PublishErrorKind,
};
use async_nats::jetstream::stream::{self, ConsumerErrorKind, ConsumerUpdateErrorKind};
use async_nats::jetstream::{self, AckKind, ErrorCode};
use async_nats::{Client, RequestErrorKind, Subject};
use base64::Engine as _;
use futures::StreamExt as _;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use switchboard_api::NatsDeliverPolicy;
use switchboard_store::{Dedup, Position, Store};

use self::connect::ConnectionEvents;
pub use self::connect::{Auth, Connector};
use self::consumer::{Fit, Start};
use self::dead_letter::WriteContext;
use self::headers::RAW_HEADERS;
use crate::metrics::adapter_counter;
use crate::transport::{
    Acked, DeadLetter, Message, QueueHealth, QueueProbe, Transport, TransportError,
};

/// A wait for the next message of a fetch: the fetch's expiry and a request's time.
pub const NEXT_DEADLINE: Duration = Duration::from_secs(6);
/// How long a publish (a dead letter, a batch of acknowledgements) may wait to be sent.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a blocking fetch waits for its first message.
pub const FETCH_EXPIRY: Duration = Duration::from_secs(1);
/// The redelivery delay of messages handed back at shutdown.
pub const NAK_DELAY: Duration = Duration::from_secs(1);
/// How long the server has to confirm the acknowledgements of one call.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often `maintain` (a no-op) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// How long the dead-letter stream the worker creates keeps messages.
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
    /// `spec.delivery.deadLetter.retentionDays`: the MaxAge of a dead-letter stream the worker
    /// creates.
    pub dead_letter_retention: Duration,
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
        let events = ConnectionEvents::new(adapter_counter(
            registry,
            "nats_reconnects",
            "Reconnections of the worker's NATS connection",
            &adapter,
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

    /// Reads the stream: fatal when it is missing. A creation time other than the one read
    /// before means the stream was deleted and created again: said once, and what was held
    /// of the old incarnation is forgotten. Returns the stream and whether it was re-created.
    async fn read_stream(
        &mut self,
        js: &jetstream::Context,
    ) -> Result<(stream::Stream, bool), TransportError> {
        let name = &self.settings.spec.stream;
        let stream = js.get_stream(name).await.map_err(|err| match err.kind() {
            GetStreamErrorKind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND => {
                self.stream_missing()
            }
            GetStreamErrorKind::InvalidStreamName | GetStreamErrorKind::EmptyName => {
                TransportError::fatal(STREAM_SETTING, "not a valid stream name", None)
            }
            _ => TransportError::transient("could not read the NATS stream", err),
        })?;
        let current = Incarnation::new(stream.cached_info().created);
        let recreated = match self.incarnation.replace(current.clone()) {
            Some(earlier) if earlier != current => {
                tracing::warn!(
                    stream = %name,
                    earlier_created = %humantime::format_rfc3339_nanos(earlier.created.into()),
                    created = %humantime::format_rfc3339_nanos(current.created.into()),
                    "the NATS stream was deleted and created again: its sequences restarted at 1 and its consumer went with it; its messages are new ones (stored under the new incarnation), read from its first message"
                );
                self.held.clear();
                self.dead_lettered.clear();
                self.consumer_created = None;
                true
            }
            _ => false,
        };
        Ok((stream, recreated))
    }

    /// The stream does not exist: misconfiguration at start (fatal); once read, it was deleted
    /// and is waited for (an operator re-creating it).
    fn stream_missing(&self) -> TransportError {
        let stream = &self.settings.spec.stream;
        if self.incarnation.is_some() {
            TransportError::protocol(format!(
                "stream {stream} is gone (deleted); waiting for it to be created again"
            ))
        } else {
            TransportError::fatal(
                STREAM_SETTING,
                format!("stream {stream} does not exist"),
                None,
            )
        }
    }

    fn incarnation(&self) -> Result<&Incarnation, TransportError> {
        self.incarnation
            .as_ref()
            .ok_or_else(|| TransportError::protocol("NATS stream used before it was read"))
    }

    /// Where a consumer the worker creates starts: at 1 on a re-created stream; after the
    /// highest stream sequence stored; at the creation time of the lost `new` consumer it
    /// replaces; else (the first creation) at `deliverPolicy`.
    async fn start(&self, recreated: bool) -> Result<Start, TransportError> {
        if recreated {
            return Ok(Start::Sequence(1));
        }
        let stored = self
            .store
            .position(&self.source, &self.incarnation()?.tag)
            .await
            .map_err(TransportError::checkpoint)?;
        Ok(
            match (
                stored.as_deref().and_then(|p| p.first()),
                self.consumer_created,
            ) {
                (Some(&seq), _) => Start::Sequence(u64::try_from(seq).unwrap_or(0) + 1),
                (None, Some(created))
                    if self.settings.spec.deliver_policy == NatsDeliverPolicy::New =>
                {
                    Start::Time(created)
                }
                (None, _) => Start::Configured,
            },
        )
    }

    /// The consumer, created if missing (see [`Nats::start`]), refused if it differs.
    async fn bind_consumer(
        &mut self,
        stream: &stream::Stream,
        recreated: bool,
    ) -> Result<PullConsumer, TransportError> {
        let spec = self.settings.spec.clone();
        let read_failed = |err| TransportError::transient("could not read the NATS consumer", err);
        match stream.consumer_info(&spec.consumer).await {
            Ok(info) => {
                if info.config.deliver_subject.is_some() {
                    return Err(TransportError::fatal(
                        CONSUMER_SETTING,
                        format!(
                            "consumer {} is a push consumer; the worker needs a pull consumer",
                            spec.consumer
                        ),
                        None,
                    ));
                }
                let wanted = consumer::desired(&spec, &Start::Configured);
                let fit = consumer::check_existing(
                    &info.config,
                    &wanted,
                    &spec.consumer,
                    self.settings.max_deliveries,
                )?;
                if fit == Fit::LiftDeliveryLimit {
                    let mut lifted: jetstream::consumer::pull::Config = serde_json::from_value(
                        serde_json::to_value(&info.config).map_err(|err| {
                            TransportError::protocol(format!("consumer config: {err}"))
                        })?,
                    )
                    .map_err(|err| TransportError::protocol(format!("consumer config: {err}")))?;
                    lifted.max_deliver = consumer::UNLIMITED;
                    stream
                        .update_consumer(lifted)
                        .await
                        .map_err(|err| match err.kind() {
                            ConsumerUpdateErrorKind::JetStream(_) => TransportError::fatal(
                                "spec.delivery.maxDeliveries",
                                format!(
                                    "the server refused to lift the delivery limit of consumer {} (max_deliver {}); delete the consumer so the worker creates it",
                                    spec.consumer, info.config.max_deliver
                                ),
                                Some(Box::new(err)),
                            ),
                            _ => TransportError::transient("could not update the NATS consumer", err),
                        })?;
                    tracing::warn!(
                        consumer = %spec.consumer,
                        max_deliver = info.config.max_deliver,
                        "lifted the delivery limit an older worker set on the NATS consumer: the worker counts deliveries itself"
                    );
                }
                self.consumer_created = Some(info.created);
                stream.get_consumer(&spec.consumer).await.map_err(|err| {
                    TransportError::protocol(format!("could not bind the NATS consumer: {err}"))
                })
            }
            Err(err) => match err.kind() {
                ConsumerInfoErrorKind::NotFound => {
                    let start = self.start(recreated).await?;
                    let created = stream
                        .create_consumer(consumer::desired(&spec, &start))
                        .await
                        .map_err(|err| match err.kind() {
                            ConsumerErrorKind::JetStream(_) => TransportError::fatal(
                                CONSUMER_SETTING,
                                format!("the server refused to create consumer {}", spec.consumer),
                                Some(Box::new(err)),
                            ),
                            _ => {
                                TransportError::transient("could not create the NATS consumer", err)
                            }
                        })?;
                    if self.consumer_created.is_some() || start != Start::Configured {
                        tracing::warn!(consumer = %spec.consumer, start = ?start, "the NATS consumer was missing; re-created it after what is stored");
                    } else {
                        tracing::info!(consumer = %spec.consumer, "created the NATS consumer");
                    }
                    let mut created = created;
                    self.consumer_created = Some(
                        created
                            .info()
                            .await
                            .map_err(|err| {
                                TransportError::transient("could not read the NATS consumer", err)
                            })?
                            .created,
                    );
                    Ok(created)
                }
                ConsumerInfoErrorKind::StreamNotFound => Err(self.stream_missing()),
                ConsumerInfoErrorKind::InvalidName => Err(TransportError::fatal(
                    CONSUMER_SETTING,
                    "not a valid consumer name",
                    None,
                )),
                _ => Err(read_failed(err)),
            },
        }
    }

    /// Makes sure a stream (other than the source) holds the dead-letter subject; records it
    /// for the probe.
    async fn ensure_dead_letter_stream(
        &mut self,
        js: &jetstream::Context,
    ) -> Result<(), TransportError> {
        let stream = &self.settings.spec.stream;
        let (sample, captured) = match &self.settings.dead_letter_subject {
            Some(subject) => (subject.clone(), subject.clone()),
            None => (format!("{stream}.dlq.x"), format!("{stream}.dlq.>")),
        };
        match js.stream_by_subject(sample.clone()).await {
            Ok(name) if &name == stream => Err(TransportError::fatal(
                DEAD_LETTER_SETTING,
                format!(
                    "stream {stream} itself holds the dead-letter subject {captured}: dead letters would be delivered again; choose a subject it does not hold"
                ),
                None,
            )),
            Ok(name) => {
                tracing::info!(stream = %name, subject = %captured, "dead letters go to an existing stream");
                self.dead_letter_stream = Some(DeadLetterStream {
                    name,
                    subjects: captured,
                });
                Ok(())
            }
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::NotFound) => {
                let name = format!("{stream}_DLQ");
                js.create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![captured.clone()],
                    max_age: self.settings.dead_letter_retention,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|err| match err.kind() {
                    CreateStreamErrorKind::JetStream(_) => {
                        TransportError::fatal(
                            DEAD_LETTER_SETTING,
                            format!("the server refused to create the dead-letter stream {name} for {captured}"),
                            Some(Box::new(err)),
                        )
                    }
                    _ => TransportError::transient("could not create the dead-letter stream", err),
                })?;
                tracing::info!(stream = %name, subject = %captured, max_age = ?self.settings.dead_letter_retention, "created the dead-letter stream (messages kept deadLetter.retentionDays)");
                self.dead_letter_stream = Some(DeadLetterStream {
                    name,
                    subjects: captured,
                });
                Ok(())
            }
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::InvalidSubject) => {
                Err(TransportError::fatal(
                    DEAD_LETTER_SETTING,
                    format!("{sample} is not a valid subject"),
                    None,
                ))
            }
            Err(err) => Err(TransportError::transient(
                "could not look up the dead-letter stream",
                err,
            )),
        }
    }

    /// Reads the stream and looks the consumer up again (re-creating it if the server lost
    /// it); then looks for deliveries the client could not decode.
    async fn rebind(&mut self, why: &str) -> Result<(), TransportError> {
        let Some(bound) = &self.bound else {
            return Ok(());
        };
        let js = bound.js.clone();
        let (stream, recreated) = self.read_stream(&js).await?;
        let consumer = self.bind_consumer(&stream, recreated).await?;
        self.metrics.rebinds.inc();
        tracing::info!(reason = why, "re-bound the NATS consumer");
        if let Some(bound) = &mut self.bound {
            bound.consumer = consumer;
            bound.stream = stream;
        }
        self.rebind_due = false;
        self.quiet_since = None;
        Ok(())
    }

    /// After a blocking fetch returned nothing: a consumer quiet for 2 × [`FETCH_EXPIRY`]
    /// while the server holds undelivered messages for it is re-bound.
    async fn check_stalled(&mut self) -> Result<(), TransportError> {
        let since = *self.quiet_since.get_or_insert_with(Instant::now);
        if since.elapsed() < 2 * FETCH_EXPIRY {
            return Ok(());
        }
        self.quiet_since = Some(Instant::now());
        let info =
            self.bound()?.consumer.get_info().await.map_err(|err| {
                TransportError::transient("could not read the NATS consumer", err)
            })?;
        if info.num_pending > 0 {
            tracing::warn!(
                num_pending = info.num_pending,
                "the NATS consumer delivered nothing while messages are pending"
            );
            self.rebind("stalled").await?;
        }
        Ok(())
    }

    /// One fetched message, converted; `None` for one without an acknowledgement subject
    /// (never a JetStream delivery: it can be neither acknowledged nor dead-lettered).
    fn convert(&mut self, message: jetstream::Message) -> Option<NatsDelivery> {
        let incarnation = &self.incarnation.as_ref()?.tag;
        let (stream_sequence, delivered, published) = match message.info() {
            Ok(info) => (info.stream_sequence, info.delivered, info.published),
            Err(err) => {
                tracing::warn!(error = %err, subject = %message.subject, "skipped a NATS message that is not a JetStream delivery");
                return None;
            }
        };
        let message = message.message;
        let reply = message.reply?;
        let undecodable = message.undecodable.unwrap_or_default();
        let mut refusal = None;
        let mut headers: Vec<(String, Vec<u8>)> = match &undecodable.raw_headers {
            None => message
                .headers
                .iter()
                .flat_map(|headers| headers.iter())
                .flat_map(|(name, values)| {
                    values
                        .iter()
                        .map(move |value| (name.to_string(), value.as_str().as_bytes().to_vec()))
                })
                .collect(),
            Some(block) => headers::read_block(block).unwrap_or_else(|reason| {
                refusal = Some(reason);
                vec![(
                    RAW_HEADERS.to_owned(),
                    base64::engine::general_purpose::STANDARD
                        .encode(block)
                        .into_bytes(),
                )]
            }),
        };
        headers.sort();
        // Stored encoded when it is not UTF-8 (the server does not check subjects).
        let subject = undecodable
            .raw_subject
            .map_or_else(|| message.subject.as_bytes().to_vec(), |raw| raw.to_vec());
        headers.push(("Nats-Subject".to_owned(), subject));
        self.held.insert(stream_sequence, reply.clone());
        let identity = Identity {
            source: &self.source,
            stream: &self.settings.spec.stream,
            incarnation,
        };
        let mut delivery = identity.message(
            Receipt {
                reply,
                stream_sequence,
                subject: message.subject,
            },
            message.payload.to_vec(),
            headers,
            u64::try_from(delivered).unwrap_or(1).max(1),
            published,
        );
        delivery.undecodable = refusal.map(|reason| {
            format!("the NATS delivery's headers cannot be read ({reason}); raw header block in {RAW_HEADERS}")
        });
        Some(delivery)
    }
}

/// What identifies a message of the stream: the adapter's source, the stream and its
/// incarnation.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    pub source: &'a str,
    pub stream: &'a str,
    /// [`Incarnation::tag`].
    pub incarnation: &'a str,
}

impl Identity<'_> {
    /// A delivery of the message at `receipt.stream_sequence`: its external id
    /// `{stream}:{incarnation}:{seq}`, idempotency key `{source}:{external id}` and checkpoint
    /// position (partition: the incarnation).
    fn message(
        &self,
        receipt: Receipt,
        body: Vec<u8>,
        headers: Vec<(String, Vec<u8>)>,
        delivery_count: u64,
        published: DateTime,
    ) -> NatsDelivery {
        let seq = receipt.stream_sequence;
        let external_id = format!("{}:{}:{seq}", self.stream, self.incarnation);
        Message {
            receipt,
            idempotency_key: format!("{}:{external_id}", self.source),
            external_id,
            body,
            headers,
            delivery_count,
            enqueued_at_ms: u64::try_from(published.unix_timestamp_nanos() / 1_000_000).ok(),
            position: Some(Position {
                partition: self.incarnation.to_owned(),
                value: vec![i64::try_from(seq).unwrap_or(i64::MAX)],
            }),
            undecodable: None,
        }
    }
}

/// Whether the server refuses a dead letter however often it is sent: larger than the
/// server's max payload, or than the dead-letter stream's max message size.
fn refused_for_good(err: &async_nats::jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    matches!(err.kind(), PublishErrorKind::MaxPayloadExceeded)
        || err
            .source()
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|js| js.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}

impl Transport for Nats {
    type Receipt = Receipt;
    type Probe = NatsProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        let client = self.client().await?;
        let js = jetstream::new(client.clone());
        let (stream, recreated) = self.read_stream(&js).await?;
        self.ensure_dead_letter_stream(&js).await?;
        self.dead_letter_ready = true;
        let consumer = self.bind_consumer(&stream, recreated).await?;
        if self.bound.is_none() {
            tracing::info!(
                stream = %self.settings.spec.stream,
                consumer = %self.settings.spec.consumer,
                ack_wait_seconds = self.settings.spec.ack_wait_seconds,
                "NATS consumer ready"
            );
        }
        self.bound = Some(Bound {
            client,
            js,
            stream,
            consumer,
        });
        self.events.reconnected.store(false, Ordering::Release);
        Ok(())
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<NatsDelivery>, TransportError> {
        if self.events.reconnected.swap(false, Ordering::AcqRel) || self.rebind_due {
            let why = if self.rebind_due {
                "fetch failed"
            } else {
                "reconnected"
            };
            self.rebind_due = true;
            self.rebind(why).await?;
        }
        let bound = self.bound()?;
        let mut fetch = bound.consumer.fetch().max_messages(max.max(1));
        if block {
            fetch = fetch.expires(FETCH_EXPIRY);
        }
        let mut batch = match tokio::time::timeout(NEXT_DEADLINE, fetch.messages()).await {
            Ok(Ok(batch)) => batch,
            Ok(Err(err)) => {
                self.rebind_due = true;
                return Err(TransportError::transient("NATS fetch failed", err));
            }
            Err(elapsed) => {
                self.rebind_due = true;
                return Err(TransportError::transient(
                    "NATS did not take the pull request in time",
                    elapsed,
                ));
            }
        };
        let mut fetched = Vec::new();
        let mut failure: Option<Box<dyn std::error::Error + Send + Sync>> = None;
        loop {
            match tokio::time::timeout(NEXT_DEADLINE, batch.next()).await {
                Ok(None) => break,
                Ok(Some(Ok(message))) => fetched.push(message),
                Ok(Some(Err(err))) => {
                    failure = Some(err);
                    break;
                }
                // The pull request's end never came (a connection cut after it was sent).
                Err(elapsed) => {
                    failure = Some(Box::new(elapsed));
                    break;
                }
            }
        }
        drop(batch);
        let messages: Vec<NatsDelivery> = fetched
            .into_iter()
            .filter_map(|message| self.convert(message))
            .collect();
        if let Some(err) = failure {
            self.rebind_due = true;
            if messages.is_empty() {
                return Err(TransportError::protocol(format!(
                    "NATS fetch failed: {err}"
                )));
            }
            tracing::debug!(error = %err, "a NATS fetch ended early; delivering what it returned");
        }
        if !messages.is_empty() {
            self.quiet_since = None;
        } else if block {
            self.check_stalled().await?;
        }
        Ok(messages)
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        if !self.dead_letter_ready {
            let js = self.bound()?.js.clone();
            self.ensure_dead_letter_stream(&js).await?;
            self.dead_letter_ready = true;
        }
        let bound = self.bound()?;
        let last_seen = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
        let context = WriteContext {
            stream: &self.settings.spec.stream,
            incarnation: &self.incarnation()?.tag,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
        };
        let mut pending = Vec::with_capacity(letters.len());
        let mut refused = Vec::new();
        let mut refusal = None;
        for (index, letter) in letters.iter().enumerate() {
            let message = letter.message;
            let subject = dead_letter::subject(
                self.settings.dead_letter_subject.as_deref(),
                &self.settings.spec.stream,
                message.receipt.subject.as_str(),
            );
            let headers = dead_letter::headers(
                message,
                letter.reason,
                &letter.error,
                &letter.attempts,
                context,
            );
            let sent = tokio::time::timeout(
                SEND_TIMEOUT,
                bound
                    .js
                    .publish_with_headers(subject, headers, message.body.clone().into()),
            )
            .await
            .map_err(|elapsed| {
                TransportError::transient("could not publish a dead letter in time", elapsed)
            })?;
            match sent {
                Ok(ack) => pending.push((index, ack)),
                Err(err) if refused_for_good(&err) => {
                    refused.push(index);
                    refusal.get_or_insert(err);
                }
                Err(err) => {
                    return Err(TransportError::transient(
                        "could not publish a dead letter",
                        err,
                    ));
                }
            }
        }
        let mut missing_stream = false;
        let mut failure = None;
        for (index, ack) in pending {
            // The PubAck future has the JetStream context's own timeout.
            match ack.await {
                Ok(_) => {}
                Err(err) if refused_for_good(&err) => {
                    refused.push(index);
                    refusal.get_or_insert(err);
                }
                Err(err) => {
                    missing_stream |= matches!(err.kind(), PublishErrorKind::StreamNotFound);
                    failure.get_or_insert(err);
                }
            }
        }
        if let Some(err) = failure {
            // The pipeline writes the whole batch again; the dead-letter stream drops the
            // letters it already has (their `Nats-Msg-Id`).
            self.dead_letter_ready &= !missing_stream;
            return Err(TransportError::transient(
                "the dead-letter stream did not confirm a dead letter",
                err,
            ));
        }
        self.dead_lettered.extend(
            letters
                .iter()
                .enumerate()
                .filter(|(index, _)| !refused.contains(index))
                .map(|(_, letter)| letter.message.receipt.stream_sequence),
        );
        if let Some(err) = refusal {
            refused.sort_unstable();
            return Err(TransportError::dead_letters_refused(
                refused,
                "NATS refuses these dead letters for good (over the server's max payload or the dead-letter stream's max message size)",
                Some(Box::new(err)),
            ));
        }
        Ok(())
    }
    /// Every acknowledgement but the last is sent as is; the last asks for the server's
    /// confirmation. The server takes the acknowledgements of one consumer from one connection
    /// in order, so confirming the last confirms that it processed them all: one reply per
    /// batch rather than one per message. A reconnection while they were sent (what was
    /// buffered for the old connection is gone) or a lost connection: the whole batch is
    /// acknowledged again, which is harmless. Nobody answering, or no confirmation in time (a
    /// restarted server does not answer for deliveries it no longer knows), means the receipts
    /// are stale: dropped (the messages are stored; a redelivery is deduplicated), and the
    /// consumer is looked up again before the next fetch.
    async fn ack(&mut self, messages: &[&NatsDelivery]) -> Result<Acked, TransportError> {
        let Some((last, rest)) = messages.split_last() else {
            return Ok(Acked::all());
        };
        let client = self.bound()?.client.clone();
        let connects = || client.statistics().connects.load(Ordering::Acquire);
        let connected = connects();
        let kind = |message: &NatsDelivery| {
            if self
                .dead_lettered
                .contains(&message.receipt.stream_sequence)
            {
                AckKind::Term
            } else {
                AckKind::Ack
            }
        };
        let sent = tokio::time::timeout(SEND_TIMEOUT, async {
            for message in rest {
                client
                    .publish(message.receipt.reply.clone(), kind(message).into())
                    .await?;
            }
            Ok::<_, async_nats::PublishError>(())
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                return Err(TransportError::transient(
                    "could not send acknowledgements",
                    err,
                ));
            }
            Err(elapsed) => {
                return Err(TransportError::transient(
                    "could not send acknowledgements in time",
                    elapsed,
                ));
            }
        }
        let confirmation = client.request(last.receipt.reply.clone(), kind(last).into());
        let confirmed = tokio::time::timeout(ACK_TIMEOUT, confirmation).await;
        let stale = match confirmed {
            Ok(Ok(_)) if connects() == connected => false,
            Ok(Ok(_)) => {
                return Err(TransportError::transient(
                    "reconnected to NATS while acknowledging a batch",
                    std::io::Error::other(
                        "acknowledgements buffered for the old connection may be lost",
                    ),
                ));
            }
            Ok(Err(err)) if err.kind() == RequestErrorKind::NoResponders => true,
            // A server that restarted (or lost the consumer's pending state) never confirms an
            // acknowledgement of a delivery it no longer knows: asking again would wedge the
            // batch. The messages are stored (or dead-lettered) already: the receipts are
            // dropped, and whatever the server redelivers is deduplicated.
            Ok(Err(err)) if err.kind() == RequestErrorKind::TimedOut => true,
            Ok(Err(err)) => {
                return Err(TransportError::transient(
                    "NATS did not confirm the acknowledgements",
                    err,
                ));
            }
            Err(_elapsed) => true,
        };
        for message in messages {
            let seq = message.receipt.stream_sequence;
            self.dead_lettered.remove(&seq);
            self.held.remove(&seq);
        }
        if stale {
            self.rebind_due = true;
            return Err(TransportError::stale(
                "nothing confirms the acknowledgements: the NATS consumer is gone or no longer knows these deliveries; what it redelivers is deduplicated",
                None,
            ));
        }
        Ok(Acked::all())
    }

    fn lease(&self) -> Option<Duration> {
        Some(Duration::from_secs(u64::from(
            self.settings.spec.ack_wait_seconds,
        )))
    }

    async fn extend_lease(&mut self, messages: &[&NatsDelivery]) -> Result<(), TransportError> {
        let client = &self.bound()?.client;
        let sent = tokio::time::timeout(SEND_TIMEOUT, async {
            for message in messages {
                client
                    .publish(message.receipt.reply.clone(), AckKind::Progress.into())
                    .await
                    .map_err(|err| {
                        TransportError::transient("could not send in-progress acks", err)
                    })?;
            }
            client
                .flush()
                .await
                .map_err(|err| TransportError::transient("could not send in-progress acks", err))
        })
        .await;
        sent.map_err(|elapsed| {
            TransportError::transient("could not send in-progress acks in time", elapsed)
        })?
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
        let Some(bound) = &self.bound else {
            return;
        };
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        let handed_back = tokio::time::timeout(SEND_TIMEOUT, async {
            for reply in held.values() {
                bound
                    .client
                    .publish(reply.clone(), AckKind::Nak(Some(NAK_DELAY)).into())
                    .await
                    .map_err(|err| err.to_string())?;
            }
            bound.client.flush().await.map_err(|err| err.to_string())
        })
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()));
        match handed_back {
            Ok(()) => tracing::info!(
                messages = held.len(),
                delay = ?NAK_DELAY,
                "handed un-acknowledged messages back to NATS"
            ),
            Err(err) => {
                tracing::warn!(error = %err, "could not hand messages back; the server redelivers them after AckWait")
            }
        }
    }
}

/// Reads the consumer's figures on its own connection.
#[derive(Debug)]
pub struct NatsProbe {
    connector: Connector,
    stream: String,
    consumer: String,
    filter: Option<String>,
    dead_letter_stream: Option<DeadLetterStream>,
    client: Option<Client>,
}

impl QueueProbe for NatsProbe {
    /// Backlog = the consumer's `num_pending` (not yet delivered), pending = `num_ack_pending`
    /// (delivered, not acknowledged); the oldest pending age is that of the first message
    /// above the consumer's ack floor (zero when there is none).
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let client = match &self.client {
            Some(client) => client.clone(),
            None => {
                let client = self.connector.connect(None).await?;
                self.client = Some(client.clone());
                client
            }
        };
        let js = jetstream::new(client);
        let stream = js
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|err| TransportError::transient("could not read the NATS stream", err))?;
        let info = stream
            .consumer_info(&self.consumer)
            .await
            .map_err(|err| TransportError::transient("could not read the NATS consumer", err))?;
        let unacknowledged = info.num_pending + info.num_ack_pending as u64;
        let oldest_pending_age = if unacknowledged == 0 {
            Some(Duration::ZERO)
        } else {
            stream
                .raw_message_builder()
                .sequence(info.ack_floor.stream_sequence + 1)
                .next_by_subject(self.filter.clone().unwrap_or_else(|| ">".to_owned()))
                .send()
                .await
                .ok()
                .map(|message| {
                    let age = time_since(message.time.unix_timestamp_nanos());
                    Duration::from_nanos(u64::try_from(age).unwrap_or(0))
                })
        };
        let dead_letters = match &self.dead_letter_stream {
            Some(letters) => Some(dead_letter_count(&js, letters).await?),
            None => None,
        };
        Ok(QueueHealth {
            backlog: Some(info.num_pending),
            pending: Some(info.num_ack_pending as u64),
            oldest_pending_age,
            dead_letters,
            oldest_dead_letter_age: None,
        })
    }
}

/// Messages on the dead-letter subjects of `letters`' stream.
async fn dead_letter_count(
    js: &jetstream::Context,
    letters: &DeadLetterStream,
) -> Result<u64, TransportError> {
    let failed = |err| TransportError::transient("could not read the dead-letter stream", err);
    let stream = js
        .get_stream_no_info(&letters.name)
        .await
        .map_err(|err| TransportError::transient("could not read the dead-letter stream", err))?;
    let mut subjects = stream
        .info_with_subjects(&letters.subjects)
        .await
        .map_err(failed)?;
    let mut count = 0;
    while let Some(subject) = subjects.next().await {
        count += subject.map_err(failed)?.1 as u64;
    }
    Ok(count)
}

/// Nanoseconds from `unix_nanos` until now (zero for a time in the future).
fn time_since(unix_nanos: i128) -> i128 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    (now - unix_nanos).max(0)
}
