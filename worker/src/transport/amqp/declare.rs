//! Declaring the queues a session needs: the source queue (checked, or declared with its type
//! and bindings) and the default dead-letter queue `<queue>.dlq` when it does not exist.

use lapin::Connection;
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use switchboard_api::{AmqpDeclare, AmqpQueueType};

use super::Amqp;
use super::classify::{self, Addressed};
use super::connection::{call, open_channel};
use crate::transport::TransportError;

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
}
