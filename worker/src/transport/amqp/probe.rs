//! Queue health: a passive declare on the probe's own connection (`message_count` is the ready
//! backlog, `consumer_count` a gauge) and of the default dead-letter queue for its depth;
//! pending is what this worker holds.
//!
//! The oldest dead letter's age is that of the dead-letter queue's head: AMQP 0-9-1 cannot look at
//! a message without delivering it, so the probe takes the head (`basic.get`) on a channel of its
//! own and gives it back at once by closing the channel, which puts it back in its place in a
//! quorum and a classic queue alike, so the head stays the head ([`AmqpProbe::read_head`]). The
//! probe reads it when it has no reading, when the queue's depth fell (the head may have left) and
//! at most once a [`HEAD_READ_INTERVAL`] otherwise; between readings the age grows with the clock.
//! Each reading is a delivery: a quorum queue's `x-delivery-count` of the head letter grows by one
//! a reading (about 1,440 a day), harmless where returns count toward no limit — RabbitMQ 3.x
//! without a delivery limit on the dead-letter queue, classic queues, 4.3 and later. RabbitMQ 4.0
//! to 4.2 count every return toward a quorum queue's delivery limit (20 by default) and would drop
//! the letter, so there the probe never reads it and the gauge is not set
//! ([`head_reading_refused`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lapin::Connection;
use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, FieldTable};
use prometheus_client::metrics::gauge::Gauge;

use super::Amqp;
use super::classify::{Addressed, Names};
use super::connection::{call, connect, connect_small, declare_passive, open_channel};
use super::reader::dead_lettered_at_ms;
use crate::health::now_ms;
use crate::transport::{QueueHealth, QueueProbe, TransportError};

/// What this worker holds un-acknowledged, shared with the probe.
#[derive(Debug, Default)]
pub struct Held {
    count: AtomicU64,
    /// When the oldest held delivery arrived (Unix ms), 0 when none.
    oldest_ms: AtomicU64,
}

impl Held {
    pub fn record(&self, outstanding: &BTreeMap<u64, u64>) {
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

/// The head letter of the dead-letter queue is read again after this long at the latest.
const HEAD_READ_INTERVAL: Duration = Duration::from_secs(60);

/// The dead-letter queue's head letter as last read.
#[derive(Debug, Clone, Copy)]
struct Head {
    /// When it was dead-lettered (Unix ms); for a letter that carries no time, when the probe
    /// first found an untimed head.
    at_ms: u64,
    untimed: bool,
    /// The queue's depth at the last probe that kept this reading.
    depth: u64,
    read: Instant,
}

/// Reads the queue's depth with a passive declare on its own connection.
pub struct AmqpProbe {
    url: String,
    name: String,
    names: Names,
    connection: Option<Connection>,
    /// The default dead-letter queue; `None` when dead letters go to an exchange.
    dead_letter_queue: Option<String>,
    head: Option<Head>,
    /// Why the head may not be read on this connection's server, if it may not.
    head_refused: Option<String>,
    head_refusal_said: bool,
    held: Arc<Held>,
    consumers: Gauge,
}

impl Amqp {
    /// The probe of this transport's queues, on a connection of its own.
    pub(super) fn new_probe(&self) -> AmqpProbe {
        AmqpProbe {
            url: self.url.clone(),
            name: format!("{} (queue health)", self.settings.consumer),
            names: self.names.clone(),
            connection: None,
            dead_letter_queue: self
                .dead_letter_exchange
                .is_empty()
                .then(|| self.dead_letter_routing_key.clone()),
            head: None,
            head_refused: None,
            head_refusal_said: false,
            held: self.held.clone(),
            consumers: self.metrics.consumers.clone(),
        }
    }
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
            // Reading a letter needs its properties in one frame: the server's frame size.
            let connection = match self.dead_letter_queue {
                Some(_) => connect(&self.names, &self.url, &self.name).await?,
                None => connect_small(&self.names, &self.url, &self.name).await?,
            };
            self.head_refused =
                head_reading_refused(&connection.configuration().server_properties());
            self.connection = Some(connection);
        }
        self.declare_passive(&self.names.queue).await
    }

    /// The age of the oldest dead letter, the dead-letter queue's head, when it holds `depth`
    /// (> 0) letters; `None` when it cannot be read.
    async fn oldest_dead_letter_age(&mut self, queue: &str, depth: u64) -> Option<Duration> {
        if let Some(refused) = &self.head_refused {
            if !self.head_refusal_said {
                self.head_refusal_said = true;
                tracing::info!(
                    queue,
                    "switchboard_oldest_dead_letter_age_seconds is not set: {refused} (docs/brokers/rabbitmq.md)"
                );
            }
            return None;
        }
        let kept = self
            .head
            .as_mut()
            .filter(|head| depth >= head.depth && head.read.elapsed() < HEAD_READ_INTERVAL);
        if let Some(head) = kept {
            head.depth = depth;
        } else {
            match self.read_head(queue).await {
                Ok(Some(at_ms)) => {
                    let untimed_since =
                        self.head.filter(|head| head.untimed).map(|head| head.at_ms);
                    self.head = Some(Head {
                        at_ms: at_ms.or(untimed_since).unwrap_or_else(now_ms),
                        untimed: at_ms.is_none(),
                        depth,
                        read: Instant::now(),
                    });
                }
                // Every letter is held (by a `dlq` command): the last reading stands.
                Ok(None) => {}
                Err(err) => {
                    tracing::debug!(error = %err, queue, "could not read the dead-letter queue's head");
                    return None;
                }
            }
        }
        let head = self.head?;
        Some(Duration::from_millis(now_ms().saturating_sub(head.at_ms)))
    }

