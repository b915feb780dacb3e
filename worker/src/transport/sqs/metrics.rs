//! The SQS transport's own counters: FIFO messages released behind one that could not be
//! delivered, and messages SQS delivered without a receipt handle.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;

use crate::metrics::adapter_counter;

/// The SQS transport's own counters.
#[derive(Debug, Clone)]
pub struct SqsMetrics {
    pub released: Counter,
    pub without_receipt: Counter,
}

impl SqsMetrics {
    pub fn register(registry: &mut Registry, adapter: &str) -> Self {
        Self {
            released: adapter_counter(
                registry,
                "sqs_fifo_messages_released",
                "FIFO messages made visible again because an earlier message of their group in the same receive could not be delivered",
                adapter,
            ),
            without_receipt: adapter_counter(
                registry,
                "sqs_messages_without_receipt",
                "Messages SQS delivered without a receipt handle (skipped; redelivered when their visibility expires)",
                adapter,
            ),
        }
    }
}
