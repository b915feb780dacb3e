//! Receiving: deliveries taken from the session's consumer into the transport's buffer (kept
//! there until they are returned, so a dropped `receive` loses none), then converted to the
//! pipeline's messages with their delivery count.

use std::time::Instant;

use futures::{FutureExt as _, StreamExt as _};

use super::classify::Addressed;
use super::delivery::{self, AmqpDelivery, Count, Origin, Original};
use super::{Amqp, BLOCK, GATHER};
use crate::health::now_ms;
use crate::transport::TransportError;

impl Amqp {
    /// Takes deliveries from the consumer into the buffer: with `block`, waits up to [`BLOCK`]
    /// for the first, then up to [`GATHER`] for the rest; without, only what has arrived.
    pub(super) async fn fill(&mut self, max: usize, block: bool) -> Result<(), TransportError> {
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

    /// Empties the buffer into messages of the current channel generation, each with its
    /// delivery count (a redelivery not recounted counts as it would have been).
    pub(super) fn take_buffer(&mut self) -> Vec<AmqpDelivery> {
        let origin = Origin {
            key_scope: &self.key_scope,
            channel: self.generations,
        };
        std::mem::take(&mut self.buffer)
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
            .collect()
    }
}
