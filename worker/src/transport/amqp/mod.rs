//! RabbitMQ (AMQP 0-9-1) queues, quorum or classic: `basic.consume` (manual acknowledgement,
//! prefetch = `batchSize` × the batches the pipeline holds) → (store) → `basic.ack`.
//!
//! - **Session**: the consumer's connection and channel (QoS, `basic.consume`); it never
//!   publishes, so a resource alarm (which blocks publishing connections) never stops consuming
//!   and acknowledging. Dead letters and recounted redeliveries go through a publishing
//!   connection of its own (`publisher.rs`: published once, `connection.blocked` reported,
//!   refusals bounded). lapin does not reconnect by itself: when the channel or the connection
//!   fails, the session is dropped and the next call opens a new one (the pipeline backs off between attempts and logs the
//!   outage once). A session idle for [`IDLE_RESUBSCRIBE`] subscribes again on a new channel:
//!   RabbitMQ can lose a consumer without cancelling it (a quorum queue deleted and declared
//!   again). Delivery tags belong to their channel: every receipt carries its session's
//!   generation, and a receipt of an earlier session is stale (RabbitMQ has put the message
//!   back; it is redelivered and deduplicated).
//! - **Prepare**: a passive declare of the queue (missing: fatal, naming
//!   `spec.source.amqp.queue`), or with `declare` a durable declare with `x-queue-type` and the
//!   bindings; the default dead-letter queue `<queue>.dlq` is declared when it does not exist.
//!   The worker owns redelivery limits: a queue argument `x-delivery-limit` below
//!   `spec.delivery.maxDeliveries` (RabbitMQ would drop or dead-letter a message behind the
//!   worker's back) is fatal, naming both (`delivery_limit.rs`; a limit set by a policy is
//!   invisible over AMQP).
//! - **Receive**: waits up to [`BLOCK`] for a first delivery, then gathers up to the batch size
//!   for at most [`GATHER`]. Deliveries are kept in the transport until they are returned, so a
//!   dropped `receive` loses none.
//! - **Key**: `amqp:{adapter}:{queue}:{message-id}`, or the body's SHA-256 when the message has
//!   no `message-id` (identical bodies without an id are then one message).
//! - **Delivery count**: quorum queues count in `x-delivery-count` (absent on the first
//!   delivery). Classic queues only flag a redelivery; to count across worker crashes, the
//!   worker publishes such a redelivery again (confirmed) with `x-switchboard-deliveries` one
//!   higher and acknowledges the redelivered copy, so the count travels with the message — at
//!   the price of one publish per redelivery and of the message moving to the queue's tail.
//!   Storing never waits on that publish: when it is refused (a full queue with
//!   `x-overflow: reject-publish`), unconfirmed or blocked, the redelivery is delivered with its
//!   count as it stands (logged once per episode); only the count's survival of a further crash
//!   is lost meanwhile.
//! - **Acknowledge**: one `basic.ack multiple=true` for the settled prefix of what the channel
//!   holds, individual acks for the rest (`acks.rs`); never `nack(requeue)`.
//! - **Dead letters**: published with confirms to `deadLetter.exchange`/`routingKey` (default:
//!   the default exchange → `<queue>.dlq`), mandatory, persistent, the body byte-identical, the
//!   original properties and headers plus `x-switchboard-*` context headers, without
//!   `expiration`, `user-id` or delivery counters (`dead_letter.rs`). A letter refused with 406,
//!   or nacked / blocked / unconfirmed for `publisher::PATIENCE`, is handed back as refused (the
//!   pipeline keeps it in PostgreSQL); an unroutable one is fatal.
//! - **Queue health**: a passive declare on the probe's own connection (`message_count` is the
//!   ready backlog, `consumer_count` a gauge), and of the default dead-letter queue for its
//!   depth; pending is what this worker holds.

mod acks;
mod classify;
mod dead_letter;
mod delivery;
mod delivery_limit;
mod publisher;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{FutureExt as _, StreamExt as _};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use switchboard_api::{AmqpQueueType, AmqpSource};
use switchboard_store::Dedup;

use self::classify::{Addressed, Names, URL_SETTING};
use self::dead_letter::{LetterContext, WriteContext};
pub use self::delivery::Receipt;
use self::delivery::{AmqpDelivery, Count, Origin, Original};
use self::publisher::{Outgoing, Publisher};
use crate::health::now_ms;
use crate::metrics::{adapter_counter, adapter_gauge};
use crate::transport::{
    Acked, DeadLetter, HELD, QueueHealth, QueueProbe, Transport, TransportError,
};

