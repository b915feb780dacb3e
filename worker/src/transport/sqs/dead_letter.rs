//! Dead letters as `SendMessageBatch` entries: the body byte-identical, the context as message
//! attributes (SQS allows ten per message: nine of context and the attempts, or, when one had
//! to be dropped to fit the size limit, `x-dlq-dropped` naming them), within the queue's size
//! limit.

use aws_sdk_sqs::error::BuildError;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};

use super::delete_plan::BATCH_LIMIT;
use super::receive::Receipt;
use crate::payload::fields_json;
use crate::transport::dead_letter::{Convention, DeadLetterContext};
use crate::transport::{DeadLetter, truncate};

/// SQS's default (and ElasticMQ's strict) limit on one message, attributes included, and on
/// the sum of one batch call's messages.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 262_144;
/// The body written for an undecodable message SQS delivered without one (SQS requires a
/// non-empty body).
const MISSING_BODY: &str = "(the SQS message had no body)";
/// How SQS dead letters name their context attributes (`x-dlq-*`).
const CONVENTION: Convention = Convention::Dlq;

/// Context fields, in the order their attributes are dropped when a dead letter would exceed
/// the size limit: the long ones first.
const DROP_ORDER: [&str; 10] = [
    "attempts",
    "attributes",
    "error",
    "origin",
    "consumer",
    "first-seen",
    "last-seen",
    "message-id",
    "delivery-count",
    "reason",
];
/// The field naming the attributes dropped to fit (the tenth attribute).
const DROPPED: &str = "dropped";

/// What every dead letter of one write shares.
#[derive(Debug, Clone, Copy)]
pub struct WriteContext<'a> {
    /// The source queue's URL.
    pub origin: &'a str,
    pub consumer: &'a str,
    /// RFC 3339, now.
    pub last_seen: &'a str,
    /// Whether the dead-letter queue is a FIFO queue (it then needs a group and a
    /// deduplication id).
    pub fifo: bool,
    /// The dead-letter queue's `MaximumMessageSize`.
    pub max_message_bytes: usize,
}

/// One dead letter ready to send, with its size as SQS counts it.
#[derive(Debug, Clone)]
pub struct Letter {
    pub body: String,
    /// (name, data type, value)
    pub attributes: Vec<(String, &'static str, String)>,
    pub group: Option<String>,
    pub deduplication_id: Option<String>,
}

impl Letter {
    /// Body plus every attribute's name, data type and value, as SQS counts message size.
    pub fn size(&self) -> usize {
        self.body.len()
            + self
                .attributes
                .iter()
                .map(|(name, data_type, value)| name.len() + data_type.len() + value.len())
                .sum::<usize>()
    }

    /// The batch entry with id `id` (unique within its call).
    pub fn entry(&self, id: usize) -> Result<SendMessageBatchRequestEntry, BuildError> {
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(id.to_string())
            .message_body(self.body.clone())
            .set_message_group_id(self.group.clone())
            .set_message_deduplication_id(self.deduplication_id.clone());
        for (name, data_type, value) in &self.attributes {
            let attribute = MessageAttributeValue::builder()
                .data_type(*data_type)
                .string_value(value.clone())
                .build()?;
            entry = entry.message_attributes(name, attribute);
        }
        entry.build()
    }
}

/// Replaces characters SQS refuses in message text (`#x9 | #xA | #xD | #x20-#xD7FF |
/// #xE000-#xFFFD | #x10000-#x10FFFF`) by U+FFFD.
fn sqs_text(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' => c,
            c if c < ' ' || c == '\u{FFFE}' || c == '\u{FFFF}' => '\u{FFFD}',
            c => c,
        })
        .collect()
}

/// The dead letter of `letter`, dropping context attributes (longest first) until it fits
/// the limit. A body that does not fit even alone is returned as it is: the queue can never
/// take it ([`Letter::size`] over the limit), and the writer reports it refused.
pub fn letter(letter: &DeadLetter<'_, Receipt>, context: WriteContext<'_>) -> Letter {
    let message = letter.message;
    let body = if message.body.is_empty() {
        MISSING_BODY.to_owned()
    } else {
        // SQS bodies are text; the original arrived as a string.
        String::from_utf8_lossy(&message.body).into_owned()
    };
    let (group, deduplication_id) = if context.fifo {
        let group = message
            .receipt
            .group
            .clone()
            .unwrap_or_else(|| "dead-letters".to_owned());
        (Some(group), Some(truncate(&message.external_id, 128)))
    } else {
        (None, None)
    };
    let letter = Letter {
        body,
        attributes: attributes(letter, context),
        group,
        deduplication_id,
    };
    fit(letter, context.max_message_bytes)
}

