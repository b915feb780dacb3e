//! The AMQP transport's own metrics: redeliveries recounted or not, sessions opened, the
//! queue's consumers and whether RabbitMQ blocks the publishing connection.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{adapter_counter, adapter_gauge};

/// The AMQP transport's own metrics.
#[derive(Debug, Clone)]
pub struct AmqpMetrics {
    pub recounted: Counter,
    pub not_recounted: Counter,
    pub sessions: Counter,
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
