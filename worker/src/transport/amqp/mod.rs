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
mod arguments;
mod classify;
mod connection;
mod consume;
pub(crate) mod dead_letter;
mod declare;
mod delivery;
mod delivery_limit;
mod frame;
mod metrics;
mod probe;
mod publisher;
pub mod reader;
mod recount;
mod session;

use std::sync::Arc;
use std::time::Duration;

use lapin::BasicProperties;
use prometheus_client::registry::Registry;
use switchboard_api::AmqpSource;
use switchboard_store::Dedup;

use self::classify::{Addressed, Names};
use self::dead_letter::WriteContext;
use self::delivery::AmqpDelivery;
pub use self::delivery::Receipt;
use self::metrics::AmqpMetrics;
pub use self::probe::AmqpProbe;
use self::probe::Held;
use self::publisher::{Outgoing, Publisher};
use self::session::Session;
use crate::transport::retention::Retention;
use crate::transport::{Acked, DeadLetter, Transport, TransportError};

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
    /// `retentionDays` and `acceptShorterRetention`: the default dead-letter queue's
    /// `x-message-ttl`.
    pub dead_letter_retention: Retention,
}

/// The AMQP transport.
pub struct Amqp {
    settings: AmqpSettings,
    source: String,
    /// `amqp:{adapter}:{queue}`: a `message-id` is unique within its queue.
    key_scope: String,
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

impl Amqp {
    /// Checks the settings (no network yet).
    pub fn new(
        settings: AmqpSettings,
        url: String,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        connection::check_url(&url)?;
        let (dead_letter_exchange, dead_letter_routing_key, names) = dead_letter_route(
            &settings.spec.queue,
            settings.dead_letter_exchange.as_deref(),
            settings.dead_letter_routing_key.as_deref(),
        );
        let metrics = AmqpMetrics::register(registry, &settings.adapter);
        let publisher = Publisher::new(
            url.clone(),
            format!("{} (publishing)", settings.consumer),
            names.clone(),
            metrics.publishing_blocked.clone(),
        );
        Ok(Self {
            source: format!("amqp:{}", settings.adapter),
            key_scope: format!("amqp:{}:{}", settings.adapter, settings.spec.queue),
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
}

/// Where the dead letters of `queue` go: the exchange (`""`: the default exchange, to the queue
/// named by the routing key), the routing key (default: `<queue>.dlq`, or the queue's name with
/// an exchange), and the names errors use.
fn dead_letter_route(
    queue: &str,
    exchange: Option<&str>,
    routing_key: Option<&str>,
) -> (String, String, Names) {
    let exchange = exchange.unwrap_or_default().to_owned();
    let routing_key = routing_key.map_or_else(
        || match exchange.as_str() {
            "" => format!("{queue}.dlq"),
            _ => queue.to_owned(),
        },
        str::to_owned,
    );
    let names = Names {
        queue: queue.to_owned(),
        dead_letter: match exchange.as_str() {
            "" => format!("queue {routing_key:?}"),
            exchange => format!("exchange {exchange:?} (routing key {routing_key:?})"),
        },
        dead_letter_setting: "spec.delivery.deadLetter.exchange",
    };
    (exchange, routing_key, names)
}

impl Transport for Amqp {
    type Receipt = Receipt;
    type Probe = AmqpProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        crate::transport::endpoint::endpoints(&self.url)
    }

    fn key_scope(&self) -> &str {
        &self.key_scope
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
        Ok(self.take_buffer())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let last_seen = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let context = WriteContext {
            queue: &self.settings.spec.queue,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
        };
        let properties: Vec<BasicProperties> = letters
            .iter()
            .map(|letter| dead_letter::properties(letter, context))
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
        self.acknowledge(messages).await
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
        self.new_probe()
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

#[cfg(test)]
mod tests {
    use super::classify::URL_SETTING;
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
            dead_letter_retention: Retention::of(&switchboard_api::DeadLetter::default()),
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
