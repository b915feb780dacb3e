//! Amazon SQS (standard or FIFO), or an SQS-compatible server.

use switchboard_api::{QueueAdapter, SqsSource};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::retention::Retention;
use crate::transport::sqs::reader::SqsReader;
use crate::transport::sqs::{Sqs, SqsSettings};

impl Plugin for SqsSource {
    fn title(&self) -> &'static str {
        "SQS"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let dead_letter = context.dead_letter();
        let settings = SqsSettings {
            batch_size: context.batch_size(),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
            dead_letter_queue_url: dead_letter.queue_url.clone(),
            dead_letter_retention: Retention::of(dead_letter),
        };
        let transport = Sqs::new(settings, run.registry()).await?;
        run.drive(transport, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.read(SqsReader::new(adapter).await?).await
    }

    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        attributes: &[(String, String)],
    ) -> Result<String, WorkerError> {
        Ok(Sqs::for_command(adapter, "switchboard-worker-send")
            .await?
            .send(body, attributes)
            .await?)
    }
}
