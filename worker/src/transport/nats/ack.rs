//! Acknowledgements: `+ACK` (or `+TERM` for a message just dead-lettered) with one server
//! confirmation per batch, `+WPI` (in progress) while a batch is stored, and a delayed NAK for
//! what is handed back at shutdown.

use std::sync::atomic::Ordering;

use async_nats::jetstream::AckKind;
use async_nats::{Client, RequestErrorKind};

use super::{NAK_DELAY, Nats, NatsDelivery, SEND_TIMEOUT};
use crate::transport::{Acked, TransportError};

/// How long the server has to confirm the acknowledgements of one call.
const ACK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Nats {
    /// Every acknowledgement but the last is sent as is; the last asks for the server's
    /// confirmation. The server takes the acknowledgements of one consumer from one connection
    /// in order, so confirming the last confirms that it processed them all: one reply per
    /// batch rather than one per message. A reconnection while they were sent (what was
    /// buffered for the old connection is gone) or a lost connection: the whole batch is
    /// acknowledged again, which is harmless. Nobody answering, or no confirmation in time (a
    /// restarted server does not answer for deliveries it no longer knows), means the receipts
    /// are stale: dropped (the messages are stored; a redelivery is deduplicated), and the
    /// consumer is looked up again before the next fetch.
    pub(super) async fn acknowledge(
        &mut self,
        messages: &[&NatsDelivery],
    ) -> Result<Acked, TransportError> {
        let Some((last, rest)) = messages.split_last() else {
            return Ok(Acked::all());
        };
        let client = self.bound()?.client.clone();
        let connected = connects(&client);
        self.send_acks(&client, rest).await?;
        let stale = self.confirm(&client, last, connected).await?;
        for message in messages {
            let seq = message.receipt.stream_sequence;
            self.dead_lettered.remove(&seq);
            self.held.remove(&seq);
        }
        if stale {
            self.rebind_due = true;
            return Err(TransportError::stale(
                "nothing confirms the acknowledgements: the NATS consumer is gone or no longer knows these deliveries; what it redelivers is deduplicated",
                None,
            ));
        }
        Ok(Acked::all())
    }

    /// `+TERM` for a message just dead-lettered, else `+ACK`.
    fn ack_kind(&self, message: &NatsDelivery) -> AckKind {
        if self
            .dead_lettered
            .contains(&message.receipt.stream_sequence)
        {
            AckKind::Term
        } else {
            AckKind::Ack
        }
    }

    /// Sends the acknowledgements of `messages`, unconfirmed.
    async fn send_acks(
        &self,
        client: &Client,
        messages: &[&NatsDelivery],
    ) -> Result<(), TransportError> {
        let sent = tokio::time::timeout(SEND_TIMEOUT, async {
            for message in messages {
                client
                    .publish(message.receipt.reply.clone(), self.ack_kind(message).into())
                    .await?;
            }
            Ok::<_, async_nats::PublishError>(())
        })
        .await;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(TransportError::transient(
                "could not send acknowledgements",
                err,
            )),
            Err(elapsed) => Err(TransportError::transient(
                "could not send acknowledgements in time",
                elapsed,
            )),
        }
    }

    /// Sends the acknowledgement of `last` and waits for the server's confirmation; returns
    /// whether the receipts are stale (nothing confirms them). A reconnection since `connected`
    /// connections is an error: what was buffered for the old connection may be lost.
    async fn confirm(
        &self,
        client: &Client,
        last: &NatsDelivery,
        connected: u64,
    ) -> Result<bool, TransportError> {
        let confirmation = client.request(last.receipt.reply.clone(), self.ack_kind(last).into());
        match tokio::time::timeout(ACK_TIMEOUT, confirmation).await {
            Ok(Ok(_)) if connects(client) == connected => Ok(false),
            Ok(Ok(_)) => Err(TransportError::transient(
                "reconnected to NATS while acknowledging a batch",
                std::io::Error::other(
                    "acknowledgements buffered for the old connection may be lost",
                ),
            )),
            Ok(Err(err)) if err.kind() == RequestErrorKind::NoResponders => Ok(true),
            // A server that restarted (or lost the consumer's pending state) never confirms an
            // acknowledgement of a delivery it no longer knows: asking again would wedge the
            // batch. The messages are stored (or dead-lettered) already: the receipts are
            // dropped, and whatever the server redelivers is deduplicated.
            Ok(Err(err)) if err.kind() == RequestErrorKind::TimedOut => Ok(true),
            Ok(Err(err)) => Err(TransportError::transient(
                "NATS did not confirm the acknowledgements",
                err,
            )),
            Err(_elapsed) => Ok(true),
        }
    }

    /// `+WPI` for each of `messages`: their AckWait starts again.
    pub(super) async fn mark_in_progress(
        &self,
        messages: &[&NatsDelivery],
    ) -> Result<(), TransportError> {
        let client = &self.bound()?.client;
        let sent = tokio::time::timeout(SEND_TIMEOUT, async {
            for message in messages {
                client
                    .publish(message.receipt.reply.clone(), AckKind::Progress.into())
                    .await
                    .map_err(|err| {
                        TransportError::transient("could not send in-progress acks", err)
                    })?;
            }
            client
                .flush()
                .await
                .map_err(|err| TransportError::transient("could not send in-progress acks", err))
        })
        .await;
        sent.map_err(|elapsed| {
            TransportError::transient("could not send in-progress acks in time", elapsed)
        })?
    }

    /// Hands the messages received and not acknowledged back with a delayed NAK
    /// ([`NAK_DELAY`]), never a bare NAK that would burn through the delivery count.
    pub(super) async fn hand_back(&mut self) {
        let Some(bound) = &self.bound else {
            return;
        };
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return;
        }
        let handed_back = tokio::time::timeout(SEND_TIMEOUT, async {
            for reply in held.values() {
                bound
                    .client
                    .publish(reply.clone(), AckKind::Nak(Some(NAK_DELAY)).into())
                    .await
                    .map_err(|err| err.to_string())?;
            }
            bound.client.flush().await.map_err(|err| err.to_string())
        })
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()));
        match handed_back {
            Ok(()) => tracing::info!(
                messages = held.len(),
                delay = ?NAK_DELAY,
                "handed un-acknowledged messages back to NATS"
            ),
            Err(err) => {
                tracing::warn!(error = %err, "could not hand messages back; the server redelivers them after AckWait")
            }
        }
    }
}

/// How many times `client` connected: a change means a reconnection.
fn connects(client: &Client) -> u64 {
    client.statistics().connects.load(Ordering::Acquire)
}