    /// Takes the head letter of `queue` on a channel of its own and gives it back by closing the
    /// channel: `Some` of when it was dead-lettered (`None` inside when it carries no time),
    /// `None` when no letter is ready. Closing, not `basic.nack`: a quorum queue (3.10,
    /// observed) puts a letter given back by `basic.nack` behind the ready ones, which would
    /// rotate the queue a reading at a time; one given back by a closed channel goes back to
    /// the front.
    async fn read_head(&self, queue: &str) -> Result<Option<Option<u64>>, TransportError> {
        let Some(connection) = self.connection.as_ref() else {
            return Err(TransportError::protocol("no RabbitMQ connection"));
        };
        let channel = open_channel(&self.names, connection).await?;
        let got = call(
            &self.names,
            "dead letter read for its age (basic.get)",
            Addressed::DeadLetter,
            channel.basic_get(queue.into(), BasicGetOptions { no_ack: false }),
        )
        .await;
        let closed = call(
            &self.names,
            "dead letter given back (channel close)",
            Addressed::DeadLetter,
            channel.close(200, "read the head letter's age".into()),
        )
        .await;
        let head = got?.map(|message| dead_lettered_at_ms(&message.delivery.properties));
        closed?;
        Ok(head)
    }
}

/// Why the probe may not read the dead-letter queue's head on the server that sent
/// `properties` in `connection.start`, if it may not: RabbitMQ 4.0 to 4.2 count every letter
/// given back toward a quorum queue's delivery limit (rabbitmq-server#11937), and a server that
/// does not say it is RabbitMQ with a version is not assumed to be safe.
fn head_reading_refused(properties: &FieldTable) -> Option<String> {
    let text = |name: &str| match properties.inner().get(name) {
        Some(AMQPValue::LongString(value)) => Some(value.to_string()),
        _ => None,
    };
    let (product, version) = (text("product"), text("version"));
    let numbers = version.as_deref().and_then(|version| {
        let mut parts = version.split(['.', '-', '+']).map(str::parse::<u32>);
        Some((parts.next()?.ok()?, parts.next()?.ok()?))
    });
    match (product.as_deref(), numbers) {
        (Some("RabbitMQ"), Some((major, minor))) if major != 4 || minor >= 3 => None,
        (Some("RabbitMQ"), Some(_)) => Some(format!(
            "RabbitMQ {} counts every read of a quorum queue's letter toward its delivery limit, so the dead-letter queue's head is not read",
            version.unwrap_or_default()
        )),
        _ => Some(format!(
            "the server ({} {}) is not known to give a letter back without counting it toward a delivery limit, so the dead-letter queue's head is not read",
            product.as_deref().unwrap_or("no product"),
            version.as_deref().unwrap_or("no version")
        )),
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
        let (dead_letters, oldest_dead_letter_age) = match self.dead_letter_queue.clone() {
            Some(dlq) => match self.declare_passive(&dlq).await {
                Ok(declared) => {
                    let depth = u64::from(declared.message_count());
                    let age = match depth {
                        0 => {
                            self.head = None;
                            Some(Duration::ZERO)
                        }
                        depth => self.oldest_dead_letter_age(&dlq, depth).await,
                    };
                    (Some(depth), age)
                }
                Err(_) => (None, None),
            },
            None => (None, None),
        };
        Ok(QueueHealth {
            backlog: Some(u64::from(queue.message_count())),
            pending: Some(self.held.count.load(Ordering::Relaxed)),
            oldest_pending_age: Some(self.held.oldest_age()),
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(product: &str, version: &str) -> FieldTable {
        let mut properties = FieldTable::default();
        for (name, value) in [("product", product), ("version", version)] {
            properties.insert(name.into(), AMQPValue::LongString(value.into()));
        }
        properties
    }

    #[test]
    fn the_head_is_read_only_where_a_letter_given_back_cannot_reach_a_delivery_limit() {
        for version in ["3.10.8", "3.13.7", "4.3.0", "4.3.0-rc.1", "5.0.1"] {
            assert_eq!(
                head_reading_refused(&server("RabbitMQ", version)),
                None,
                "{version}"
            );
        }
        for version in ["4.0.0", "4.1.4", "4.2.0-beta.2", "4", "four"] {
            assert!(
                head_reading_refused(&server("RabbitMQ", version)).is_some(),
                "{version}"
            );
        }
        let other = head_reading_refused(&server("LavinMQ", "2.1.0")).unwrap_or_default();
        assert!(other.contains("LavinMQ 2.1.0"), "{other}");
        assert!(head_reading_refused(&FieldTable::default()).is_some());
    }
}
