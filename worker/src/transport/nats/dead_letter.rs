//! Dead letters as JetStream messages, published to `deadLetter.subject` (default
//! `<stream>.dlq.<subject>`) in a stream the worker makes sure of: the body byte-identical, the
//! original headers kept (except the server's `Nats-*` ones), the context as `Switchboard-*`
//! headers. Every PubAck is awaited before the originals are terminated; a letter the server
//! can never take is reported as refused. The stream keeps letters `deadLetter.retentionDays`
//! (MaxAge): set on the stream the worker creates, raised on an existing one whose non-zero
//! MaxAge is shorter (a refused update is fatal naming the setting unless
//! `acceptShorterRetention`).

use std::time::SystemTime;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{
    CreateStreamErrorKind, GetStreamByNameErrorKind, PublishAckFuture, PublishError,
    PublishErrorKind,
};
use async_nats::jetstream::{self, ErrorCode, stream};

use super::{DEAD_LETTER_SETTING, DeadLetterStream, Nats, Receipt, SEND_TIMEOUT};
use crate::transport::dead_letter::{Convention, DeadLetterContext};
use crate::transport::{DeadLetter, TransportError};

/// What every dead letter of one write shares.
#[derive(Debug, Clone, Copy)]
pub struct WriteContext<'a> {
    pub stream: &'a str,
    /// The stream's incarnation (`Incarnation::tag`).
    pub incarnation: &'a str,
    pub consumer: &'a str,
    /// RFC 3339, now.
    pub last_seen: &'a str,
}

/// The letters the server refuses for good, by index, and the first refusal.
#[derive(Debug, Default)]
struct Refused {
    indices: Vec<usize>,
    first: Option<PublishError>,
}

impl Refused {
    fn add(&mut self, index: usize, err: PublishError) {
        self.indices.push(index);
        self.first.get_or_insert(err);
    }

    /// Ok when none was refused.
    fn into_result(mut self) -> Result<(), TransportError> {
        let Some(err) = self.first else {
            return Ok(());
        };
        self.indices.sort_unstable();
        Err(TransportError::dead_letters_refused(
            self.indices,
            "NATS refuses these dead letters for good (over the server's max payload or the dead-letter stream's max message size)",
            Some(Box::new(err)),
        ))
    }
}

impl Nats {
    /// Publishes `letters` and waits for the dead-letter stream's PubAck of each; the letters
    /// taken are terminated by the next acknowledgement of their originals.
    pub(super) async fn publish_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        if !self.dead_letter_ready {
            let js = self.bound()?.js.clone();
            self.ensure_dead_letter_stream(&js).await?;
            self.dead_letter_ready = true;
        }
        let mut refused = Refused::default();
        let pending = self.publish(letters, &mut refused).await?;
        self.await_pub_acks(pending, &mut refused).await?;
        self.dead_lettered.extend(
            letters
                .iter()
                .enumerate()
                .filter(|(index, _)| !refused.indices.contains(index))
                .map(|(_, letter)| letter.message.receipt.stream_sequence),
        );
        refused.into_result()
    }

    /// Publishes each of `letters`; returns the PubAcks to wait for, by index.
    async fn publish(
        &self,
        letters: &[DeadLetter<'_, Receipt>],
        refused: &mut Refused,
    ) -> Result<Vec<(usize, PublishAckFuture)>, TransportError> {
        let bound = self.bound()?;
        let last_seen = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
        let context = WriteContext {
            stream: &self.settings.spec.stream,
            incarnation: &self.incarnation()?.tag,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
        };
        let mut pending = Vec::with_capacity(letters.len());
        for (index, letter) in letters.iter().enumerate() {
            let message = letter.message;
            let subject = subject(
                self.settings.dead_letter_subject.as_deref(),
                &self.settings.spec.stream,
                message.receipt.subject.as_str(),
            );
            let sent = tokio::time::timeout(
                SEND_TIMEOUT,
                bound.js.publish_with_headers(
                    subject,
                    headers(letter, context),
                    message.body.clone().into(),
                ),
            )
            .await
            .map_err(|elapsed| {
                TransportError::transient("could not publish a dead letter in time", elapsed)
            })?;
            match sent {
                Ok(ack) => pending.push((index, ack)),
                Err(err) if refused_for_good(&err) => refused.add(index, err),
                Err(err) => {
                    return Err(TransportError::transient(
                        "could not publish a dead letter",
                        err,
                    ));
                }
            }
        }
        Ok(pending)
    }

    /// Waits for each PubAck (the JetStream context's own timeout). A letter not confirmed
    /// fails the write: the pipeline writes the whole batch again, and the dead-letter stream
    /// drops the letters it already has (their `Nats-Msg-Id`).
    async fn await_pub_acks(
        &mut self,
        pending: Vec<(usize, PublishAckFuture)>,
        refused: &mut Refused,
    ) -> Result<(), TransportError> {
        let mut missing_stream = false;
        let mut failure = None;
        for (index, ack) in pending {
            match ack.await {
                Ok(_) => {}
                Err(err) if refused_for_good(&err) => refused.add(index, err),
                Err(err) => {
                    missing_stream |= matches!(err.kind(), PublishErrorKind::StreamNotFound);
                    failure.get_or_insert(err);
                }
            }
        }
        match failure {
            None => Ok(()),
            Some(err) => {
                self.dead_letter_ready &= !missing_stream;
                Err(TransportError::transient(
                    "the dead-letter stream did not confirm a dead letter",
                    err,
                ))
            }
        }
    }

    /// Makes sure a stream (other than the source) holds the dead-letter subject; records it
    /// for the probe.
    pub(super) async fn ensure_dead_letter_stream(
        &mut self,
        js: &jetstream::Context,
    ) -> Result<(), TransportError> {
        let stream = &self.settings.spec.stream;
        let (sample, captured) = match &self.settings.dead_letter_subject {
            Some(subject) => (subject.clone(), subject.clone()),
            None => (format!("{stream}.dlq.x"), format!("{stream}.dlq.>")),
        };
        match js.stream_by_subject(sample.clone()).await {
            Ok(name) if &name == stream => Err(TransportError::fatal(
                DEAD_LETTER_SETTING,
                format!(
                    "stream {stream} itself holds the dead-letter subject {captured}: dead letters would be delivered again; choose a subject it does not hold"
                ),
                None,
            )),
            Ok(name) => {
                tracing::info!(stream = %name, subject = %captured, "dead letters go to an existing stream");
                self.hold_retention(js, &name).await?;
                self.dead_letter_stream = Some(DeadLetterStream {
                    name,
                    subjects: captured,
                });
                Ok(())
            }
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::NotFound) => {
                let name = format!("{stream}_DLQ");
                js.create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![captured.clone()],
                    max_age: self.settings.dead_letter_retention.wanted,
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|err| match err.kind() {
                    CreateStreamErrorKind::JetStream(_) => {
                        TransportError::fatal(
                            DEAD_LETTER_SETTING,
                            format!("the server refused to create the dead-letter stream {name} for {captured}"),
                            Some(Box::new(err)),
                        )
                    }
                    _ => TransportError::transient("could not create the dead-letter stream", err),
                })?;
                tracing::info!(stream = %name, subject = %captured, max_age = ?self.settings.dead_letter_retention.wanted, "created the dead-letter stream (messages kept deadLetter.retentionDays)");
                self.dead_letter_stream = Some(DeadLetterStream {
                    name,
                    subjects: captured,
                });
                Ok(())
            }
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::InvalidSubject) => {
                Err(TransportError::fatal(
                    DEAD_LETTER_SETTING,
                    format!("{sample} is not a valid subject"),
                    None,
                ))
            }
            Err(err) => Err(TransportError::transient(
                "could not look up the dead-letter stream",
                err,
            )),
        }
    }
}

