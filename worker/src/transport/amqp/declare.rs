//! Declaring the queues a session needs: the source queue (checked, or declared with its type
//! and bindings) and the default dead-letter queue `<queue>.dlq` when it does not exist, with
//! `x-message-ttl` = `deadLetter.retentionDays` (honoured by classic and, since RabbitMQ 3.10,
//! quorum queues; RabbitMQ takes at most 2^32 − 1 ms, about 49 days: a longer retention is
//! declared without a TTL, kept until removed). Queue arguments cannot be changed: an existing
//! dead-letter queue whose `x-message-ttl` is shorter (read as [`arguments`] can) is fatal
//! naming the setting, unless `acceptShorterRetention`. A TTL set by a policy is not seen.

use lapin::Connection;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use switchboard_api::{AmqpDeclare, AmqpQueueType};

use super::Amqp;
use super::arguments::{self, Found, integer};
use super::classify::{self, Addressed};
use super::connection::{call, open_channel};
use crate::transport::TransportError;

/// The argument RabbitMQ expires messages of a queue with, in milliseconds.
const MESSAGE_TTL: &str = "x-message-ttl";

fn queue_type_argument(queue_type: AmqpQueueType) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from(queue_type.as_str().as_bytes().to_vec())),
    );
    arguments
}

impl Amqp {
    /// Declares (or checks) the source queue and the default dead-letter queue, each on a
    /// channel of its own: a refused declare closes its channel.
    pub(super) async fn declare_queues(
        &self,
        connection: &Connection,
    ) -> Result<(), TransportError> {
        let names = &self.names;
        let queue = self.settings.spec.queue.as_str();
        let channel = open_channel(names, connection).await?;
        let queue_type = match &self.settings.spec.declare {
            Some(declare) => {
                self.declare_source_queue(&channel, declare).await?;
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

    /// Declares the source queue, durable, of the type `declare` names, and binds it.
    async fn declare_source_queue(
        &self,
        channel: &lapin::Channel,
        declare: &AmqpDeclare,
    ) -> Result<(), TransportError> {
        let names = &self.names;
        let queue = self.settings.spec.queue.as_str();
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
        Ok(())
    }

    /// Declares the default dead-letter queue when it does not exist; checks the retention of
    /// an existing one.
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
                return self.check_dead_letter_ttl(connection, queue).await;
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
        let mut arguments = queue_type_argument(queue_type);
        let ttl = self.dead_letter_ttl();
        if let Some(ttl) = ttl {
            arguments.insert(MESSAGE_TTL.into(), AMQPValue::LongLongInt(i64::from(ttl)));
        }
        call(
            names,
            "dead-letter queue declare",
            Addressed::DeadLetter,
            channel.queue_declare(queue.into(), options, arguments),
        )
        .await?;
        let _ = channel.close(200, "declared".into()).await;
        tracing::info!(queue, x_message_ttl = ?ttl, "declared the dead-letter queue");
        Ok(())
    }

    /// The `x-message-ttl` of `retentionDays`; `None` past RabbitMQ's largest.
    fn dead_letter_ttl(&self) -> Option<u32> {
        u32::try_from(self.settings.dead_letter_retention.wanted.as_millis()).ok()
    }

    /// Fails fatally when the existing dead-letter queue `queue` has an `x-message-ttl` below
    /// `retentionDays` (unless `acceptShorterRetention`); says what it cannot check.
    async fn check_dead_letter_ttl(
        &self,
        connection: &Connection,
        queue: &str,
    ) -> Result<(), TransportError> {
        let retention = self.settings.dead_letter_retention;
        let found = arguments::read(&self.names, connection, queue, MESSAGE_TTL).await?;
        let value = match found {
            Found::Value(value) => value,
            Found::Forbidden | Found::Unreadable => {
                tracing::info!(
                    queue,
                    "cannot read the dead-letter queue's x-message-ttl (declaring needs the configure permission); make sure it keeps letters for deadLetter.retentionDays"
                );
                return Ok(());
            }
        };
        let kept = value
            .as_ref()
            .and_then(integer)
            .and_then(|ms| u64::try_from(ms).ok())
            .map(std::time::Duration::from_millis);
        match kept {
            Some(kept) if retention.too_short(Some(kept)) => retention.refused(
                queue,
                kept,
                "RabbitMQ cannot change a queue's x-message-ttl: delete the queue (after moving its letters) for the worker to declare it again",
            ),
            _ => Ok(()),
        }
    }
}
