//! RabbitMQ (AMQP 0-9-1), a quorum or classic queue.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use switchboard_api::{AmqpSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::amqp::dead_letter::PERSISTENT;
use crate::transport::amqp::reader::AmqpReader;
use crate::transport::amqp::{Amqp, AmqpSettings};
use crate::transport::identity::{body_hash, body_id};
use crate::transport::retention::Retention;
use crate::{WorkerError, env};

impl Plugin for AmqpSource {
    fn title(&self) -> &'static str {
        "AMQP"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let dead_letter = context.dead_letter();
        let settings = AmqpSettings {
            batch_size: context.batch_size(),
            max_deliveries: context.max_deliveries(),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
            dead_letter_exchange: dead_letter.exchange.clone(),
            dead_letter_routing_key: dead_letter.routing_key.clone(),
            dead_letter_retention: Retention::of(dead_letter),
        };
        let transport = Amqp::new(settings, env("AMQP_URL")?, run.registry())?;
        run.drive(transport, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        let reader = AmqpReader::new(adapter, self, &env("AMQP_URL")?).await?;
        letters.read(reader).await
    }

    /// Publishes to the source queue as the dead-letter reader's redrive does (through the
    /// default exchange, mandatory, persistent, each header a long string) and waits for the
    /// confirm; returns the id the worker gives it (the body's hash: it carries no
    /// `message-id`).
    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert(
                name.as_str().into(),
                AMQPValue::LongString(value.clone().into()),
            );
        }
        let properties = BasicProperties::default()
            .with_delivery_mode(PERSISTENT)
            .with_headers(table);
        let mut reader = AmqpReader::new(adapter, self, &env("AMQP_URL")?).await?;
        reader.publish_copy(body, properties).await?;
        Ok(body_id(&body_hash(body)))
    }
}
