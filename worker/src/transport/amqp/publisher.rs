//! The publishing connection: dead letters and recounted classic-queue redeliveries, on a
//! connection of its own. During a resource alarm (disk, memory) RabbitMQ blocks every
//! connection that publishes, and lapin then writes nothing on it — acknowledgements included —
//! so the consumer's connection never publishes.
//!
//! - **Published once**: a publish whose confirm has not arrived (a confirm that timed out, a
//!   blocked connection) stays outstanding, and the next write of the same letter waits for that
//!   confirm instead of publishing it again; a letter confirmed is not published again while
//!   its original waits for its acknowledgement. Only a lost connection (its confirms are gone
//!   with it) makes a letter be published anew; the letter's deterministic `message-id` then
//!   tells the two copies apart from other letters.
//! - **Blocked is reported as such**: `connection.blocked` and `unblocked` are logged once each,
//!   with the broker's reason, and kept in the `amqp_publishing_blocked` gauge; a write while
//!   blocked is a transient error saying so.
//! - **Refused for good is bounded**: a letter the broker keeps refusing (nack, e.g. a full
//!   queue with `x-overflow: reject-publish`), or keeps from being confirmed (blocked), for
//!   [`PATIENCE`] is handed back as refused, and the pipeline keeps it in PostgreSQL; one it
//!   refuses by closing the channel with 406 PRECONDITION_FAILED (larger than `max_message_size`,
//!   a property it rejects) is refused at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Confirmation, Connection, Event, PublisherConfirm};
use prometheus_client::metrics::gauge::Gauge;
use tracing::Instrument as _;

use super::CALL_TIMEOUT;
use super::classify::{self, Addressed, Names};
use super::connection::{call, connect, open_channel};
use crate::transport::TransportError;

/// How long a letter may be refused (nacked, blocked, unconfirmed) before it is handed back as
/// refused for good.
pub const PATIENCE: Duration = Duration::from_secs(60);
/// How long a confirmed letter is remembered (not published again for a redelivered original).
const REMEMBER: Duration = Duration::from_secs(600);
/// The AMQP reply code of a publish RabbitMQ refuses for its content (406).
const PRECONDITION_FAILED: u16 = 406;

/// One message to publish: its key (what makes two publishes the same), where, and what.
#[derive(Debug, Clone, Copy)]
pub struct Outgoing<'a> {
    pub key: &'a str,
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub body: &'a [u8],
    pub properties: &'a BasicProperties,
}

/// What became of a publish of several messages.
#[derive(Debug, Default)]
pub struct Published {
    /// Indexes of the messages refused for good.
    pub refused: Vec<usize>,
    /// Why they were refused (the last refusal).
    pub refusal: Option<String>,
    /// The first failure that leaves some message neither confirmed nor refused: retry.
    pub retry: Option<TransportError>,
}

/// Why a publish failed.
enum Failure {
    /// RabbitMQ refused it for its content (406 PRECONDITION_FAILED, closing the channel).
    Refused(String),
    Other(TransportError),
}

struct Open {
    connection: Connection,
    channel: Channel,
}

/// The publishing connection, opened on first use and again after it failed.
pub struct Publisher {
    url: String,
    name: String,
    names: Names,
    blocked_gauge: Gauge,
    open: Option<Open>,
    /// Publishes not confirmed yet, by key.
    outstanding: HashMap<String, PublisherConfirm>,
    /// Keys confirmed, and when.
    confirmed: HashMap<String, Instant>,
    /// Keys refused (nacked, blocked, unconfirmed), since when.
    refusing: HashMap<String, Instant>,
}

impl Publisher {
    pub fn new(url: String, name: String, names: Names, blocked_gauge: Gauge) -> Self {
        Self {
            url,
            name,
            names,
            blocked_gauge,
            open: None,
            outstanding: HashMap::new(),
            confirmed: HashMap::new(),
            refusing: HashMap::new(),
        }
    }

    /// Whether RabbitMQ blocks the publishing connection now.
    pub fn blocked(&self) -> bool {
        self.open
            .as_ref()
            .is_some_and(|open| open.connection.status().blocked())
    }

