//! Apache Kafka topics, read by a consumer group.

use switchboard_api::{KafkaSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::kafka::{Kafka, KafkaSettings};

impl Plugin for KafkaSource {
    async fn run<L: Loop>(&self, context: Context<'_>, run: L) -> Result<(), WorkerError> {
        let settings = KafkaSettings {
            dead_letter_topic: context.dead_letter().topic.clone(),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
        };
        let mut registry = context.registry;
        let transport = Kafka::new(settings, context.store, &mut registry)?;
        run.drive(transport, registry, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        _adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.unread("Kafka").await
    }
}
