//! Apache Kafka topics, read by a consumer group.

use std::sync::{Mutex, PoisonError};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use switchboard_api::{KafkaSource, QueueAdapter};

use super::{Context, Letters, Loop, Plugin};
use crate::WorkerError;
use crate::transport::TransportError;
use crate::transport::kafka::client::{LogContext, Setting, classify, producer_config};
use crate::transport::kafka::reader::{KafkaReader, PRODUCE_TIMEOUT};
use crate::transport::kafka::{Kafka, KafkaSettings};
use crate::transport::retention::Retention;

impl Plugin for KafkaSource {
    fn title(&self) -> &'static str {
        "Kafka"
    }

    async fn run<L: Loop>(&self, context: Context<'_>, mut run: L) -> Result<(), WorkerError> {
        let settings = KafkaSettings {
            dead_letter_topic: context.dead_letter().topic.clone(),
            dead_letter_retention: Retention::of(context.dead_letter()),
            adapter: context.name,
            consumer: context.consumer,
            spec: self.clone(),
        };
        let transport = Kafka::new(settings, context.store, run.registry())?;
        run.drive(transport, self).await
    }

    async fn read_letters<D: Letters>(
        &self,
        adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.read(KafkaReader::new(adapter, self).await?).await
    }

    /// Produces one record with `acks=all`, as the dead-letter reader's redrive does, to the
    /// adapter's topic (its one topic, else the `kafka.topic` header's), the `kafka.key` header
    /// (the record key the worker read) as its key and the other headers as record headers;
    /// returns `partition:offset`.
    async fn send(
        &self,
        _adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError> {
        let topic = topic(self, headers)?;
        let mut record_headers = OwnedHeaders::new_with_capacity(headers.len());
        for (name, value) in headers
            .iter()
            .filter(|(name, _)| name != KEY_HEADER && name != TOPIC_HEADER)
        {
            record_headers = record_headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic)
            .headers(record_headers)
            .payload(body);
        if let Some((_, key)) = headers.iter().find(|(name, _)| name == KEY_HEADER) {
            record = record.key(key.as_slice());
        }
        let producer = producer(self)?;
        let context = format!("could not produce the message to topic {topic:?}");
        let delivered = producer
            .send(record, PRODUCE_TIMEOUT)
            .await
            .map_err(|(err, _)| classify(err, &context, Setting::Topics))?;
        Ok(format!("{}:{}", delivered.partition, delivered.offset))
    }
}

/// The producer of this process's sends, made once per spec: an idempotent producer's
/// connections and producer id cost about 0.6 s, which a redrive of many kept letters would
/// otherwise pay per letter.
static PRODUCER: Mutex<Option<(KafkaSource, FutureProducer<LogContext>)>> = Mutex::new(None);

/// The producer for `kafka`, made on first use.
fn producer(kafka: &KafkaSource) -> Result<FutureProducer<LogContext>, TransportError> {
    let mut slot = PRODUCER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((spec, producer)) = slot.as_ref()
        && spec == kafka
    {
        return Ok(producer.clone());
    }
    let producer: FutureProducer<LogContext> =
        producer_config(kafka, "switchboard-worker-send", PRODUCE_TIMEOUT)?
            .create_with_context(LogContext::current())
            .map_err(|err| classify(err, "could not create the producer", Setting::Topics))?;
    *slot = Some((kafka.clone(), producer.clone()));
    Ok(producer)
}

/// The header holding a message's record key, as the transport names it.
const KEY_HEADER: &str = "kafka.key";
/// The header naming the topic to send to, for an adapter of several.
const TOPIC_HEADER: &str = "kafka.topic";

/// The topic a message goes to: the `kafka.topic` header's, else the adapter's one topic.
fn topic(kafka: &KafkaSource, headers: &[(String, Vec<u8>)]) -> Result<String, TransportError> {
    let named = super::header_text(headers, TOPIC_HEADER);
    let only = match kafka.topics.as_deref() {
        Some([topic]) => Some(topic.clone()),
        _ => None,
    };
    named.or(only).ok_or_else(|| {
        TransportError::protocol(format!(
            "spec.source.kafka reads several topics or a pattern: say which to send to with \
             --attr {TOPIC_HEADER}=TOPIC"
        ))
    })
}
