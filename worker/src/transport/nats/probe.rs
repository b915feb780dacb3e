//! Queue health: the consumer's `num_pending` (backlog) and `num_ack_pending` (pending), the
//! age of the first message above its ack floor, and the dead letters held, read on the
//! probe's own connection.

use std::time::{Duration, SystemTime};

use async_nats::Client;
use async_nats::jetstream;
use futures::StreamExt as _;

use super::{Connector, DeadLetterStream};
use crate::transport::{QueueHealth, QueueProbe, TransportError};

/// Reads the consumer's figures on its own connection.
#[derive(Debug)]
pub struct NatsProbe {
    pub(super) connector: Connector,
    pub(super) stream: String,
    pub(super) consumer: String,
    pub(super) filter: Option<String>,
    pub(super) dead_letter_stream: Option<DeadLetterStream>,
    pub(super) client: Option<Client>,
}

impl QueueProbe for NatsProbe {
    /// Backlog = the consumer's `num_pending` (not yet delivered), pending = `num_ack_pending`
    /// (delivered, not acknowledged); the oldest pending age is that of the first message
    /// above the consumer's ack floor (zero when there is none).
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let client = match &self.client {
            Some(client) => client.clone(),
            None => {
                let client = self.connector.connect(None).await?;
                self.client = Some(client.clone());
                client
            }
        };
        let js = jetstream::new(client);
        let stream = js
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|err| TransportError::transient("could not read the NATS stream", err))?;
        let info = stream
            .consumer_info(&self.consumer)
            .await
            .map_err(|err| TransportError::transient("could not read the NATS consumer", err))?;
        let unacknowledged = info.num_pending + info.num_ack_pending as u64;
        let oldest_pending_age = if unacknowledged == 0 {
            Some(Duration::ZERO)
        } else {
            stream
                .raw_message_builder()
                .sequence(info.ack_floor.stream_sequence + 1)
                .next_by_subject(self.filter.clone().unwrap_or_else(|| ">".to_owned()))
                .send()
                .await
                .ok()
                .map(|message| {
                    let age = time_since(message.time.unix_timestamp_nanos());
                    Duration::from_nanos(u64::try_from(age).unwrap_or(0))
                })
        };
        let (dead_letters, oldest_dead_letter_age) = match &self.dead_letter_stream {
            Some(letters) => {
                let (count, age) = dead_letter_depth(&js, letters).await?;
                (Some(count), age)
            }
            None => (None, None),
        };
        Ok(QueueHealth {
            backlog: Some(info.num_pending),
            pending: Some(info.num_ack_pending as u64),
            oldest_pending_age,
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}

/// Messages on the dead-letter subjects of `letters`' stream, and the age of the first of
/// them (when it was written: the stream's own timestamp; zero when there is none).
async fn dead_letter_depth(
    js: &jetstream::Context,
    letters: &DeadLetterStream,
) -> Result<(u64, Option<Duration>), TransportError> {
    let failed = |err| TransportError::transient("could not read the dead-letter stream", err);
    let stream = js
        .get_stream_no_info(&letters.name)
        .await
        .map_err(|err| TransportError::transient("could not read the dead-letter stream", err))?;
    let mut subjects = stream
        .info_with_subjects(&letters.subjects)
        .await
        .map_err(failed)?;
    let mut count = 0;
    while let Some(subject) = subjects.next().await {
        count += subject.map_err(failed)?.1 as u64;
    }
    if count == 0 {
        return Ok((0, Some(Duration::ZERO)));
    }
    let oldest = stream
        .raw_message_builder()
        .sequence(1)
        .next_by_subject(letters.subjects.clone())
        .send()
        .await
        .ok()
        .map(|letter| {
            let age = time_since(letter.time.unix_timestamp_nanos());
            Duration::from_nanos(u64::try_from(age).unwrap_or(0))
        });
    Ok((count, oldest))
}

/// Nanoseconds from `unix_nanos` until now (zero for a time in the future).
fn time_since(unix_nanos: i128) -> i128 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    (now - unix_nanos).max(0)
}
