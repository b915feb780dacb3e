//! An SQS queue behind an HTTP gateway that takes JWT bearer tokens.

use switchboard_api::{GatewaySource, QueueAdapter};

use super::{Context, Loop, Plugin};
use crate::WorkerError;
use crate::transport::gateway::{self, GatewaySettings, GatewayTransport};

impl Plugin for GatewaySource {
    fn title(&self) -> &'static str {
        "this broker"
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

    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        attributes: &[(String, String)],
    ) -> Result<String, WorkerError> {
        Ok(gateway::send_message(self, &adapter.adapter_name(), body, attributes).await?)
    }
}
