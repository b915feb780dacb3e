//! An SQS queue behind an HTTP gateway that takes JWT bearer tokens.

use switchboard_api::{GatewaySource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::gateway::{self, GatewayLetters, GatewaySettings, GatewayTransport};
use crate::transport::sqs::reader::QueueReader;

impl Plugin for GatewaySource {
    fn title(&self) -> &'static str {
        "the gateway"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let settings = GatewaySettings {
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
        };
        let transport = GatewayTransport::new(settings, run.registry())?;
        run.drive(transport, self).await
    }

    /// The dead-letter queue `spec.source.gateway.deadLetter.queue` names, through the gateway;
    /// without it the command says what to set, then reads the letters kept in PostgreSQL, if
    /// `DATABASE_URL` is set.
    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        match GatewayLetters::new(self, &adapter.adapter_name())? {
            Some(queue) => letters.read(QueueReader::over(queue).await?).await,
            None => {
                eprintln!("note: {}", gateway::DEAD_LETTER_QUEUE_UNSET);
                letters.unread(self.title()).await
            }
        }
    }

    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        let attributes = super::sqs::text_headers(headers);
        Ok(gateway::send_message(self, &adapter.adapter_name(), body, &attributes).await?)
    }
}
