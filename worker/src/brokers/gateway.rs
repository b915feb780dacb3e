//! An SQS queue behind an HTTP gateway that takes JWT bearer tokens.

use switchboard_api::{GatewaySource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::gateway::{self, GatewaySettings, GatewayTransport};

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

    /// The gateway has no reader (see [`gateway::DEAD_LETTERS_UNREADABLE`]): the command says
    /// why and what to do, then reads the letters kept in PostgreSQL, if `DATABASE_URL` is set.
    async fn read_letters<D: Letters>(
        &self,
        _adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        eprintln!("note: {}", gateway::DEAD_LETTERS_UNREADABLE);
        letters.unread(self.title()).await
    }

    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        attributes: &[(String, String)],
    ) -> Result<String, WorkerError> {
        Ok(gateway::send_message(self, &adapter.adapter_name(), body, attributes).await?)
    }
}