/// How long a blocking receive waits for a first delivery.
const BLOCK: Duration = Duration::from_secs(1);
/// How long a receive gathers more deliveries after the first.
const GATHER: Duration = Duration::from_millis(50);
/// The bound on every other broker call (connect, declare, publish confirm, ack).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often `maintain` (reopening a lost session) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// After how long without a delivery, holding nothing, the consumer subscribes again on a new
/// channel (one channel open, `basic.qos` and `basic.consume`; the connection stays).
const IDLE_RESUBSCRIBE: Duration = Duration::from_secs(30);

/// Everything the AMQP transport needs to know.
#[derive(Debug, Clone)]
pub struct AmqpSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    /// The pod name: the connection's name, recorded in dead letters.
    pub consumer: String,
    pub spec: AmqpSource,
    /// `spec.delivery.deadLetter.exchange`; default: the default exchange.
    pub dead_letter_exchange: Option<String>,
    /// `spec.delivery.deadLetter.routingKey`; default: `<queue>.dlq`, or the queue's name with
    /// an exchange.
    pub dead_letter_routing_key: Option<String>,
    pub batch_size: usize,
    /// `spec.delivery.maxDeliveries`: a queue's `x-delivery-limit` may not be below it.
    pub max_deliveries: u64,
}

/// The AMQP transport's own metrics.
#[derive(Debug, Clone)]
struct AmqpMetrics {
    recounted: Counter,
    not_recounted: Counter,
    sessions: Counter,
    consumers: Gauge,
    publishing_blocked: Gauge,
}

impl AmqpMetrics {
    fn register(registry: &mut Registry, adapter: &str) -> Self {
        Self {
            recounted: adapter_counter(
                registry,
                "amqp_redeliveries_recounted",
                "Classic-queue redeliveries published again with their delivery count (x-switchboard-deliveries)",
                adapter,
            ),
            not_recounted: adapter_counter(
                registry,
                "amqp_redeliveries_not_recounted",
                "Classic-queue redeliveries delivered without publishing them again with their count (the publish was refused, blocked or unconfirmed)",
                adapter,
            ),
            sessions: adapter_counter(
                registry,
                "amqp_sessions_opened",
                "Connections (with their consumer and publisher channels) opened to RabbitMQ",
                adapter,
            ),
            consumers: adapter_gauge(
                registry,
                "amqp_queue_consumers",
                "Consumers of the source queue, as RabbitMQ reports them",
                adapter,
            ),
            publishing_blocked: adapter_gauge(
                registry,
                "amqp_publishing_blocked",
                "1 while RabbitMQ blocks the publishing connection (connection.blocked: a disk or memory alarm)",
                adapter,
            ),
        }
    }
}

/// What this worker holds un-acknowledged, shared with the probe.
#[derive(Debug, Default)]
struct Held {
    count: AtomicU64,
    /// When the oldest held delivery arrived (Unix ms), 0 when none.
    oldest_ms: AtomicU64,
}

impl Held {
    fn record(&self, outstanding: &BTreeMap<u64, u64>) {
        self.count
            .store(outstanding.len() as u64, Ordering::Relaxed);
        // Tags grow with arrival: the lowest is the oldest.
        let oldest = outstanding.values().next().copied().unwrap_or(0);
        self.oldest_ms.store(oldest, Ordering::Relaxed);
    }

    fn oldest_age(&self) -> Duration {
        match self.oldest_ms.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            ms => Duration::from_millis(now_ms().saturating_sub(ms)),
        }
    }
}

/// The consumer's connection and channel.
struct Session {
    generation: u64,
    connection: Connection,
    consume: Channel,
    consumer: Consumer,
    /// Delivery tag → arrival (Unix ms) of every delivery not acknowledged yet.
    outstanding: BTreeMap<u64, u64>,
    /// When the consumer last delivered (or was subscribed).
    last_delivery: Instant,
}

impl Session {
    fn alive(&self) -> bool {
        self.connection.status().connected() && self.consume.status().connected()
    }
}

