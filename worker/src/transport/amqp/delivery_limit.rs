//! The worker owns redelivery limits: a quorum queue whose `x-delivery-limit` is below
//! `spec.delivery.maxDeliveries` would have RabbitMQ drop (or dead-letter to the queue's own
//! `x-dead-letter-exchange`) a message the worker has not stored or dead-lettered. Refused at
//! start, naming both settings. The argument is read as [`arguments`] can: a `delivery-limit`
//! set by a policy, and queues the user may not configure, are not checked (said once).

use lapin::Connection;
use lapin::types::AMQPValue;

use super::arguments::{self, Found, integer};
use super::classify::Names;
use crate::transport::TransportError;

/// The queue argument RabbitMQ limits deliveries with (quorum queues).
pub const DELIVERY_LIMIT: &str = "x-delivery-limit";

/// Fails fatally when `queue` has an `x-delivery-limit` argument below `max_deliveries`.
pub async fn check(
    names: &Names,
    connection: &Connection,
    queue: &str,
    max_deliveries: u64,
) -> Result<(), TransportError> {
    match arguments::read(names, connection, queue, DELIVERY_LIMIT).await? {
        Found::Value(Some(value)) => compare(queue, &value, max_deliveries),
        Found::Value(None) => Ok(()),
        Found::Forbidden => {
            tracing::info!(
                queue,
                "cannot check the queue's x-delivery-limit (declaring needs the configure permission); make sure no delivery limit below spec.delivery.maxDeliveries applies"
            );
            Ok(())
        }
        Found::Unreadable => {
            tracing::info!(
                queue,
                "could not read the queue's arguments to check its x-delivery-limit; make sure no delivery limit below spec.delivery.maxDeliveries applies"
            );
            Ok(())
        }
    }
}

/// Fails fatally when the queue's `x-delivery-limit` `value` is below `max_deliveries`.
fn compare(queue: &str, value: &AMQPValue, max_deliveries: u64) -> Result<(), TransportError> {
    match integer(value) {
        Some(limit) if u64::try_from(limit).is_ok_and(|limit| limit < max_deliveries) => {
            Err(TransportError::fatal(
                "spec.delivery.maxDeliveries",
                format!(
                    "the queue {queue:?} has x-delivery-limit {limit}, below spec.delivery.maxDeliveries {max_deliveries}: RabbitMQ would drop or dead-letter messages the worker has not stored; remove the queue's x-delivery-limit or raise it to at least {max_deliveries}, or lower maxDeliveries"
                ),
                None,
            ))
        }
        _ => Ok(()),
    }
}
