//! Dead letters: produced to `deadLetter.topic` (default `<topic>.dlq`) by an idempotent
//! producer created on the first one; key, value and headers byte-identical, plus the
//! `x-dlq-*` context. A letter the brokers refuse for good is reported as refused.

use std::time::Duration;

use futures::future::join_all;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::client::{LogContext, Setting, classify, producer_config};
use super::{Kafka, Receipt};
use crate::transport::dead_letter::{Convention, DeadLetterContext};
use crate::transport::{DeadLetter, Message, TransportError};

/// How long a dead letter may wait for the brokers' acknowledgement.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);

impl Kafka {
    /// Produces `letters` and waits for the brokers' acknowledgement of each.
    pub(super) async fn produce_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        let topics: Vec<String> = letters
            .iter()
            .map(|letter| self.dead_letter_topic(&letter.message.receipt.partition.topic))
            .collect();
        self.retention.hold(topics.iter().cloned()).await?;
        let contexts: Vec<Vec<(String, String)>> = letters.iter().map(context_headers).collect();
        let producer = self.producer()?;
        let sends = letters
            .iter()
            .zip(&topics)
            .zip(&contexts)
            .map(|((letter, topic), context)| {
                producer.send(
                    dead_letter_record(letter.message, topic, context),
                    PRODUCE_TIMEOUT,
                )
            });
        produced(join_all(sends).await, &topics)
    }

    /// The dead-letter producer, created on the first dead letter.
    fn producer(&mut self) -> Result<&FutureProducer<LogContext>, TransportError> {
        if self.producer.is_none() {
            let producer = producer_config(&self.spec, &self.producer_id, PRODUCE_TIMEOUT)?
                .create_with_context(LogContext::current())
                .map_err(|err| {
                    classify(
                        err,
                        "could not create the dead-letter producer",
                        Setting::DeadLetterTopic,
                    )
                })?;
            self.producer = Some(producer);
        }
        Ok(self.producer.as_ref().expect("created above"))
    }

    /// The dead-letter topic of records of `topic`.
    pub(super) fn dead_letter_topic(&self, topic: &str) -> String {
        self.dead_letter_topic
            .clone()
            .unwrap_or_else(|| format!("{topic}.dlq"))
    }
}

/// The dead letter of `message` to `topic`: its key, value and headers as they came (a header
/// without a value included), then the `context` headers.
fn dead_letter_record<'a>(
    message: &'a Message<Receipt>,
    topic: &'a str,
    context: &'a [(String, String)],
) -> FutureRecord<'a, [u8], [u8]> {
    let receipt = &message.receipt;
    let mut headers = OwnedHeaders::new_with_capacity(receipt.record_headers + context.len());
    for (index, (name, value)) in message.headers[..receipt.record_headers].iter().enumerate() {
        let value = (!receipt.null_headers.contains(&index)).then_some(value.as_slice());
        headers = headers.insert(Header { key: name, value });
    }
    for (name, value) in context {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    let mut record = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
    if let Some(key) = &receipt.key {
        record = record.key(key.as_slice());
    }
    if receipt.has_value {
        record = record.payload(message.body.as_slice());
    }
    record
}

/// What the produce of the letters to `topics` came to: an error that may pass is returned as
/// it is; else the letters refused for good, if any, are reported as refused.
fn produced<T, M>(
    results: Vec<Result<T, (KafkaError, M)>>,
    topics: &[String],
) -> Result<(), TransportError> {
    let mut refused = Vec::new();
    let mut refusal = None;
    for (index, result) in results.into_iter().enumerate() {
        let Err((err, _)) = result else { continue };
        if refused_for_good(&err) {
            refused.push(index);
            refusal.get_or_insert(err);
            continue;
        }
        let context = format!(
            "could not produce a dead letter to topic {:?}",
            topics[index]
        );
        return Err(classify(err, &context, Setting::DeadLetterTopic));
    }
    match refusal {
        None => Ok(()),
        Some(err) => {
            let context = format!(
                "the brokers refused {} dead letter(s) for good (topic {:?})",
                refused.len(),
                topics[refused[0]]
            );
            Err(TransportError::dead_letters_refused(
                refused,
                context,
                Some(Box::new(err)),
            ))
        }
    }
}