impl Nats {
    /// Raises the MaxAge of the existing dead-letter stream `name` to `retentionDays` when it
    /// is shorter (0 keeps messages for ever).
    async fn hold_retention(
        &self,
        js: &jetstream::Context,
        name: &str,
    ) -> Result<(), TransportError> {
        let retention = self.settings.dead_letter_retention;
        let stream = js.get_stream(name).await.map_err(|err| {
            TransportError::transient("could not read the dead-letter stream", err)
        })?;
        let mut config = stream.cached_info().config.clone();
        let kept = Some(config.max_age).filter(|age| !age.is_zero());
        let Some(kept) = kept.filter(|kept| retention.too_short(Some(*kept))) else {
            return Ok(());
        };
        if retention.accept_shorter {
            return retention.refused(name, kept, "not raised: accepted as it is");
        }
        config.max_age = retention.wanted;
        match js.update_stream(config).await {
            Ok(_) => {
                tracing::info!(stream = %name, from = ?kept, to = ?retention.wanted, "raised the dead-letter stream's MaxAge to deadLetter.retentionDays");
                Ok(())
            }
            Err(err) if matches!(err.kind(), CreateStreamErrorKind::JetStream(_)) => {
                retention.refused(name, kept, format!("stream update: {err}"))
            }
            Err(err) => Err(TransportError::transient(
                "could not update the dead-letter stream",
                err,
            )),
        }
    }
}

/// Whether the server refuses a dead letter however often it is sent: larger than the
/// server's max payload, or than the dead-letter stream's max message size.
fn refused_for_good(err: &PublishError) -> bool {
    use std::error::Error as _;
    matches!(err.kind(), PublishErrorKind::MaxPayloadExceeded)
        || err
            .source()
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|js| js.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}

