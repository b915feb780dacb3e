//! NATS JetStream, read by a durable pull consumer.

use switchboard_api::{NatsSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::nats::reader::NatsReader;
use crate::transport::nats::{Auth, Connector, Nats, NatsSettings};
use crate::transport::retention::Retention;
use crate::{WorkerError, env};

impl Plugin for NatsSource {
    fn title(&self) -> &'static str {
        "NATS JetStream"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let connector = connector(format!("switchboard-worker/{}", context.consumer))?;
        let dead_letter = context.dead_letter();
        let settings = NatsSettings {
            max_deliveries: context.max_deliveries(),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
            connector,
            dead_letter_subject: dead_letter.subject.clone(),
            dead_letter_retention: Retention::of(dead_letter),
        };
        let transport = Nats::new(settings, context.store, run.registry());
        run.drive(transport, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        let connector = connector("switchboard-worker-dlq".to_owned())?;
        letters
            .read(NatsReader::new(adapter, self, connector).await?)
            .await
    }
}

/// The connection settings from the environment (`NATS_URL`, the credentials), the client named
/// `name`.
fn connector(name: String) -> Result<Connector, WorkerError> {
    Ok(Connector {
        url: env("NATS_URL")?,
        auth: Auth::from_env()?,
        name,
    })
}