/// The AMQP transport.
pub struct Amqp {
    settings: AmqpSettings,
    source: String,
    /// Never logged: it may hold a password.
    url: String,
    names: Names,
    dead_letter_exchange: String,
    dead_letter_routing_key: String,
    metrics: AmqpMetrics,
    held: Arc<Held>,
    session: Option<Session>,
    publisher: Publisher,
    /// Whether classic-queue redeliveries are being delivered without their recount (logged
    /// once per episode).
    recount_failing: bool,
    generations: u64,
    /// Deliveries of the current session taken from the consumer and not returned yet.
    buffer: Vec<lapin::message::Delivery>,
}

impl std::fmt::Debug for Amqp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp")
            .field("source", &self.source)
            .field("queue", &self.settings.spec.queue)
            .field("generation", &self.generations)
            .finish_non_exhaustive()
    }
}

/// Runs a broker call under [`CALL_TIMEOUT`].
async fn call<T>(
    names: &Names,
    what: &str,
    addressed: Addressed,
    future: impl Future<Output = lapin::Result<T>>,
) -> Result<T, TransportError> {
    match tokio::time::timeout(CALL_TIMEOUT, future).await {
        Ok(result) => result.map_err(|err| names.error(what, addressed, err)),
        Err(_) => Err(TransportError::protocol(format!(
            "RabbitMQ {what} timed out after {CALL_TIMEOUT:?}"
        ))),
    }
}

/// Opens a channel on `connection`.
async fn open_channel(names: &Names, connection: &Connection) -> Result<Channel, TransportError> {
    call(
        names,
        "channel open",
        Addressed::Connection,
        connection.create_channel(),
    )
    .await
}

/// The passive declare of `queue` on a channel of its own (a missing queue closes it).
async fn declare_passive(
    names: &Names,
    connection: &Connection,
    queue: &str,
) -> Result<lapin::Queue, TransportError> {
    let channel = open_channel(names, connection).await?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = call(
        names,
        "queue declare (passive)",
        Addressed::Queue,
        channel.queue_declare(queue.into(), options, FieldTable::default()),
    )
    .await?;
    let _ = channel.close(200, "probed".into()).await;
    Ok(declared)
}

/// Opens a connection to `url` named `name`.
async fn connect(names: &Names, url: &str, name: &str) -> Result<Connection, TransportError> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    call(
        names,
        "connect",
        Addressed::Connection,
        Connection::connect(url, properties),
    )
    .await
}

/// Checks the URL's form without echoing it (it may hold a password).
fn check_url(url: &str) -> Result<(), TransportError> {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(_) => Ok(()),
        Err(_) => Err(TransportError::fatal(
            URL_SETTING,
            "is not a valid amqp:// or amqps:// URL",
            None,
        )),
    }
}

fn queue_type_argument(queue_type: AmqpQueueType) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(queue_type.as_str().as_bytes().to_vec())),
    );
    arguments
}

impl Amqp {
    /// Checks the settings (no network yet).
    pub fn new(
        settings: AmqpSettings,
        url: String,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        check_url(&url)?;
        let queue = settings.spec.queue.clone();
        let dead_letter_exchange = settings.dead_letter_exchange.clone().unwrap_or_default();
        let dead_letter_routing_key =
            settings
                .dead_letter_routing_key
                .clone()
                .unwrap_or_else(|| match dead_letter_exchange.as_str() {
                    "" => format!("{queue}.dlq"),
                    _ => queue.clone(),
                });
        let names = Names {
            queue,
            dead_letter: match dead_letter_exchange.as_str() {
                "" => format!("queue {dead_letter_routing_key:?}"),
                exchange => {
                    format!("exchange {exchange:?} (routing key {dead_letter_routing_key:?})")
                }
            },
            dead_letter_setting: "spec.delivery.deadLetter.exchange",
        };
        let metrics = AmqpMetrics::register(registry, &settings.adapter);
        let publisher = Publisher::new(
            url.clone(),
            format!("{} (publishing)", settings.consumer),
            names.clone(),
            metrics.publishing_blocked.clone(),
        );
        Ok(Self {
            source: format!("amqp:{}", settings.adapter),
            metrics,
            settings,
            url,
            names,
            publisher,
            recount_failing: false,
            dead_letter_exchange,
            dead_letter_routing_key,
            held: Arc::default(),
            session: None,
            generations: 0,
            buffer: Vec::new(),
        })
    }

