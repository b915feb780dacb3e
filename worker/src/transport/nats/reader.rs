//! The NATS dead-letter reader (`switchboard-worker dlq`): the stream that holds the adapter's
//! dead-letter subject (`<stream>_DLQ` when the worker created it), read without a consumer.
//!
//! - **List**: by stream sequence, one `STREAM.MSG.GET` "first message on the dead-letter
//!   subject at or after this sequence" per letter: nothing is delivered, acknowledged or
//!   hidden, and a page costs as many requests as it holds letters, whatever the stream's size.
//! - **Show**: a letter's id is its sequence in the dead-letter stream: one `STREAM.MSG.GET`.
//! - **Redrive**: publishes the body and the original headers (not the server's `Nats-*`, so
//!   the source stream's duplicate window cannot drop the copy) to the original subject with
//!   [`IDEMPOTENCY_KEY_HEADER`] = `nats:{adapter}:{stream}:{incarnation}:{seq}`, waits for the
//!   source stream's PubAck, and only then deletes the letter by sequence. A redrive killed in
//!   between leaves the letter and a copy: run again, it publishes a second copy with the same
//!   key, which the worker stores as the same todo.
//! - **Purge**: deletes by sequence.

use async_nats::HeaderMap;
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use async_nats::jetstream::{self};
use switchboard_api::{NatsSource, QueueAdapter};

use super::{Connector, DEAD_LETTER_SETTING, SEND_TIMEOUT};
use crate::transport::dead_letter::Convention;
use crate::transport::reader::{Cursor, DeadLetterReader, Page, StoredLetter, redrive_key};
use crate::transport::{Attempts, IDEMPOTENCY_KEY_HEADER, TransportError};

/// The dead-letter stream of a NATS adapter.
#[derive(Debug)]
pub struct NatsReader {
    js: jetstream::Context,
    /// The stream holding the letters; `None` when no stream holds the subject (no letter was
    /// ever written).
    stream: Option<Stream>,
    /// The letters' subjects in it (`ORDERS.dlq.>`, or `deadLetter.subject`).
    subjects: String,
    /// Where the letters came from, for people.
    source_stream: String,
    /// `nats:{adapter}`.
    source: String,
}

/// A `Switchboard-*` header's name.
fn context_name(field: &str) -> String {
    Convention::Title.name(field)
}

impl NatsReader {
    /// Connects and finds the stream that holds the adapter's dead-letter subject.
    pub async fn new(
        adapter: &QueueAdapter,
        nats: &NatsSource,
        connector: Connector,
    ) -> Result<Self, TransportError> {
        let client = connector.connect(None).await?;
        let js = jetstream::new(client);
        let configured = adapter.spec.delivery.dead_letter.subject.clone();
        let (sample, subjects) = match configured {
            Some(subject) => (subject.clone(), subject),
            None => (
                format!("{}.dlq.x", nats.stream),
                format!("{}.dlq.>", nats.stream),
            ),
        };
        let stream = match js.stream_by_subject(sample.clone()).await {
            Ok(name) => Some(js.get_stream(&name).await.map_err(|err| {
                TransportError::transient("cannot open the dead-letter stream", err)
            })?),
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::NotFound) => None,
            Err(err) if matches!(err.kind(), GetStreamByNameErrorKind::InvalidSubject) => {
                return Err(TransportError::fatal(
                    DEAD_LETTER_SETTING,
                    format!("{sample} is not a valid subject"),
                    None,
                ));
            }
            Err(err) => {
                return Err(TransportError::transient(
                    "cannot look up the dead-letter stream",
                    err,
                ));
            }
        };
        Ok(Self {
            js,
            stream,
            subjects,
            source_stream: nats.stream.clone(),
            source: format!("nats:{}", adapter.adapter_name()),
        })
    }

    /// The first letter at or after `sequence`; `None` past the last.
    async fn first_from(&self, sequence: u64) -> Result<Option<StreamMessage>, TransportError> {
        let Some(stream) = &self.stream else {
            return Ok(None);
        };
        match stream
            .get_first_raw_message_by_subject(&self.subjects, sequence)
            .await
        {
            Ok(message) => Ok(Some(message)),
            Err(err) if matches!(err.kind(), RawMessageErrorKind::NoMessageFound) => Ok(None),
            Err(err) => Err(TransportError::transient(
                "cannot read the dead-letter stream",
                err,
            )),
        }
    }
}

/// A dead-letter stream message as a letter (see `dead_letter::headers`).
fn nats_letter(message: StreamMessage) -> StoredLetter {
    let headers = &message.headers;
    let text = |field: &str| {
        headers
            .get(context_name(field).as_str())
            .map(|value| value.as_str().to_owned())
    };
    let original_id = match (
        text("stream"),
        text("stream-incarnation"),
        text("stream-seq"),
    ) {
        (Some(stream), Some(incarnation), Some(seq)) => {
            Some(format!("{stream}:{incarnation}:{seq}"))
        }
        _ => None,
    };
    let mut originals: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        if name.starts_with("Switchboard-") || name.starts_with("Nats-") {
            continue;
        }
        for value in values {
            originals.push((name.to_owned(), value.as_str().as_bytes().to_vec()));
        }
    }
    originals.sort();
    let id = message.sequence.to_string();
    StoredLetter {
        dead_lettered_at_ms: u64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).ok(),
        reason: text("reason"),
        delivery_count: text("delivery-count").and_then(|count| count.parse().ok()),
        last_error: text("error"),
        body: message.payload.to_vec(),
        headers: originals,
        attempts: text("attempts").and_then(|json| serde_json::from_str::<Attempts>(&json).ok()),
        origin: format!(
            "stream {}, sequence {}, subject {}",
            text("stream").unwrap_or_default(),
            text("stream-seq").unwrap_or_else(|| "?".to_owned()),
            text("subject").unwrap_or_else(|| "?".to_owned())
        ),
        original_id,
        handle: format!(
            "{}\n{}",
            message.sequence,
            text("subject").unwrap_or_default()
        ),
        id,
    }
}

