//! The context every dead letter carries, decided once and rendered in each broker's header
//! convention: `x-dlq-*` (SQS attributes, the gateway, Kafka headers), `x-switchboard-*` (AMQP
//! headers), `Switchboard-*` (NATS headers) and snake-case JSON fields (Redis records).
//!
//! A broker's own letter writer adds what only it has (its position: topic and offset, stream
//! and sequence, queue; its original properties) by [`Convention::name`], so every field of
//! every letter is named by one rule per convention. The names are the documented contract of
//! the dead letters already written (README, each broker's *Dead letters*): they do not change.

use super::{DeadLetter, rfc3339_ms, truncate};

/// The error text a dead letter keeps.
pub const MAX_ERROR_BYTES: usize = 2048;

/// How a broker names a dead letter's context fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convention {
    /// `x-dlq-first-seen`.
    Dlq,
    /// `x-switchboard-first-seen`.
    Switchboard,
    /// `Switchboard-First-Seen`.
    Title,
    /// `first_seen`.
    Json,
}

impl Convention {
    /// The name of the field `field` (kebab-case: `first-seen`, `original-topic`).
    pub fn name(self, field: &str) -> String {
        match self {
            Self::Dlq => format!("x-dlq-{field}"),
            Self::Switchboard => format!("x-switchboard-{field}"),
            Self::Title => {
                let words: Vec<String> = field
                    .split('-')
                    .map(|word| {
                        let mut chars = word.chars();
                        chars.next().map_or_else(String::new, |first| {
                            first.to_uppercase().chain(chars).collect()
                        })
                    })
                    .collect();
                format!("Switchboard-{}", words.join("-"))
            }
            Self::Json => field.replace('-', "_"),
        }
    }
}

/// What every dead letter says about its message, whatever the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterContext {
    /// The poison reason (`invalid_json`, `max_deliveries`, …).
    pub reason: &'static str,
    /// The last error, at most [`MAX_ERROR_BYTES`].
    pub error: String,
    /// How many times the broker delivered the message.
    pub delivery_count: u64,
    /// When the broker accepted the message (RFC 3339), if it says.
    pub first_seen: Option<String>,
    /// The attempts the message went through, as JSON.
    pub attempts: String,
}

impl DeadLetterContext {
    pub fn new<R>(letter: &DeadLetter<'_, R>) -> Self {
        Self {
            reason: letter.reason.as_str(),
            error: truncate(&letter.error, MAX_ERROR_BYTES),
            delivery_count: letter.message.delivery_count,
            first_seen: letter.message.enqueued_at_ms.map(rfc3339_ms),
            attempts: letter.attempts.to_json(),
        }
    }

    /// The context's fields named in `convention`, in a fixed order: reason, error, delivery
    /// count, first seen (when known), attempts.
    pub fn fields(&self, convention: Convention) -> Vec<(String, String)> {
        let mut fields = vec![
            (convention.name("reason"), self.reason.to_owned()),
            (convention.name("error"), self.error.clone()),
            (
                convention.name("delivery-count"),
                self.delivery_count.to_string(),
            ),
        ];
        if let Some(first_seen) = &self.first_seen {
            fields.push((convention.name("first-seen"), first_seen.clone()));
        }
        fields.push((convention.name("attempts"), self.attempts.clone()));
        fields
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::{Attempts, Message};

    #[test]
    fn every_convention_names_a_field_by_one_rule() {
        let names = |field| {
            [
                Convention::Dlq,
                Convention::Switchboard,
                Convention::Title,
                Convention::Json,
            ]
            .map(|convention| convention.name(field))
        };
        assert_eq!(
            names("first-seen"),
            [
                "x-dlq-first-seen",
                "x-switchboard-first-seen",
                "Switchboard-First-Seen",
                "first_seen"
            ]
        );
        assert_eq!(names("reason")[2], "Switchboard-Reason");
        assert_eq!(names("stream-seq")[2], "Switchboard-Stream-Seq");
    }

    #[test]
    fn context_truncates_the_error_and_skips_an_unknown_first_seen() {
        let message = Message {
            receipt: (),
            external_id: "1".into(),
            idempotency_key: "k".into(),
            body: b"{".to_vec(),
            headers: vec![],
            delivery_count: 3,
            enqueued_at_ms: None,
            position: None,
            undecodable: None,
        };
        let letter = DeadLetter {
            message: &message,
            reason: PoisonReason::InvalidJson,
            error: "é".repeat(MAX_ERROR_BYTES),
            attempts: Attempts::default(),
        };
        let context = DeadLetterContext::new(&letter);
        assert!(context.error.len() <= MAX_ERROR_BYTES);
        let fields = context.fields(Convention::Dlq);
        let names: Vec<&str> = fields.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "x-dlq-reason",
                "x-dlq-error",
                "x-dlq-delivery-count",
                "x-dlq-attempts"
            ]
        );
        assert_eq!(fields[2].1, "3");
    }
}