    /// Declares (or checks) the source queue and the default dead-letter queue, each on a
    /// channel of its own: a refused declare closes its channel.
    async fn declare_queues(&self, connection: &Connection) -> Result<(), TransportError> {
        let names = &self.names;
        let queue = self.settings.spec.queue.as_str();
        let channel = open_channel(names, connection).await?;
        let queue_type = match &self.settings.spec.declare {
            Some(declare) => {
                let options = QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                };
                call(
                    names,
                    "queue declare",
                    Addressed::Declare,
                    channel.queue_declare(
                        queue.into(),
                        options,
                        queue_type_argument(declare.queue_type),
                    ),
                )
                .await?;
                for binding in &declare.bindings {
                    call(
                        names,
                        "queue bind",
                        Addressed::Bindings,
                        channel.queue_bind(
                            queue.into(),
                            binding.exchange.as_str().into(),
                            binding.routing_key.as_str().into(),
                            QueueBindOptions::default(),
                            FieldTable::default(),
                        ),
                    )
                    .await?;
                }
                declare.queue_type
            }
            None => {
                let options = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                call(
                    names,
                    "queue declare (passive)",
                    Addressed::Queue,
                    channel.queue_declare(queue.into(), options, FieldTable::default()),
                )
                .await?;
                AmqpQueueType::Quorum
            }
        };
        let _ = channel.close(200, "declared".into()).await;
        if self.dead_letter_exchange.is_empty() {
            self.declare_dead_letter_queue(connection, queue_type)
                .await?;
        }
        Ok(())
    }

    /// Declares the default dead-letter queue when it does not exist (an existing one is left
    /// as it is, whatever its arguments).
    async fn declare_dead_letter_queue(
        &self,
        connection: &Connection,
        queue_type: AmqpQueueType,
    ) -> Result<(), TransportError> {
        let names = &self.names;
        let queue = self.dead_letter_routing_key.as_str();
        let channel = open_channel(names, connection).await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let exists = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await;
        match exists {
            Ok(_) => {
                let _ = channel.close(200, "declared".into()).await;
                return Ok(());
            }
            Err(err) if classify::reply_code(&err) == Some(404) => {}
            Err(err) => {
                return Err(names.error(
                    "dead-letter queue declare (passive)",
                    Addressed::DeadLetter,
                    err,
                ));
            }
        }
        let channel = open_channel(names, connection).await?;
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        call(
            names,
            "dead-letter queue declare",
            Addressed::DeadLetter,
            channel.queue_declare(queue.into(), options, queue_type_argument(queue_type)),
        )
        .await?;
        let _ = channel.close(200, "declared".into()).await;
        tracing::info!(queue, "declared the dead-letter queue");
        Ok(())
    }

    /// Opens a session: connection, declarations, the delivery-limit check, QoS and consumer.
    async fn open_session(&mut self) -> Result<(), TransportError> {
        let names = &self.names;
        let connection = connect(names, &self.url, &self.settings.consumer).await?;
        self.declare_queues(&connection).await?;
        delivery_limit::check(
            names,
            &connection,
            &self.settings.spec.queue,
            self.settings.max_deliveries,
        )
        .await?;
        let (consume, consumer) = self.subscribe(&connection).await?;
        self.generations += 1;
        self.metrics.sessions.inc();
        if self.generations == 1 {
            tracing::info!(
                queue = %self.settings.spec.queue,
                prefetch = self.prefetch(),
                dead_letters = %self.names.dead_letter,
                "RabbitMQ queue ready"
            );
        }
        self.buffer.clear();
        self.session = Some(Session {
            generation: self.generations,
            connection,
            consume,
            consumer,
            outstanding: BTreeMap::new(),
            last_delivery: Instant::now(),
        });
        self.held.record(&BTreeMap::new());
        Ok(())
    }

    /// What the pipeline holds at most: its batches in flight and the one being received. A
    /// prefetch of one batch would make every batch wait for the previous one's ack.
    fn prefetch(&self) -> u16 {
        u16::try_from(self.settings.batch_size.max(1) * (HELD + 1)).unwrap_or(u16::MAX)
    }

    /// A channel of `connection` with QoS and a consumer of the queue.
    async fn subscribe(
        &self,
        connection: &Connection,
    ) -> Result<(Channel, Consumer), TransportError> {
        let names = &self.names;
        let consume = open_channel(names, connection).await?;
        call(
            names,
            "basic.qos",
            Addressed::Connection,
            consume.basic_qos(self.prefetch(), BasicQosOptions::default()),
        )
        .await?;
        let consumer = call(
            names,
            "basic.consume",
            Addressed::Queue,
            consume.basic_consume(
                self.settings.spec.queue.as_str().into(),
                format!("switchboard-{}", self.settings.consumer).into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        Ok((consume, consumer))
    }

    /// Subscribes again on a new channel of the session's connection when the session has
    /// held nothing and received nothing for [`IDLE_RESUBSCRIBE`]. A consumer can be lost
    /// without a word: RabbitMQ 3.10 does not cancel a quorum queue's consumer when the queue is
    /// deleted and declared again, and then checks the new queue's messages out to the old
    /// consumer, which never delivers them. Closing its channel puts them back.
    async fn resubscribe_if_idle(&mut self) -> Result<(), TransportError> {
        let Some(session) = self.session.as_ref() else {
            return Ok(());
        };
        if !session.outstanding.is_empty()
            || !self.buffer.is_empty()
            || session.last_delivery.elapsed() < IDLE_RESUBSCRIBE
        {
            return Ok(());
        }
        let subscribed = self.subscribe(&session.connection).await;
        let Some(session) = self.session.as_mut() else {
            return Ok(());
        };
        let (consume, consumer) = match subscribed {
            Ok(subscribed) => subscribed,
            Err(err) => {
                self.lose_session();
                return Err(err);
            }
        };
        tracing::debug!("idle: subscribed again on a new channel");
        let old = std::mem::replace(&mut session.consume, consume);
        session.consumer = consumer;
        self.generations += 1;
        session.generation = self.generations;
        session.last_delivery = Instant::now();
        let _ = tokio::time::timeout(CALL_TIMEOUT, old.close(200, "resubscribed".into())).await;
        Ok(())
    }

    /// The live session, opened if there is none (or the last one failed).
    async fn session(&mut self) -> Result<&mut Session, TransportError> {
        if self.session.as_ref().is_some_and(|s| !s.alive()) {
            self.lose_session();
        }
        if self.session.is_none() {
            self.open_session().await?;
        }
        self.session
            .as_mut()
            .ok_or_else(|| TransportError::protocol("no RabbitMQ session"))
    }

    /// Drops the session: RabbitMQ puts back what it held, and its receipts become stale.
    fn lose_session(&mut self) {
        self.buffer.clear();
        if let Some(session) = self.session.take() {
            self.held.record(&BTreeMap::new());
            crate::task::spawn(async move {
                let _ = tokio::time::timeout(
                    CALL_TIMEOUT,
                    session.connection.close(200, "reconnecting".into()),
                )
                .await;
            });
        }
    }

    /// Takes deliveries from the consumer into the buffer: with `block`, waits up to [`BLOCK`]
    /// for the first, then up to [`GATHER`] for the rest; without, only what has arrived.
    async fn fill(&mut self, max: usize, block: bool) -> Result<(), TransportError> {
        let started = Instant::now();
        let mut gather_until = (!self.buffer.is_empty()).then(|| started + GATHER);
        self.session().await?;
        let Self {
            session,
            buffer,
            names,
            held,
            ..
        } = self;
        let Some(session) = session.as_mut() else {
            return Err(TransportError::protocol("no RabbitMQ session"));
        };
        let mut buffered = Vec::new();
        let mut failure = None;
        while buffer.len() + buffered.len() < max {
            let until = gather_until.unwrap_or(started + BLOCK);
            // A delivery already buffered is taken without arming a timer.
            let next = match session.consumer.next().now_or_never() {
                Some(next) => Some(next),
                None if block && until > Instant::now() => {
                    tokio::time::timeout_at(until.into(), session.consumer.next())
                        .await
                        .ok()
                }
                None => None,
            };
            match next {
                None => break,
                Some(Some(Ok(delivery))) => {
                    session.last_delivery = Instant::now();
                    session.outstanding.insert(delivery.delivery_tag, now_ms());
                    buffered.push(delivery);
                    gather_until.get_or_insert_with(|| Instant::now() + GATHER);
                }
                Some(Some(Err(err))) => {
                    failure = Some(names.error("consume", Addressed::Queue, err));
                    break;
                }
                Some(None) => {
                    failure = Some(TransportError::protocol(
                        "RabbitMQ cancelled the consumer (was the queue deleted?)",
                    ));
                    break;
                }
            }
        }
        held.record(&session.outstanding);
        buffer.extend(buffered);
        if let Some(err) = failure {
            self.lose_session();
            return Err(err);
        }
        Ok(())
    }

    /// Publishes every classic-queue redelivery of the buffer again with its count one higher,
    /// waits for the confirms, then acknowledges the redelivered copies and drops them from
    /// the buffer. A redelivery whose copy is not confirmed (refused, blocked, unconfirmed)
    /// stays in the buffer and is delivered with its count as it stands: storing never waits
    /// on this publish.
    async fn recount_redeliveries(&mut self) -> Result<(), TransportError> {
        let recounts: Vec<(usize, BasicProperties)> = self
            .buffer
            .iter()
            .enumerate()
            .filter_map(|(index, d)| {
                match delivery::count(d.redelivered, d.properties.headers().as_ref()) {
                    Count::Recount { next } => Some((index, next)),
                    Count::Known(_) => None,
                }
            })
            .map(|(index, next)| {
                let d = &self.buffer[index];
                let original = Original {
                    exchange: d.exchange.as_str().to_owned(),
                    routing_key: d.routing_key.as_str().to_owned(),
                    properties: d.properties.clone(),
                };
                (index, dead_letter::recounted(&original, next))
            })
            .collect();
        if recounts.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = recounts
            .iter()
            .map(|(index, _)| {
                format!(
                    "recount:{}:{}",
                    self.generations, self.buffer[*index].delivery_tag
                )
            })
            .collect();
        let queue = self.settings.spec.queue.as_str();
        let failure = if self.publisher.blocked() {
            Some(TransportError::protocol(
                "RabbitMQ blocks the publishing connection (a resource alarm)",
            ))
        } else {
            let outgoing: Vec<Outgoing<'_>> = recounts
                .iter()
                .zip(&keys)
                .map(|((index, properties), key)| Outgoing {
                    key,
                    exchange: "",
                    routing_key: queue,
                    body: &self.buffer[*index].data,
                    properties,
                })
                .collect();
            let published = self
                .publisher
                .publish("re-publish of a redelivery", Addressed::Queue, &outgoing)
                .await;
            match published.retry {
                Some(err) if err.is_fatal() => return Err(err),
                Some(err) => Some(err),
                None => published.refusal.map(TransportError::protocol),
            }
        };
        let mut confirmed = std::collections::HashSet::new();
        for ((index, _), key) in recounts.iter().zip(&keys) {
            if self.publisher.confirmed(key) {
                confirmed.insert(*index);
            }
            self.publisher.forget(key);
        }
        if confirmed.len() < recounts.len() {
            self.metrics
                .not_recounted
                .inc_by((recounts.len() - confirmed.len()) as u64);
            if !self.recount_failing {
                self.recount_failing = true;
                let error = failure.map(|err| err.to_string()).unwrap_or_default();
                tracing::warn!(
                    %error,
                    "classic-queue redeliveries are delivered without publishing them again with their count; a crash before they are stored does not count"
                );
            }
        } else if std::mem::take(&mut self.recount_failing) {
            tracing::info!("classic-queue redeliveries are recounted again");
        }
        if confirmed.is_empty() {
            return Ok(());
        }
        self.ack_recounted(&confirmed).await?;
        self.metrics.recounted.inc_by(confirmed.len() as u64);
        Ok(())
    }

    /// Acknowledges the redelivered copies at `indexes` of the buffer (their recounted copies
    /// are confirmed) and drops them from it.
    async fn ack_recounted(
        &mut self,
        indexes: &std::collections::HashSet<usize>,
    ) -> Result<(), TransportError> {
        let Some(session) = self.session.as_mut() else {
            return Err(TransportError::protocol("no RabbitMQ session"));
        };
        let mut result = Ok(());
        for &index in indexes {
            let tag = self.buffer[index].delivery_tag;
            result = call(
                &self.names,
                "basic.ack",
                Addressed::Queue,
                session.consume.basic_ack(tag, BasicAckOptions::default()),
            )
            .await;
            if result.is_err() {
                break;
            }
            session.outstanding.remove(&tag);
        }
        self.held.record(&session.outstanding);
        if let Err(err) = result {
            self.lose_session();
            return Err(err);
        }
        let mut index = 0;
        self.buffer.retain(|_| {
            let keep = !indexes.contains(&index);
            index += 1;
            keep
        });
        Ok(())
    }
}

impl Transport for Amqp {
    type Receipt = Receipt;
    type Probe = AmqpProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.session().await.map(drop)
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<AmqpDelivery>, TransportError> {
        self.fill(max.max(1), block).await?;
        self.recount_redeliveries().await?;
        let origin = Origin {
            source: &self.source,
            queue: &self.settings.spec.queue,
            channel: self.generations,
        };
        Ok(std::mem::take(&mut self.buffer)
            .into_iter()
            .map(|d| {
                let count = match delivery::count(d.redelivered, d.properties.headers().as_ref()) {
                    Count::Known(count) => count,
                    Count::Recount { next } => next,
                };
                let original = Original {
                    exchange: d.exchange.to_string(),
                    routing_key: d.routing_key.to_string(),
                    properties: d.properties,
                };
                delivery::convert(origin, d.delivery_tag, original, d.data, count)
            })
            .collect())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let last_seen = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let (queue, consumer) = (
            self.settings.spec.queue.clone(),
            self.settings.consumer.clone(),
        );
        let context = WriteContext {
            queue: &queue,
            consumer: &consumer,
            last_seen: &last_seen,
        };
        let properties: Vec<BasicProperties> = letters
            .iter()
            .map(|letter| {
                let message = letter.message;
                dead_letter::properties(
                    &message.receipt.original,
                    LetterContext {
                        message_id: &message.external_id,
                        reason: letter.reason,
                        error: &letter.error,
                        delivery_count: message.delivery_count,
                        first_seen_ms: message.enqueued_at_ms,
                        attempts: &letter.attempts,
                    },
                    context,
                )
            })
            .collect();
        let outgoing: Vec<Outgoing<'_>> = letters
            .iter()
            .zip(&properties)
            .map(|(letter, properties)| Outgoing {
                key: &letter.message.idempotency_key,
                exchange: &self.dead_letter_exchange,
                routing_key: &self.dead_letter_routing_key,
                body: &letter.message.body,
                properties,
            })
            .collect();
        let published = self
            .publisher
            .publish("dead-letter publish", Addressed::DeadLetter, &outgoing)
            .await;
        // Refused letters are handed back only once every other letter is written.
        match (published.retry, published.refused.is_empty()) {
            (Some(err), _) => Err(err),
            (None, false) => Err(TransportError::dead_letters_refused(
                published.refused,
                format!(
                    "{} refused dead letters for good: {}",
                    self.names.dead_letter,
                    published.refusal.unwrap_or_default()
                ),
                None,
            )),
            (None, true) => Ok(()),
        }
    }

    async fn ack(&mut self, messages: &[&AmqpDelivery]) -> Result<Acked, TransportError> {
        let mut acked = Acked::all();
        let Some(session) = self.session.as_mut() else {
            return Err(TransportError::stale(
                "the channel these deliveries came on is gone",
                None,
            ));
        };
        let mut settled = BTreeSet::new();
        let mut index_of = HashMap::new();
        for (index, message) in messages.iter().enumerate() {
            let tag = message.receipt.tag;
            if message.receipt.channel == session.generation
                && session.outstanding.contains_key(&tag)
            {
                settled.insert(tag);
                index_of.insert(tag, index);
            } else {
                acked.stale.push(index);
            }
        }
        let mut lost = false;
        for frame in acks::plan(&session.outstanding, &settled) {
            let covered = acks::covered(&session.outstanding, frame);
            let options = BasicAckOptions {
                multiple: frame.multiple,
            };
            match tokio::time::timeout(CALL_TIMEOUT, session.consume.basic_ack(frame.tag, options))
                .await
            {
                Ok(Ok(())) => {
                    for tag in covered {
                        session.outstanding.remove(&tag);
                    }
                }
                // The channel is gone (or hangs): RabbitMQ puts back what it held.
                _ => {
                    lost = true;
                    break;
                }
            }
        }
        if lost {
            acked.stale.extend(
                settled
                    .iter()
                    .filter(|tag| session.outstanding.contains_key(tag))
                    .map(|tag| index_of[tag]),
            );
            acked.stale.sort_unstable();
            self.lose_session();
        } else {
            self.held.record(&session.outstanding);
        }
        // A message acknowledged needs no memory of its dead letter's publish any more.
        for (index, message) in messages.iter().enumerate() {
            if acked.stale.binary_search(&index).is_err() {
                self.publisher.forget(&message.idempotency_key);
            }
        }
        Ok(acked)
    }

    fn broker_dead_letters(&self) -> bool {
        false
    }

    /// Reopens a lost session, so that the loop sees an outage as such between receives, and
    /// subscribes again after a long idle spell.
    async fn maintain(&mut self) -> Result<(), TransportError> {
        self.session().await?;
        self.resubscribe_if_idle().await
    }

    fn maintenance_interval(&self) -> Duration {
        MAINTENANCE_INTERVAL
    }

    fn probe(&self) -> AmqpProbe {
        AmqpProbe {
            url: self.url.clone(),
            name: format!("{} (queue health)", self.settings.consumer),
            names: self.names.clone(),
            connection: None,
            dead_letter_queue: self
                .dead_letter_exchange
                .is_empty()
                .then(|| self.dead_letter_routing_key.clone()),
            held: self.held.clone(),
            consumers: self.metrics.consumers.clone(),
        }
    }

    async fn shutdown(&mut self) {
        self.buffer.clear();
        self.publisher.shutdown().await;
        if let Some(session) = self.session.take() {
            let _ = tokio::time::timeout(
                CALL_TIMEOUT,
                session.connection.close(200, "worker stopped".into()),
            )
            .await;
        }
    }
}

/// Reads the queue's depth with a passive declare on its own connection.
pub struct AmqpProbe {
    url: String,
    name: String,
    names: Names,
    connection: Option<Connection>,
    /// The default dead-letter queue; `None` when dead letters go to an exchange.
    dead_letter_queue: Option<String>,
    held: Arc<Held>,
    consumers: Gauge,
}

impl AmqpProbe {
    /// The passive declare of `queue` on a channel of its own (a missing queue closes it).
    async fn declare_passive(&self, queue: &str) -> Result<lapin::Queue, TransportError> {
        let Some(connection) = self.connection.as_ref() else {
            return Err(TransportError::protocol("no RabbitMQ connection"));
        };
        declare_passive(&self.names, connection, queue).await
    }

    async fn read(&mut self) -> Result<lapin::Queue, TransportError> {
        if self
            .connection
            .as_ref()
            .is_none_or(|c| !c.status().connected())
        {
            self.connection = Some(connect(&self.names, &self.url, &self.name).await?);
        }
        self.declare_passive(&self.names.queue).await
    }
}

impl QueueProbe for AmqpProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let queue = match self.read().await {
            Ok(queue) => queue,
            Err(err) => {
                self.connection = None;
                return Err(err);
            }
        };
        self.consumers.set(i64::from(queue.consumer_count()));
        // The dead-letter queue's depth is for the gauge only: failing to read it is not an
        // outage of the source.
        let dead_letters = match &self.dead_letter_queue {
            Some(dlq) => self
                .declare_passive(dlq)
                .await
                .ok()
                .map(|declared| u64::from(declared.message_count())),
            None => None,
        };
        Ok(QueueHealth {
            backlog: Some(u64::from(queue.message_count())),
            pending: Some(self.held.count.load(Ordering::Relaxed)),
            oldest_pending_age: Some(self.held.oldest_age()),
            dead_letters,
            oldest_dead_letter_age: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> AmqpSettings {
        AmqpSettings {
            adapter: "shop/orders".into(),
            consumer: "worker-0".into(),
            spec: serde_json::from_value(serde_json::json!({"queue": "orders"})).expect("spec"),
            dead_letter_exchange: None,
            dead_letter_routing_key: None,
            batch_size: 10,
            max_deliveries: 5,
        }
    }

    #[test]
    fn malformed_url_is_fatal_without_echoing_it() {
        let err = Amqp::new(
            settings(),
            "rabbit://guest:s3cret@host".into(),
            &mut Registry::default(),
        )
        .expect_err("fatal");
        assert!(err.is_fatal());
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(err.to_string().starts_with(URL_SETTING), "{err}");
    }

    #[test]
    fn default_dead_letters_go_to_the_queue_dlq_else_to_the_exchange() {
        let amqp = Amqp::new(
            settings(),
            "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            &mut Registry::default(),
        )
        .expect("builds");
        assert_eq!(amqp.source(), "amqp:shop/orders");
        assert_eq!(
            (
                amqp.dead_letter_exchange.as_str(),
                amqp.dead_letter_routing_key.as_str()
            ),
            ("", "orders.dlq")
        );
        let mut with_exchange = settings();
        with_exchange.dead_letter_exchange = Some("dead".into());
        let amqp = Amqp::new(
            with_exchange,
            "amqps://broker.example:5671/shop".into(),
            &mut Registry::default(),
        )
        .expect("builds");
        assert_eq!(amqp.dead_letter_routing_key, "orders");
    }
}
