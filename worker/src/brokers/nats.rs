//! NATS JetStream, read by a durable pull consumer.

use async_nats::jetstream;
use switchboard_api::{NatsSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::transport::TransportError;
use crate::transport::nats::reader::{NatsReader, header_map, publish_confirmed};
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

    /// Publishes to the message's subject (its `Nats-Subject` header, which every message the
    /// worker read carries, else `filterSubject` when it names one subject) with the other
    /// headers (not the server's `Nats-*`: the stream's duplicate window would drop a copy) and
    /// waits for the stream's PubAck; returns the stream sequence.
    async fn send(
        &self,
        _adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        let subject = subject(self, headers)?;
        let map = header_map(headers, |name| !name.starts_with("Nats-"));
        let client = connector("switchboard-worker-send".to_owned())?
            .connect(None)
            .await?;
        let ack = publish_confirmed(&jetstream::new(client), subject, map, body).await?;
        Ok(ack.sequence.to_string())
    }
}

/// The subject a message goes to: its `Nats-Subject` header, else `filterSubject` when it has
/// no wildcard.
fn subject(nats: &NatsSource, headers: &[(String, Vec<u8>)]) -> Result<String, TransportError> {
    let named = super::header_text(headers, "Nats-Subject");
    let filter = nats
        .filter_subject
        .clone()
        .filter(|subject| !subject.contains(['*', '>']));
    named.or(filter).ok_or_else(|| {
        TransportError::protocol(
            "no subject to publish on: give one with --attr Nats-Subject=SUBJECT (or set \
             spec.source.nats.filterSubject to a subject without wildcards)",
        )
    })
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