/// The context attributes of `letter`'s dead letter (SQS refuses empty values: they are left
/// out). The delivery count is a `Number`, every other value a `String`.
fn attributes(
    letter: &DeadLetter<'_, Receipt>,
    context: WriteContext<'_>,
) -> Vec<(String, &'static str, String)> {
    let delivery_count = CONVENTION.name("delivery-count");
    let mut attributes: Vec<(String, &'static str, String)> = DeadLetterContext::new(letter)
        .fields(CONVENTION)
        .into_iter()
        .map(|(name, value)| {
            let data_type = if name == delivery_count {
                "Number"
            } else {
                "String"
            };
            (name, data_type, sqs_text(&value))
        })
        .collect();
    let message = letter.message;
    let mut add = |field: &str, value: String| {
        attributes.push((CONVENTION.name(field), "String", value));
    };
    add("last-seen", context.last_seen.to_owned());
    add("origin", context.origin.to_owned());
    add("message-id", message.external_id.clone());
    add("consumer", sqs_text(context.consumer));
    add("attributes", fields_json(&message.headers));
    attributes.retain(|(_, _, value)| !value.is_empty());
    attributes
}

/// `letter` with context attributes dropped in [`DROP_ORDER`] until it fits `max` bytes, and
/// the attribute naming those dropped when it still fits then.
fn fit(mut letter: Letter, max: usize) -> Letter {
    let fits = |letter: &Letter, dropped: &[String]| letter.size() + dropped_size(dropped) <= max;
    let mut dropped: Vec<String> = Vec::new();
    for field in DROP_ORDER {
        if fits(&letter, &dropped) {
            break;
        }
        let name = CONVENTION.name(field);
        if let Some(at) = letter.attributes.iter().position(|(n, _, _)| *n == name) {
            letter.attributes.remove(at);
            dropped.push(name);
        }
    }
    if !dropped.is_empty() && fits(&letter, &dropped) {
        letter
            .attributes
            .push((CONVENTION.name(DROPPED), "String", dropped.join(",")));
    }
    letter
}

/// The size of the `x-dlq-dropped` attribute naming `dropped` (none when nothing was).
fn dropped_size(dropped: &[String]) -> usize {
    if dropped.is_empty() {
        return 0;
    }
    let names = dropped.iter().map(String::len).sum::<usize>() + dropped.len() - 1;
    CONVENTION.name(DROPPED).len() + "String".len() + names
}

/// Splits letters of `sizes` into calls of at most ten entries whose sizes add up to at most
/// `max_batch_bytes` (a letter larger than that goes alone). Returns index ranges.
pub fn batches(sizes: &[usize], max_batch_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut batches = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (index, &size) in sizes.iter().enumerate() {
        let full =
            index - start == BATCH_LIMIT || (index > start && bytes + size > max_batch_bytes);
        if full {
            batches.push(start..index);
            (start, bytes) = (index, 0);
        }
        bytes += size;
    }
    if start < sizes.len() {
        batches.push(start..sizes.len());
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::dead_letter::MAX_ERROR_BYTES;
    use crate::transport::sqs::receive::SqsDelivery;
    use crate::transport::{Attempts, Message};

    fn message(body: &str, headers: Vec<(String, Vec<u8>)>) -> SqsDelivery {
        Message {
            receipt: Receipt {
                handle: "h".into(),
                group: Some("g1".into()),
            },
            external_id: "m-1".into(),
            idempotency_key: "sqs:a/b:m-1".into(),
            body: body.as_bytes().to_vec(),
            headers,
            delivery_count: 4,
            enqueued_at_ms: Some(1_700_000_000_000),
            position: None,
            undecodable: None,
        }
    }

    fn dead<'a>(
        message: &'a SqsDelivery,
        reason: PoisonReason,
        error: &str,
    ) -> DeadLetter<'a, Receipt> {
        DeadLetter {
            message,
            reason,
            error: error.into(),
            attempts: Attempts::default(),
        }
    }

    fn context(fifo: bool, max: usize) -> WriteContext<'static> {
        WriteContext {
            origin: "http://127.0.0.1:9324/000000000000/orders.fifo",
            consumer: "worker-0",
            last_seen: "2026-12-01T10:00:00.000Z",
            fifo,
            max_message_bytes: max,
        }
    }

    fn attribute<'a>(letter: &'a Letter, name: &str) -> Option<&'a str> {
        letter
            .attributes
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, _, v)| v.as_str())
    }

    #[test]
    fn dead_letter_keeps_the_body_and_carries_its_context_in_at_most_ten_attributes() {
        let headers = vec![("MessageGroupId".to_owned(), b"g1".to_vec())];
        let letter = letter(
            &dead(
                &message("{\"id\": 1} ", headers),
                PoisonReason::InvalidJson,
                "expected value",
            ),
            context(true, DEFAULT_MAX_MESSAGE_BYTES),
        );
        assert_eq!(letter.body, "{\"id\": 1} ");
        assert!(letter.attributes.len() <= 10);
        assert_eq!(attribute(&letter, "x-dlq-reason"), Some("invalid_json"));
        assert_eq!(attribute(&letter, "x-dlq-delivery-count"), Some("4"));
        let count_type = letter
            .attributes
            .iter()
            .find(|(name, _, _)| name == "x-dlq-delivery-count")
            .map(|(_, data_type, _)| *data_type);
        assert_eq!(count_type, Some("Number"));
        assert_eq!(
            attribute(&letter, "x-dlq-first-seen"),
            Some("2023-11-14T22:13:20.000Z")
        );
        assert_eq!(
            attribute(&letter, "x-dlq-attributes"),
            Some("{\"MessageGroupId\":\"g1\"}")
        );
        assert_eq!(attribute(&letter, "x-dlq-dropped"), None);
        assert_eq!(letter.group.as_deref(), Some("g1"));
        assert_eq!(letter.deduplication_id.as_deref(), Some("m-1"));
        let standard = super::letter(
            &dead(&message("x", Vec::new()), PoisonReason::Oversize, ""),
            context(false, DEFAULT_MAX_MESSAGE_BYTES),
        );
        assert_eq!(standard.group, None);
        assert_eq!(
            attribute(&standard, "x-dlq-error"),
            None,
            "empty values are left out"
        );
    }

    #[test]
    fn a_large_body_drops_the_long_context_first_and_is_still_written() {
        let max = 4096;
        let body = "b".repeat(max - 400);
        let headers = vec![("big".to_owned(), vec![b'h'; 1000])];
        let letter = letter(
            &dead(
                &message(&body, headers),
                PoisonReason::Oversize,
                &"e".repeat(5000),
            ),
            context(false, max),
        );
        assert!(letter.size() <= max, "{} > {max}", letter.size());
        assert_eq!(letter.body, body);
        assert_eq!(attribute(&letter, "x-dlq-attempts"), None);
        assert_eq!(attribute(&letter, "x-dlq-attributes"), None);
        assert_eq!(attribute(&letter, "x-dlq-error"), None);
        assert_eq!(attribute(&letter, "x-dlq-reason"), Some("oversize"));
        assert_eq!(
            attribute(&letter, "x-dlq-dropped"),
            Some("x-dlq-attempts,x-dlq-attributes,x-dlq-error")
        );
    }

    #[test]
    fn a_body_over_the_limit_is_left_without_context_and_over_the_limit() {
        let letter = letter(
            &dead(
                &message(&"b".repeat(100), Vec::new()),
                PoisonReason::Oversize,
                "too big",
            ),
            context(false, 50),
        );
        assert_eq!(letter.body.len(), 100);
        assert!(letter.attributes.is_empty());
        assert!(
            letter.size() > 50,
            "the writer sees that the queue cannot take it"
        );
    }

    #[test]
    fn errors_are_truncated_and_cleaned_of_characters_sqs_refuses() {
        let letter = letter(
            &dead(
                &message("x", Vec::new()),
                PoisonReason::Rejected,
                &format!("bad\u{0}byte {}", "é".repeat(3000)),
            ),
            context(false, DEFAULT_MAX_MESSAGE_BYTES),
        );
        let error = attribute(&letter, "x-dlq-error").expect("error");
        assert!(error.len() <= MAX_ERROR_BYTES + 3, "{}", error.len());
        assert!(error.starts_with("bad\u{FFFD}byte"));
        assert!(error.ends_with('…'));
    }

    #[test]
    fn batches_hold_at_most_ten_letters_within_the_byte_limit() {
        let small = letter(
            &dead(&message("x", Vec::new()), PoisonReason::Rejected, "e"),
            context(false, DEFAULT_MAX_MESSAGE_BYTES),
        );
        let size = small.size();
        let sizes = vec![size; 23];
        assert_eq!(
            batches(&sizes, DEFAULT_MAX_MESSAGE_BYTES),
            vec![0..10, 10..20, 20..23]
        );
        assert_eq!(batches(&sizes[..5], size * 2), vec![0..2, 2..4, 4..5]);
        assert_eq!(
            batches(&sizes[..2], 1),
            vec![0..1, 1..2],
            "an oversized letter goes alone"
        );
    }
}
