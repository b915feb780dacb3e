//! The AMQP transport's own metrics: redeliveries recounted or not, sessions opened (every one
//! after the first a reconnection), the queue's consumers and whether RabbitMQ blocks the publishing connection.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{adapter_counter, adapter_gauge, broker_reconnects};

/// The AMQP transport's own metrics.
#[derive(Debug, Clone)]
pub struct AmqpMetrics {
    pub recounted: Counter,
    pub not_recounted: Counter,
    /// Deprecated: 1 + `reconnects`.
    sessions: Counter,
    reconnects: Counter,
    pub consumers: Gauge,
    pub publishing_blocked: Gauge,
}

impl AmqpMetrics {
    pub fn register(registry: &mut Registry, adapter: &str) -> Self {
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
                "Connections (with their consumer and publisher channels) opened to RabbitMQ: 1 + switchboard_broker_reconnects_total (deprecated, removed in the next release)",
                adapter,
            ),
            reconnects: broker_reconnects(registry, adapter, None),
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

    /// A session (connection and consumer) opened: every one after the first is a reconnection.
    pub fn session_opened(&self) {
        if self.sessions.get() > 0 {
            self.reconnects.inc();
        }
        self.sessions.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Metrics, assert_exported};

    #[test]
    fn every_session_after_the_first_is_a_broker_reconnection() {
        let mut registry = Metrics::registry();
        let metrics = AmqpMetrics::register(&mut registry, "a/b");
        for _ in 0..3 {
            metrics.session_opened();
        }
        assert_exported(
            &registry,
            &[
                r#"switchboard_broker_reconnects_total{adapter="a/b"} 2"#,
                r#"switchboard_amqp_sessions_opened_total{adapter="a/b"} 3"#,
            ],
        );
    }
}
