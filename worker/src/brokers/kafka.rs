//! Apache Kafka topics, read by a consumer group.

use switchboard_api::{KafkaSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::kafka::reader::KafkaReader;
use crate::transport::kafka::{Kafka, KafkaSettings};
use crate::transport::retention::Retention;

impl Plugin for KafkaSource {
    fn title(&self) -> &'static str {
        "Kafka"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let settings = KafkaSettings {
            dead_letter_topic: context.dead_letter().topic.clone(),
            dead_letter_retention: Retention::of(context.dead_letter()),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
        };
        let transport = Kafka::new(settings, context.store, run.registry())?;
        run.drive(transport, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.read(KafkaReader::new(adapter, self).await?).await
    }
}