    /// Whether the publish of `key` is confirmed.
    pub fn confirmed(&self, key: &str) -> bool {
        self.confirmed.contains_key(key)
    }

    /// Forgets a settled message: its confirm, its refusals, and a confirm still outstanding.
    pub fn forget(&mut self, key: &str) {
        self.confirmed.remove(key);
        self.refusing.remove(key);
        self.outstanding.remove(key);
    }

    async fn channel(&self, connection: &Connection) -> Result<Channel, TransportError> {
        let names = &self.names;
        let channel = open_channel(names, connection).await?;
        call(
            names,
            "confirm select",
            Addressed::Connection,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(channel)
    }

    /// The open connection and a usable channel on it.
    async fn ensure_open(&mut self) -> Result<(), TransportError> {
        if let Some(open) = &self.open {
            if !open.connection.status().connected() {
                self.lose();
            } else if !open.channel.status().connected() {
                let channel = self.channel(&open.connection).await?;
                if let Some(open) = self.open.as_mut() {
                    open.channel = channel;
                }
                return Ok(());
            } else {
                return Ok(());
            }
        }
        let connection = connect(&self.names, &self.url, &self.name).await?;
        watch_blocked(&connection, self.blocked_gauge.clone());
        let channel = self.channel(&connection).await?;
        self.open = Some(Open {
            connection,
            channel,
        });
        Ok(())
    }

    /// Drops the connection: its outstanding confirms are gone with it.
    fn lose(&mut self) {
        self.outstanding.clear();
        self.blocked_gauge.set(0);
        if let Some(open) = self.open.take() {
            crate::task::spawn(async move {
                let _ = tokio::time::timeout(
                    CALL_TIMEOUT,
                    open.connection.close(200, "reconnecting".into()),
                )
                .await;
            });
        }
    }

    /// Notes a refusal of `key` (now, or since earlier): whether it has lasted [`PATIENCE`].
    fn refused_long_enough(&mut self, key: &str) -> bool {
        let since = *self
            .refusing
            .entry(key.to_owned())
            .or_insert_with(Instant::now);
        since.elapsed() >= PATIENCE
    }

    /// Publishes `messages` (mandatory, confirmed), at most once each while a confirm is
    /// outstanding, and waits for the confirms until one shared deadline. `what` names the
    /// publish in errors.
    pub async fn publish(
        &mut self,
        what: &str,
        addressed: Addressed,
        messages: &[Outgoing<'_>],
    ) -> Published {
        let now = Instant::now();
        self.confirmed
            .retain(|_, at| now.duration_since(*at) < REMEMBER);
        let mut published = Published::default();
        if let Err(err) = self.ensure_open().await {
            published.retry = Some(err);
            return published;
        }
        if self.blocked() {
            return self.while_blocked(what, messages);
        }
        let closed_sending = self
            .send_unsent(what, addressed, messages, &mut published)
            .await;
        let closed_confirming = self
            .await_confirms(what, addressed, messages, &mut published)
            .await;
        if closed_sending || closed_confirming {
            // RabbitMQ closed the channel for one of them (406): which one, only publishing
            // them one at a time tells.
            self.publish_one_by_one(what, addressed, messages, &mut published)
                .await;
        }
        if published.retry.is_some()
            && self
                .open
                .as_ref()
                .is_some_and(|open| !open.connection.status().connected())
        {
            self.lose();
        }
        published.refused.sort_unstable();
        published.refused.dedup();
        published
    }

    /// What a publish comes to while RabbitMQ blocks the connection: nothing is sent; the
    /// messages refused for [`PATIENCE`] are refused for good, the rest wait.
    fn while_blocked(&mut self, what: &str, messages: &[Outgoing<'_>]) -> Published {
        let mut published = Published::default();
        for (index, message) in messages.iter().enumerate() {
            if !self.confirmed.contains_key(message.key) && self.refused_long_enough(message.key) {
                published.refused.push(index);
            }
        }
        published.refusal =
            Some("RabbitMQ blocked the publishing connection (a resource alarm)".into());
        let settled = messages
            .iter()
            .filter(|message| self.confirmed.contains_key(message.key))
            .count();
        if settled + published.refused.len() < messages.len() {
            published.retry = Some(TransportError::protocol(format!(
                "RabbitMQ blocks the publishing connection (a resource alarm: disk or memory): the {what} waits"
            )));
        }
        published
    }

    /// Publishes what is neither confirmed nor outstanding. Returns whether RabbitMQ closed
    /// the channel refusing one of them.
    async fn send_unsent(
        &mut self,
        what: &str,
        addressed: Addressed,
        messages: &[Outgoing<'_>],
        published: &mut Published,
    ) -> bool {
        for message in messages {
            if self.confirmed.contains_key(message.key)
                || self.outstanding.contains_key(message.key)
            {
                continue;
            }
            match self.send(what, addressed, message).await {
                Ok(confirm) => {
                    self.outstanding.insert(message.key.to_owned(), confirm);
                }
                Err(Failure::Refused(_)) => return true,
                Err(Failure::Other(err)) => {
                    published.retry = Some(err);
                    return false;
                }
            }
        }
        false
    }

    /// Waits for the outstanding confirms of `messages` until one shared deadline and records
    /// what each came to. Returns whether RabbitMQ closed the channel refusing one of them.
    async fn await_confirms(
        &mut self,
        what: &str,
        addressed: Addressed,
        messages: &[Outgoing<'_>],
        published: &mut Published,
    ) -> bool {
        let mut closed_by_refusal = false;
        let deadline = tokio::time::Instant::now() + CALL_TIMEOUT;
        for (index, message) in messages.iter().enumerate() {
            let Some(mut confirm) = self.outstanding.remove(message.key) else {
                continue;
            };
            match tokio::time::timeout_at(deadline, &mut confirm).await {
                Err(_) => {
                    // Still outstanding: waited for again, never published again.
                    self.outstanding.insert(message.key.to_owned(), confirm);
                    if self.refused_long_enough(message.key) {
                        published.refused.push(index);
                        published.refusal = Some(format!(
                            "RabbitMQ did not confirm the {what} within {PATIENCE:?}"
                        ));
                    } else {
                        published.retry.get_or_insert_with(|| {
                            TransportError::protocol(format!(
                                "RabbitMQ did not confirm the {what} within {CALL_TIMEOUT:?}"
                            ))
                        });
                    }
                }
                Ok(Ok(confirmation)) => {
                    self.record(
                        what,
                        addressed,
                        (index, message.key),
                        confirmation,
                        published,
                    );
                }
                Ok(Err(err)) => match self.failure(what, addressed, err) {
                    Failure::Refused(_) => closed_by_refusal = true,
                    Failure::Other(err) => {
                        published.retry.get_or_insert(err);
                    }
                },
            }
        }
        closed_by_refusal
    }

    /// Records the `confirmation` of the message `key` at `index`.
    fn record(
        &mut self,
        what: &str,
        addressed: Addressed,
        (index, key): (usize, &str),
        confirmation: Confirmation,
        published: &mut Published,
    ) {
        match confirmation {
            Confirmation::Ack(None) => {
                self.refusing.remove(key);
                self.confirmed.insert(key.to_owned(), Instant::now());
            }
            Confirmation::Ack(Some(returned)) => {
                published.retry = Some(self.names.unroutable(
                    what,
                    addressed,
                    returned.reply_code,
                    returned.reply_text.as_str(),
                ));
            }
            Confirmation::Nack(_) => {
                published.refusal = Some(format!(
                    "RabbitMQ refused the {what} (nack) for {PATIENCE:?}: is the queue full, with x-overflow reject-publish?"
                ));
                if self.refused_long_enough(key) {
                    published.refused.push(index);
                } else {
                    published.retry.get_or_insert_with(|| {
                        TransportError::protocol(format!(
                            "RabbitMQ refused the {what} (nack: a full queue with x-overflow reject-publish?); retried for up to {PATIENCE:?}"
                        ))
                    });
                }
            }
            Confirmation::NotRequested => {
                published.retry = Some(TransportError::protocol(format!(
                    "{what}: the publisher channel is not in confirm mode"
                )));
            }
        }
    }

    /// Publishes each message not settled yet alone, after RabbitMQ closed the channel with 406
    /// for one of them: the one it closes the channel for again is refused for good.
    async fn publish_one_by_one(
        &mut self,
        what: &str,
        addressed: Addressed,
        messages: &[Outgoing<'_>],
        published: &mut Published,
    ) {
        for (index, message) in messages.iter().enumerate() {
            if self.confirmed.contains_key(message.key)
                || published.refused.contains(&index)
                || self.outstanding.contains_key(message.key)
            {
                continue;
            }
            if let Err(err) = self.ensure_open().await {
                published.retry.get_or_insert(err);
                return;
            }
            let confirmation = match self.send(what, addressed, message).await {
                Ok(confirm) => match tokio::time::timeout(CALL_TIMEOUT, confirm).await {
                    Ok(Ok(confirmation)) => Ok(confirmation),
                    Ok(Err(err)) => Err(self.failure(what, addressed, err)),
                    Err(_) => Err(Failure::Other(TransportError::protocol(format!(
                        "RabbitMQ did not confirm the {what} within {CALL_TIMEOUT:?}"
                    )))),
                },
                Err(failure) => Err(failure),
            };
            match confirmation {
                Ok(Confirmation::Ack(None)) => {
                    self.confirmed
                        .insert(message.key.to_owned(), Instant::now());
                }
                Err(Failure::Refused(text)) => {
                    published.refused.push(index);
                    published.refusal = Some(format!("RabbitMQ refused the {what}: {text}"));
                }
                Err(Failure::Other(err)) => {
                    published.retry.get_or_insert(err);
                }
                Ok(_) => {
                    // A nack or a return: the batch path above decides about it next time.
                    published.retry.get_or_insert_with(|| {
                        TransportError::protocol(format!(
                            "RabbitMQ did not accept the {what} (published alone)"
                        ))
                    });
                }
            }
        }
    }

    /// A failed publish or confirm: refused for its content (406, the channel is closed for
    /// it), or anything else.
    fn failure(&self, what: &str, addressed: Addressed, err: lapin::Error) -> Failure {
        if classify::reply_code(&err) == Some(PRECONDITION_FAILED) {
            Failure::Refused(err.to_string())
        } else {
            Failure::Other(self.names.error(what, addressed, err))
        }
    }

    async fn send(
        &self,
        what: &str,
        addressed: Addressed,
        message: &Outgoing<'_>,
    ) -> Result<PublisherConfirm, Failure> {
        let Some(open) = &self.open else {
            return Err(Failure::Other(TransportError::protocol(
                "no RabbitMQ publishing connection",
            )));
        };
        let publish = open.channel.basic_publish(
            message.exchange.into(),
            message.routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            message.body,
            message.properties.clone(),
        );
        match tokio::time::timeout(CALL_TIMEOUT, publish).await {
            Ok(Ok(confirm)) => Ok(confirm),
            Ok(Err(err)) => Err(self.failure(what, addressed, err)),
            Err(_) => Err(Failure::Other(TransportError::protocol(format!(
                "RabbitMQ {what} timed out after {CALL_TIMEOUT:?}"
            )))),
        }
    }

    pub async fn shutdown(&mut self) {
        if let Some(open) = self.open.take() {
            let _ = tokio::time::timeout(
                CALL_TIMEOUT,
                open.connection.close(200, "worker stopped".into()),
            )
            .await;
        }
    }
}

/// Logs `connection.blocked` and `unblocked` of `connection` once each, and keeps `gauge` at 1
/// while it is blocked.
fn watch_blocked(connection: &Connection, gauge: Gauge) {
    let mut events = connection.events_listener();
    crate::task::spawn(
        async move {
            while let Some(event) = events.next().await {
                match event {
                    Event::ConnectionBlocked(reason) => {
                        gauge.set(1);
                        tracing::warn!(
                            %reason,
                            "RabbitMQ blocked the publishing connection (a resource alarm): dead letters wait; consuming goes on"
                        );
                    }
                    Event::ConnectionUnblocked => {
                        gauge.set(0);
                        tracing::info!("RabbitMQ unblocked the publishing connection");
                    }
                    _ => {}
                }
            }
        }
        .in_current_span(),
    );
}
