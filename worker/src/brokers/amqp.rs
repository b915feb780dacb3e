//! RabbitMQ (AMQP 0-9-1), a quorum or classic queue.

use switchboard_api::{AmqpSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::amqp::reader::AmqpReader;
use crate::transport::amqp::{Amqp, AmqpSettings};
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
}
