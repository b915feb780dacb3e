//! Queue health: a passive declare on the probe's own connection (`message_count` is the ready
//! backlog, `consumer_count` a gauge) and of the default dead-letter queue for its depth;
//! pending is what this worker holds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lapin::Connection;
use prometheus_client::metrics::gauge::Gauge;

use super::Amqp;
use super::classify::Names;
use super::connection::{connect_small, declare_passive};
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
            self.connection = Some(connect_small(&self.names, &self.url, &self.name).await?);
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
