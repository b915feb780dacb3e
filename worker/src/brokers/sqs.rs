//! Amazon SQS (standard or FIFO), or an SQS-compatible server.

use switchboard_api::{QueueAdapter, SqsSource};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::reader::StoredLetter;
use crate::transport::retention::Retention;
use crate::transport::sqs::reader::{LetterQueue, SqsReader, copy_attributes};
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

    /// Attribute values that are not UTF-8 are sent with their invalid bytes replaced (the
    /// command line gives text; a kept letter goes through [`Plugin::resend`]).
    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        Ok(Sqs::for_command(adapter, "switchboard-worker-send")
            .await?
            .send(body, &text_headers(headers))
            .await?)
    }

    /// The SQS reader's copy: binary attributes stay binary, an original at SQS's maximum of
    /// attributes packs its key, and a FIFO copy's deduplication id is made from the key.
    async fn resend(
        &self,
        adapter: &QueueAdapter,
        letter: &StoredLetter,
        key: &str,
    ) -> Result<(), WorkerError> {
        let sqs = Sqs::for_command(adapter, "switchboard-worker-dlq").await?;
        let attributes = copy_attributes(&letter.headers, key);
        Ok(LetterQueue::send(&sqs, letter, attributes, key).await?)
    }
}

/// `headers` as text, invalid UTF-8 replaced.
pub(super) fn text_headers(headers: &[(String, Vec<u8>)]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(name, value)| (name.clone(), String::from_utf8_lossy(value).into_owned()))
        .collect()
}