/// The dead-letter stream sequence and the original subject in a letter's handle.
fn handle_parts(letter: &StoredLetter) -> (Option<u64>, &str) {
    let (sequence, subject) = letter
        .handle
        .split_once('\n')
        .unwrap_or((&letter.handle, ""));
    (sequence.parse().ok(), subject)
}

impl DeadLetterReader for NatsReader {
    fn destination(&self) -> String {
        match &self.stream {
            Some(stream) => format!(
                "NATS stream {} ({})",
                stream.cached_info().config.name,
                self.subjects
            ),
            None => format!("NATS subject {} (no stream holds it yet)", self.subjects),
        }
    }

    fn source(&self) -> String {
        format!("NATS stream {}", self.source_stream)
    }

    fn caveats(&self) -> Vec<String> {
        vec![format!(
            "redriven letters (oldest first) are new messages at the end of {}, after what was published since they dead-lettered, each on its original subject",
            self.source_stream
        )]
    }

    /// The stream's message count when it is the worker's own `<stream>_DLQ`; `None` for a
    /// stream shared with other subjects.
    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        let own = format!("{}_DLQ", self.source_stream);
        let Some(stream) = &mut self.stream else {
            return Ok(Some(0));
        };
        let info = stream.info().await.map_err(|err| {
            TransportError::transient("cannot read the dead-letter stream's state", err)
        })?;
        Ok((info.config.name == own).then_some(info.state.messages))
    }

    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        let mut sequence = after
            .and_then(|cursor| cursor.0.parse::<u64>().ok())
            .unwrap_or(1);
        let mut letters = Vec::new();
        while letters.len() < limit.max(1) {
            let Some(message) = self.first_from(sequence).await? else {
                return Ok(Page {
                    letters,
                    next: None,
                });
            };
            sequence = message.sequence + 1;
            letters.push(nats_letter(message));
        }
        Ok(Page {
            letters,
            next: Some(Cursor(sequence.to_string())),
        })
    }

    /// One `STREAM.MSG.GET` by sequence: no scan.
    async fn letter(&mut self, id: &str) -> Result<Option<StoredLetter>, TransportError> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Ok(None);
        };
        Ok(self
            .first_from(sequence)
            .await?
            .filter(|message| message.sequence == sequence)
            .map(nats_letter))
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let (sequence, subject) = handle_parts(letter);
        if subject.is_empty() {
            return Err(TransportError::protocol(format!(
                "letter {} does not say which subject it came from (no {} header)",
                letter.id,
                context_name("subject")
            )));
        }
        let original = letter.original_id.as_deref().unwrap_or(&letter.id);
        let key = redrive_key(&letter.headers, &self.source, original);
        let mut headers = header_map(&letter.headers, |name| name != IDEMPOTENCY_KEY_HEADER);
        headers.insert(IDEMPOTENCY_KEY_HEADER, key.as_str());
        publish_confirmed(&self.js, subject.to_owned(), headers, &letter.body).await?;
        self.delete(sequence).await
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for letter in letters {
            self.delete(handle_parts(letter).0).await?;
        }
        Ok(())
    }
}

impl NatsReader {
    /// Deletes the letter at `sequence` (one already gone is gone).
    async fn delete(&self, sequence: Option<u64>) -> Result<(), TransportError> {
        let (Some(stream), Some(sequence)) = (&self.stream, sequence) else {
            return Ok(());
        };
        match stream.delete_message(sequence).await {
            Ok(_) => Ok(()),
            Err(err) if err.to_string().contains("no message found") => Ok(()),
            Err(err) => Err(TransportError::transient(
                "cannot delete the dead letter",
                err,
            )),
        }
    }
}

/// `headers` as NATS headers (values as text), those `keep` accepts.
pub(crate) fn header_map(headers: &[(String, Vec<u8>)], keep: impl Fn(&str) -> bool) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in headers.iter().filter(|(name, _)| keep(name)) {
        map.append(name.as_str(), String::from_utf8_lossy(value).into_owned());
    }
    map
}

/// Publishes `body` with `headers` to `subject` and waits for the stream's PubAck, within twice
/// [`SEND_TIMEOUT`] (the redrive's copy, `switchboard-worker send`).
pub(crate) async fn publish_confirmed(
    js: &jetstream::Context,
    subject: String,
    headers: HeaderMap,
    body: &[u8],
) -> Result<jetstream::publish::PublishAck, TransportError> {
    let publish = async {
        let ack = js
            .publish_with_headers(subject, headers, body.to_vec().into())
            .await
            .map_err(|err| TransportError::transient("cannot publish the copy", err))?;
        ack.await.map_err(|err| {
            TransportError::transient("the source stream did not confirm the copy", err)
        })
    };
    tokio::time::timeout(SEND_TIMEOUT * 2, publish)
        .await
        .map_err(|elapsed| TransportError::transient("no PubAck for the copy in time", elapsed))?
}