/// Whether the brokers (or librdkafka, before sending) refused a record for what it is, so
/// that producing it again can never succeed: too large for `message.max.bytes` (the
/// producer's or the topic's), an invalid or corrupt record, a record the topic's policy or
/// message format refuses. Everything else (brokers down, timeouts, leadership moving, a
/// different record of the same batch refused) may succeed later; a topic that does not exist
/// or is denied is a setting to fix.
pub(super) fn refused_for_good(err: &KafkaError) -> bool {
    use RDKafkaErrorCode as Code;
    matches!(
        err.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::MessageBatchTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
                | Code::InvalidTimestamp
                | Code::PolicyViolation
                | Code::UnsupportedForMessageFormat
        )
    )
}

/// The `x-dlq-*` headers of a dead letter: the context every broker's letters carry, then
/// where the record was (`x-dlq-original-topic`, `-topic-id`, `-partition`, `-offset`).
fn context_headers(letter: &DeadLetter<'_, Receipt>) -> Vec<(String, String)> {
    let receipt = &letter.message.receipt;
    // Kafka's letters have never carried `x-dlq-first-seen` (the documented headers do not
    // list it): adding it is a change of its own.
    let context = DeadLetterContext {
        first_seen: None,
        ..DeadLetterContext::new(letter)
    };
    let name = |field| Convention::Dlq.name(field);
    let mut headers = context.fields(Convention::Dlq);
    headers.extend([
        (name("original-topic"), receipt.partition.topic.to_string()),
        (
            name("original-topic-id"),
            receipt.topic_id.as_deref().unwrap_or_default().to_owned(),
        ),
        (
            name("original-partition"),
            receipt.partition.partition.to_string(),
        ),
        (name("original-offset"), receipt.offset.to_string()),
    ]);
    headers
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::Attempts;
    use crate::transport::dead_letter::MAX_ERROR_BYTES;
    use crate::transport::kafka::offsets::TopicPartition;

    #[test]
    fn dead_letter_headers_name_the_context_and_where_the_record_was() {
        let message = Message {
            receipt: Receipt {
                partition: TopicPartition {
                    topic: Arc::from("orders"),
                    partition: 2,
                },
                topic_id: Some(Arc::from("q9mX1xWbS1aJ3cR0Yk3l2w")),
                offset: 41,
                epoch: 1,
                key: None,
                has_value: true,
                record_headers: 0,
                null_headers: Vec::new(),
            },
            external_id: "orders:q9mX1xWbS1aJ3cR0Yk3l2w:2:41".into(),
            idempotency_key: "kafka:shop/orders:orders:q9mX1xWbS1aJ3cR0Yk3l2w:2:41".into(),
            body: b"{broken".to_vec(),
            headers: Vec::new(),
            delivery_count: 3,
            enqueued_at_ms: Some(1_764_608_400_000),
            position: None,
            undecodable: None,
        };
        let letter = DeadLetter {
            message: &message,
            reason: PoisonReason::InvalidJson,
            error: "x".repeat(5000),
            attempts: Attempts::default(),
        };
        let headers = context_headers(&letter);
        let get = |name: &str| {
            headers
                .iter()
                .find(|(header, _)| header == name)
                .map(|(_, value)| value.as_str())
        };
        let mut names: Vec<&str> = headers.iter().map(|(name, _)| name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "x-dlq-attempts",
                "x-dlq-delivery-count",
                "x-dlq-error",
                "x-dlq-original-offset",
                "x-dlq-original-partition",
                "x-dlq-original-topic",
                "x-dlq-original-topic-id",
                "x-dlq-reason",
            ]
        );
        assert_eq!(get("x-dlq-reason"), Some("invalid_json"));
        assert_eq!(get("x-dlq-delivery-count"), Some("3"));
        assert_eq!(get("x-dlq-original-topic"), Some("orders"));
        assert_eq!(
            get("x-dlq-original-topic-id"),
            Some("q9mX1xWbS1aJ3cR0Yk3l2w")
        );
        assert_eq!(get("x-dlq-original-partition"), Some("2"));
        assert_eq!(get("x-dlq-original-offset"), Some("41"));
        let error = get("x-dlq-error").expect("error");
        assert!(
            error.len() <= MAX_ERROR_BYTES && error.ends_with('…'),
            "{error}"
        );
    }
}
