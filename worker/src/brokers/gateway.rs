//! An SQS queue behind an HTTP gateway that takes JWT bearer tokens.

use switchboard_api::{GatewaySource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::gateway::{self, GatewaySettings, GatewayTransport};

impl Plugin for GatewaySource {
    async fn run<L: Loop>(&self, context: Context<'_>, run: L) -> Result<(), WorkerError> {
        let settings = GatewaySettings {
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
        };
        let mut registry = context.registry;
        let transport = GatewayTransport::new(settings, &mut registry)?;
        run.drive(transport, registry, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        _adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.unread("this broker").await
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
