//! Receive: one pull `fetch` with a deadline on every wait for the next message, each
//! JetStream delivery converted (a header block the client could not parse read as bytes, the
//! subject kept as a header), and the consumer re-bound first when that is due.

use std::sync::atomic::Ordering;

use async_nats::datetime::DateTime;
use async_nats::jetstream;
use base64::Engine as _;
use futures::StreamExt as _;
use switchboard_store::Position;

use super::headers::{self, RAW_HEADERS};
use super::{FETCH_EXPIRY, NEXT_DEADLINE, Nats, NatsDelivery, Receipt};
use crate::transport::identity::idempotency_key;
use crate::transport::{Message, TransportError};

/// Why a fetch ended before its end of batch.
type FetchFailure = Box<dyn std::error::Error + Send + Sync>;

impl Nats {
    /// One fetch of up to `max` messages; with `block`, it waits at most [`FETCH_EXPIRY`] for
    /// the first. A fetch that ends early delivers what it returned (and re-binds before the
    /// next); a consumer quiet while messages are pending is re-bound.
    pub(super) async fn fetch_deliveries(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<NatsDelivery>, TransportError> {
        self.rebind_if_due().await?;
        let (fetched, failure) = self.pull(max, block).await?;
        let messages: Vec<NatsDelivery> = fetched
            .into_iter()
            .filter_map(|message| self.convert(message))
            .collect();
        if let Some(err) = failure {
            self.rebind_due = true;
            if messages.is_empty() {
                return Err(TransportError::protocol(format!(
                    "NATS fetch failed: {err}"
                )));
            }
            tracing::debug!(error = %err, "a NATS fetch ended early; delivering what it returned");
        }
        if !messages.is_empty() {
            self.quiet_since = None;
        } else if block {
            self.check_stalled().await?;
        }
        Ok(messages)
    }

    /// Re-binds after a reconnection or a failed fetch.
    async fn rebind_if_due(&mut self) -> Result<(), TransportError> {
        if self.events.reconnected.swap(false, Ordering::AcqRel) || self.rebind_due {
            let why = if self.rebind_due {
                "fetch failed"
            } else {
                "reconnected"
            };
            self.rebind_due = true;
            self.rebind(why).await?;
        }
        Ok(())
    }

    /// The messages of one pull request, and why it ended early if it did: every wait for the
    /// next message has a deadline ([`NEXT_DEADLINE`]), so a connection cut after the request
    /// never wedges the worker.
    async fn pull(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<(Vec<jetstream::Message>, Option<FetchFailure>), TransportError> {
        let bound = self.bound()?;
        let mut fetch = bound.consumer.fetch().max_messages(max.max(1));
        if block {
            fetch = fetch.expires(FETCH_EXPIRY);
        }
        let mut batch = match tokio::time::timeout(NEXT_DEADLINE, fetch.messages()).await {
            Ok(Ok(batch)) => batch,
            Ok(Err(err)) => {
                self.rebind_due = true;
                return Err(TransportError::transient("NATS fetch failed", err));
            }
            Err(elapsed) => {
                self.rebind_due = true;
                return Err(TransportError::transient(
                    "NATS did not take the pull request in time",
                    elapsed,
                ));
            }
        };
        let mut fetched = Vec::new();
        let mut failure: Option<FetchFailure> = None;
        loop {
            match tokio::time::timeout(NEXT_DEADLINE, batch.next()).await {
                Ok(None) => break,
                Ok(Some(Ok(message))) => fetched.push(message),
                Ok(Some(Err(err))) => {
                    failure = Some(err);
                    break;
                }
                // The pull request's end never came (a connection cut after it was sent).
                Err(elapsed) => {
                    failure = Some(Box::new(elapsed));
                    break;
                }
            }
        }
        Ok((fetched, failure))
    }

    /// One fetched message, converted; `None` for one without an acknowledgement subject
    /// (never a JetStream delivery: it can be neither acknowledged nor dead-lettered).
    fn convert(&mut self, message: jetstream::Message) -> Option<NatsDelivery> {
        let incarnation = &self.incarnation.as_ref()?.tag;
        let (stream_sequence, delivered, published) = match message.info() {
            Ok(info) => (info.stream_sequence, info.delivered, info.published),
            Err(err) => {
                tracing::warn!(error = %err, subject = %message.subject, "skipped a NATS message that is not a JetStream delivery");
                return None;
            }
        };
        let message = message.message;
        let reply = message.reply?;
        let undecodable = message.undecodable.unwrap_or_default();
        let mut refusal = None;
        let mut headers: Vec<(String, Vec<u8>)> = match &undecodable.raw_headers {
            None => message
                .headers
                .iter()
                .flat_map(|headers| headers.iter())
                .flat_map(|(name, values)| {
                    values
                        .iter()
                        .map(move |value| (name.to_string(), value.as_str().as_bytes().to_vec()))
                })
                .collect(),
            Some(block) => headers::read_block(block).unwrap_or_else(|reason| {
                refusal = Some(reason);
                vec![(
                    RAW_HEADERS.to_owned(),
                    base64::engine::general_purpose::STANDARD
                        .encode(block)
                        .into_bytes(),
                )]
            }),
        };
        headers.sort();
        // Stored encoded when it is not UTF-8 (the server does not check subjects).
        let subject = undecodable
            .raw_subject
            .map_or_else(|| message.subject.as_bytes().to_vec(), |raw| raw.to_vec());
        headers.push(("Nats-Subject".to_owned(), subject));
        self.held.insert(stream_sequence, reply.clone());
        let identity = Identity {
            source: &self.source,
            stream: &self.settings.spec.stream,
            incarnation,
        };
        let mut delivery = identity.message(
            Receipt {
                reply,
                stream_sequence,
                subject: message.subject,
            },
            message.payload.to_vec(),
            headers,
            u64::try_from(delivered).unwrap_or(1).max(1),
            published,
        );
        delivery.undecodable = refusal.map(|reason| {
            format!("the NATS delivery's headers cannot be read ({reason}); raw header block in {RAW_HEADERS}")
        });
        Some(delivery)
    }
}

/// What identifies a message of the stream: the adapter's source, the stream and its
/// incarnation.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    pub source: &'a str,
    pub stream: &'a str,
    /// [`Incarnation::tag`].
    pub incarnation: &'a str,
}

impl Identity<'_> {
    /// A delivery of the message at `receipt.stream_sequence`: its external id
    /// `{stream}:{incarnation}:{seq}`, idempotency key `{source}:{external id}` and checkpoint
    /// position (partition: the incarnation).
    fn message(
        &self,
        receipt: Receipt,
        body: Vec<u8>,
        headers: Vec<(String, Vec<u8>)>,
        delivery_count: u64,
        published: DateTime,
    ) -> NatsDelivery {
        let seq = receipt.stream_sequence;
        // Sized once (`format!` grows its string as it writes): built for every message.
        let mut external_id =
            String::with_capacity(self.stream.len() + self.incarnation.len() + 22);
        external_id.push_str(self.stream);
        external_id.push(':');
        external_id.push_str(self.incarnation);
        external_id.push(':');
        external_id.push_str(itoa::Buffer::new().format(seq));
        Message {
            receipt,
            idempotency_key: idempotency_key(self.source, &external_id),
            external_id,
            body,
            headers,
            delivery_count,
            enqueued_at_ms: u64::try_from(published.unix_timestamp_nanos() / 1_000_000).ok(),
            position: Some(Position {
                partition: self.incarnation.to_owned(),
                value: vec![i64::try_from(seq).unwrap_or(i64::MAX)],
            }),
            undecodable: None,
        }
    }
}