/// A header value: one line (NATS headers cannot hold CR or LF), other control characters
/// replaced.
fn header_text(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The headers of `letter`'s dead letter: the original's (but the server's `Nats-*`), the
/// context every broker's letters carry, then where the message was and who wrote the letter.
/// `Nats-Msg-Id` is derived from the original's position in its stream's incarnation, so the
/// dead-letter stream drops a letter written twice (a retried write) within its duplicate
/// window, never the letter of a re-created stream's message at the same sequence.
pub fn headers(letter: &DeadLetter<'_, Receipt>, context: WriteContext<'_>) -> HeaderMap {
    let message = letter.message;
    let mut headers = HeaderMap::new();
    for (name, value) in &message.headers {
        if !name.starts_with("Nats-") {
            headers.append(name.as_str(), String::from_utf8_lossy(value).into_owned());
        }
    }
    let seq = message.receipt.stream_sequence;
    headers.insert(
        "Nats-Msg-Id",
        format!(
            "switchboard-dlq:{}:{}:{seq}",
            context.stream, context.incarnation
        ),
    );
    for (name, value) in DeadLetterContext::new(letter).fields(Convention::Title) {
        headers.insert(name, header_text(&value));
    }
    let name = |field| Convention::Title.name(field);
    headers.insert(name("stream"), context.stream);
    headers.insert(name("stream-seq"), seq.to_string());
    headers.insert(name("stream-incarnation"), context.incarnation);
    headers.insert(
        name("subject"),
        header_text(message.receipt.subject.as_str()),
    );
    headers.insert(name("last-seen"), context.last_seen);
    headers.insert(name("consumer"), header_text(context.consumer));
    if let Some((_, id)) = message
        .headers
        .iter()
        .find(|(name, _)| name == "Nats-Msg-Id")
    {
        headers.insert(
            name("original-msg-id"),
            header_text(&String::from_utf8_lossy(id)),
        );
    }
    headers
}

/// The subject a dead letter goes to: `deadLetter.subject`, else `<stream>.dlq.<subject>`.
pub fn subject(configured: Option<&str>, stream: &str, original: &str) -> String {
    match configured {
        Some(subject) => subject.to_owned(),
        None => format!("{stream}.dlq.{original}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::dead_letter::MAX_ERROR_BYTES;
    use crate::transport::nats::NatsDelivery;
    use crate::transport::{Attempts, Message};

    fn message() -> NatsDelivery {
        Message {
            receipt: Receipt {
                reply: "$JS.ACK.ORDERS.workers.3.17.17.0.0".into(),
                stream_sequence: 17,
                subject: "orders.eu".into(),
            },
            external_id: "ORDERS:17".into(),
            idempotency_key: "nats:shop/orders:ORDERS:17".into(),
            body: b"{broken".to_vec(),
            headers: vec![
                ("Nats-Msg-Id".into(), b"order-17".to_vec()),
                ("tenant".into(), b"acme".to_vec()),
            ],
            delivery_count: 3,
            enqueued_at_ms: Some(1_764_608_400_000),
            position: None,
            undecodable: None,
        }
    }

    #[test]
    fn dead_letter_headers_carry_the_context_and_a_stable_message_id() {
        let context = WriteContext {
            stream: "ORDERS",
            incarnation: "1764608400000000000",
            consumer: "worker-0",
            last_seen: "2026-12-01T17:00:00.000Z",
        };
        let message = message();
        let letter = DeadLetter {
            message: &message,
            reason: PoisonReason::InvalidJson,
            error: format!("line one\r\nline two {}", "x".repeat(5000)),
            attempts: Attempts::default(),
        };
        let headers = headers(&letter, context);
        let get = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(get("Switchboard-Reason").as_deref(), Some("invalid_json"));
        assert_eq!(get("Switchboard-Delivery-Count").as_deref(), Some("3"));
        assert_eq!(get("Switchboard-Stream").as_deref(), Some("ORDERS"));
        assert_eq!(get("Switchboard-Stream-Seq").as_deref(), Some("17"));
        assert_eq!(get("Switchboard-Subject").as_deref(), Some("orders.eu"));
        assert_eq!(
            get("Switchboard-First-Seen").as_deref(),
            Some("2025-12-01T17:00:00.000Z")
        );
        assert_eq!(
            get("Switchboard-Last-Seen").as_deref(),
            Some("2026-12-01T17:00:00.000Z")
        );
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("switchboard-dlq:ORDERS:1764608400000000000:17")
        );
        assert_eq!(
            get("Switchboard-Original-Msg-Id").as_deref(),
            Some("order-17")
        );
        assert_eq!(get("tenant").as_deref(), Some("acme"));
        assert_eq!(
            get("Switchboard-Stream-Incarnation").as_deref(),
            Some("1764608400000000000")
        );
        assert_eq!(get("Switchboard-Consumer").as_deref(), Some("worker-0"));
        assert_eq!(
            get("Switchboard-Attempts"),
            Some(Attempts::default().to_json())
        );
        let kept = get("Switchboard-Error").expect("error");
        assert!(kept.ends_with('…'), "{kept}");
        assert!(kept.len() <= MAX_ERROR_BYTES, "{}", kept.len());
        assert!(kept.starts_with("line one  line two"), "{kept}");
    }

    #[test]
    fn default_subject_is_under_the_stream_dlq_prefix() {
        assert_eq!(subject(None, "ORDERS", "orders.eu"), "ORDERS.dlq.orders.eu");
        assert_eq!(
            subject(Some("dead.orders"), "ORDERS", "orders.eu"),
            "dead.orders"
        );
    }
}
