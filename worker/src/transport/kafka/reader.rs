//! The Kafka dead-letter reader (`switchboard-worker dlq`): the adapter's dead-letter topic
//! (`deadLetter.topic`, else `<topic>.dlq`), read by a consumer of its own that is assigned
//! partitions (it never joins a group) and never commits.
//!
//! - **Ids**: a letter's id is `PARTITION:OFFSET` in the dead-letter topic.
//! - **List**: partition after partition, each in offset order from its low watermark (a
//!   cursor is `PARTITION:OFFSET`), at most the page's letters; letters removed by a marker
//!   (below) are skipped.
//! - **Show**: assign the partition at the offset, read one record: no scan.
//! - **Remove**: Kafka deletes a partition's prefix only (`DeleteRecords`). Letters at the
//!   start of their partition (after letters already removed) go with it at once. A letter
//!   further in is first marked removed: a record in `<dead-letter topic>.removed` (one
//!   partition, `retention.ms=-1`, created on the first marker) whose key is
//!   `PARTITION:OFFSET`, acknowledged by all replicas; readers read every marker (at most one
//!   per letter removed out of order and still held) and skip what they mark, and the prefix is
//!   deleted as soon as the letters before it are gone. Markers whose letters Kafka deleted are
//!   deleted from the marker topic in turn.
//! - **Redrive**: the letter's key, value and original headers (not the `x-dlq-*` ones) plus
//!   [`IDEMPOTENCY_KEY_HEADER`] produced to `x-dlq-original-topic` with `acks=all`, the
//!   delivery report awaited, and only then the letter removed. A redrive killed in between
//!   leaves the letter and a copy: run again, a second copy carries the same key, which the
//!   worker stores as the same todo.

mod markers;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use base64::Engine as _;
use rdkafka::admin::AdminClient;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use switchboard_api::{KafkaSource, QueueAdapter};

use self::markers::Markers;
use super::client::{LogContext, Setting, base_config, classify, producer_config};
use super::dead_letter::refused_for_good;
use crate::transport::dead_letter::Convention;
use crate::transport::reader::{Cursor, DeadLetterReader, Page, StoredLetter, redrive_key};
use crate::transport::{Attempts, IDEMPOTENCY_KEY_HEADER, TransportError};

/// How long a metadata, watermark or admin request may take, and a read may wait for its
/// next record.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a produced copy or marker may wait for the brokers' acknowledgement.
pub(crate) const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT_ID: &str = "switchboard-worker-dlq";

/// The dead-letter topic of a Kafka adapter.
pub struct KafkaReader {
    consumer: StreamConsumer<LogContext>,
    producer: FutureProducer<LogContext>,
    admin: AdminClient<LogContext>,
    topic: String,
    partitions: Vec<i32>,
    markers: Markers,
    /// Where the letters came from, for people.
    sources: String,
    /// `kafka:{adapter}`.
    source: String,
}

/// The dead-letter topic of `adapter`: `deadLetter.topic`, else that of its one named topic.
fn dead_letter_topic(
    adapter: &QueueAdapter,
    kafka: &KafkaSource,
) -> Result<String, TransportError> {
    if let Some(topic) = &adapter.spec.delivery.dead_letter.topic {
        return Ok(topic.clone());
    }
    match kafka.topics.as_deref() {
        Some([topic]) => Ok(format!("{topic}.dlq")),
        _ => Err(TransportError::fatal(
            "spec.delivery.deadLetter.topic",
            "dlq reads one dead-letter topic: name it for an adapter of several topics or a topic pattern",
            None,
        )),
    }
}

/// `PARTITION:OFFSET`.
fn position(id: &str) -> Option<(i32, i64)> {
    let (partition, offset) = id.split_once(':')?;
    Some((partition.parse().ok()?, offset.parse().ok()?))
}

impl KafkaReader {
    /// Connects and reads the dead-letter topic's partitions and the removal markers.
    pub async fn new(adapter: &QueueAdapter, kafka: &KafkaSource) -> Result<Self, TransportError> {
        let topic = dead_letter_topic(adapter, kafka)?;
        let create = |what: &str| {
            let context = format!("could not create the dead-letter reader's {what}");
            move |err| classify(err, &context, Setting::DeadLetterTopic)
        };
        let mut config = base_config(kafka, CLIENT_ID)?;
        config
            .set("group.id", format!("{CLIENT_ID}-reader"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "earliest")
            // librdkafka fetches up to 64 MiB ahead per partition by default; a page is at
            // most 100 letters.
            .set("queued.min.messages", "200")
            .set("queued.max.messages.kbytes", "2048")
            .set("fetch.max.bytes", "2097152");
        let consumer: StreamConsumer<LogContext> = config
            .create_with_context(LogContext::current())
            .map_err(create("consumer"))?;
        let producer = producer_config(kafka, CLIENT_ID, PRODUCE_TIMEOUT)?
            .create_with_context(LogContext::current())
            .map_err(create("producer"))?;
        let admin = base_config(kafka, CLIENT_ID)?
            .create_with_context(LogContext::current())
            .map_err(create("admin client"))?;
        let partitions = partitions_of(&consumer, &topic)?.ok_or_else(|| {
            TransportError::fatal(
                "spec.delivery.deadLetter.topic",
                format!("the dead-letter topic {topic:?} does not exist"),
                None,
            )
        })?;
        let mut reader = Self {
            consumer,
            producer,
            admin,
            markers: Markers {
                topic: format!("{topic}.removed"),
                ..Markers::default()
            },
            topic,
            partitions,
            sources: kafka.topics.as_deref().unwrap_or_default().join(", "),
            source: format!("kafka:{}", adapter.adapter_name()),
        };
        reader.read_markers().await?;
        Ok(reader)
    }

    /// The low and high watermarks of `partition` of `topic`.
    fn watermarks(&self, topic: &str, partition: i32) -> Result<(i64, i64), TransportError> {
        self.consumer
            .fetch_watermarks(topic, partition, REQUEST_TIMEOUT)
            .map_err(|err| {
                TransportError::transient(
                    format!("could not read the watermarks of {topic} partition {partition}"),
                    err,
                )
            })
    }

    /// Reads `partition` of `topic` from `from` up to `high` (exclusive), handing each record to
    /// `take` until it says to stop; returns the offset after the last record read.
    async fn read(
        &self,
        topic: &str,
        partition: i32,
        (from, high): (i64, i64),
        mut take: impl FnMut(&BorrowedMessage<'_>) -> bool,
    ) -> Result<i64, TransportError> {
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, partition, Offset::Offset(from))
            .and_then(|()| self.consumer.assign(&list))
            .map_err(|err| TransportError::transient("could not assign the partition", err))?;
        let mut next = from;
        while next < high {
            let received = tokio::time::timeout(REQUEST_TIMEOUT, self.consumer.recv())
                .await
                .map_err(|elapsed| {
                    TransportError::transient(
                        format!(
                            "no record of {topic} partition {partition} at offset {next} in time"
                        ),
                        elapsed,
                    )
                })?;
            let message = received
                .map_err(|err| TransportError::transient(format!("could not read {topic}"), err))?;
            if message.topic() != topic
                || message.partition() != partition
                || message.offset() < next
            {
                continue;
            }
            next = message.offset() + 1;
            if !take(&message) {
                break;
            }
        }
        let _ = self.consumer.unassign();
        Ok(next)
    }

    /// Reads every removal marker, if the marker topic exists.
    async fn read_markers(&mut self) -> Result<(), TransportError> {
        let Some(_) = partitions_of(&self.consumer, &self.markers.topic)? else {
            return Ok(());
        };
        self.markers.exists = true;
        let (low, high) = self.watermarks(&self.markers.topic, 0)?;
        self.markers.low = low;
        let mut found = Vec::new();
        self.read(&self.markers.topic, 0, (low, high), |message| {
            if let Some((partition, offset)) = message
                .key()
                .and_then(|key| std::str::from_utf8(key).ok())
                .and_then(position)
            {
                found.push((message.offset(), partition, offset));
            }
            true
        })
        .await?;
        for (at, partition, offset) in found {
            self.markers.insert(at, partition, offset);
        }
        Ok(())
    }
}

/// The partitions of `topic`; `None` when it does not exist.
fn partitions_of(
    consumer: &StreamConsumer<LogContext>,
    topic: &str,
) -> Result<Option<Vec<i32>>, TransportError> {
    let metadata = consumer
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(|err| {
            classify(
                err,
                "could not read the dead-letter topic's metadata",
                Setting::DeadLetterTopic,
            )
        })?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    match found.error() {
        None => {}
        Some(err) if RDKafkaErrorCode::from(err) == RDKafkaErrorCode::UnknownTopicOrPartition => {
            return Ok(None);
        }
        Some(err) => {
            return Err(TransportError::protocol(format!(
                "the brokers could not describe {topic}: {}",
                RDKafkaErrorCode::from(err)
            )));
        }
    }
    let mut partitions: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
    partitions.sort_unstable();
    Ok((!partitions.is_empty()).then_some(partitions))
}

/// A dead-letter record as a letter (see `dead_letter::context_headers`).
fn kafka_letter(message: &BorrowedMessage<'_>) -> StoredLetter {
    let prefix = Convention::Dlq.name("");
    let mut context: BTreeMap<String, String> = BTreeMap::new();
    let mut originals: Vec<(String, Vec<u8>)> = Vec::new();
    if let Some(headers) = message.headers() {
        for Header { key, value } in headers.iter() {
            let value = value.unwrap_or_default();
            match key.strip_prefix(prefix.as_str()) {
                Some(field) => {
                    context.insert(
                        field.to_owned(),
                        String::from_utf8_lossy(value).into_owned(),
                    );
                }
                None => originals.push((key.to_owned(), value.to_vec())),
            }
        }
    }
    let text = |field: &str| context.get(field).cloned();
    let topic = text("original-topic").unwrap_or_default();
    let (partition, offset) = (text("original-partition"), text("original-offset"));
    let original_id = match (&partition, &offset, text("original-topic-id")) {
        (Some(p), Some(o), Some(id)) if !id.is_empty() => Some(format!("{topic}:{id}:{p}:{o}")),
        (Some(p), Some(o), _) => Some(format!("{topic}:{p}:{o}")),
        _ => None,
    };
    let key = message.key().map_or_else(
        || "-".to_owned(),
        |key| base64::engine::general_purpose::STANDARD.encode(key),
    );
    StoredLetter {
        id: format!("{}:{}", message.partition(), message.offset()),
        dead_lettered_at_ms: message
            .timestamp()
            .to_millis()
            .and_then(|ms| u64::try_from(ms).ok()),
        reason: text("reason"),
        delivery_count: text("delivery-count").and_then(|count| count.parse().ok()),
        last_error: text("error"),
        body: message.payload().unwrap_or_default().to_vec(),
        headers: originals,
        attempts: text("attempts").and_then(|json| serde_json::from_str::<Attempts>(&json).ok()),
        origin: format!(
            "topic {topic}, partition {}, offset {}",
            partition.as_deref().unwrap_or("?"),
            offset.as_deref().unwrap_or("?")
        ),
        original_id,
        handle: format!("{topic}\n{}\n{key}", u8::from(message.payload().is_some())),
    }
}

/// The original topic, whether the record had a value, and its key, from a letter's handle.
fn handle_parts(letter: &StoredLetter) -> (&str, bool, Option<Vec<u8>>) {
    let mut parts = letter.handle.splitn(3, '\n');
    let topic = parts.next().unwrap_or_default();
    let has_value = parts.next() != Some("0");
    let key = parts
        .next()
        .filter(|key| *key != "-")
        .and_then(|key| base64::engine::general_purpose::STANDARD.decode(key).ok());
    (topic, has_value, key)
}

impl DeadLetterReader for KafkaReader {
    fn destination(&self) -> String {
        format!("Kafka topic {}", self.topic)
    }

    fn source(&self) -> String {
        format!("Kafka topic {}", self.sources)
    }

    fn caveats(&self) -> Vec<String> {
        vec![
            "redriven letters are new records at the end of their original topic (same key, so the same partition under the default partitioner), after what was produced since they dead-lettered".to_owned(),
            format!("letters removed out of partition order are marked in {} until the letters before them are gone", self.markers.topic),
        ]
    }

    /// Records held (high − low watermark) less the letters marked removed.
    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        let mut count = 0;
        for &partition in &self.partitions {
            let (low, high) = self.watermarks(&self.topic, partition)?;
            let marked = self
                .markers
                .removed
                .get(&partition)
                .map_or(0, |offsets| offsets.range(low..high).count());
            count += u64::try_from(high - low).unwrap_or(0) - marked as u64;
        }
        Ok(Some(count))
    }

    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        let first = self.partitions.first().copied().unwrap_or_default();
        let (at_partition, at_offset) = after
            .and_then(|cursor| position(&cursor.0))
            .unwrap_or((first, 0));
        let mut letters = Vec::new();
        let limit = limit.max(1);
        for &partition in self.partitions.iter().filter(|p| **p >= at_partition) {
            let (low, high) = self.watermarks(&self.topic, partition)?;
            let from = if partition == at_partition {
                at_offset.max(low)
            } else {
                low
            };
            if from >= high {
                continue;
            }
            let markers = &self.markers;
            let next = self
                .read(&self.topic, partition, (from, high), |message| {
                    if !markers.contains(partition, message.offset()) {
                        letters.push(kafka_letter(message));
                    }
                    letters.len() < limit
                })
                .await?;
            if letters.len() >= limit {
                return Ok(Page {
                    letters,
                    next: Some(Cursor(format!("{partition}:{next}"))),
                });
            }
        }
        Ok(Page {
            letters,
            next: None,
        })
    }

    /// Assigns the partition at the letter's offset and reads one record: no scan.
    async fn letter(&mut self, id: &str) -> Result<Option<StoredLetter>, TransportError> {
        let Some((partition, offset)) = position(id) else {
            return Ok(None);
        };
        if !self.partitions.contains(&partition) || self.markers.contains(partition, offset) {
            return Ok(None);
        }
        let (low, high) = self.watermarks(&self.topic, partition)?;
        if !(low..high).contains(&offset) {
            return Ok(None);
        }
        let mut found = None;
        self.read(&self.topic, partition, (offset, offset + 1), |message| {
            found = (message.offset() == offset).then(|| kafka_letter(message));
            false
        })
        .await?;
        Ok(found)
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let (topic, has_value, key) = handle_parts(letter);
        if topic.is_empty() {
            return Err(TransportError::protocol(format!(
                "letter {} does not say which topic it came from (no x-dlq-original-topic header)",
                letter.id
            )));
        }
        let original = letter.original_id.as_deref().unwrap_or(&letter.id);
        let idempotency = redrive_key(&letter.headers, &self.source, original);
        let mut headers = OwnedHeaders::new_with_capacity(letter.headers.len() + 1);
        for (name, value) in &letter.headers {
            if name != IDEMPOTENCY_KEY_HEADER {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
        }
        headers = headers.insert(Header {
            key: IDEMPOTENCY_KEY_HEADER,
            value: Some(idempotency.as_bytes()),
        });
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
        if let Some(key) = &key {
            record = record.key(key.as_slice());
        }
        if has_value {
            record = record.payload(letter.body.as_slice());
        }
        let context = format!("could not produce the redriven letter to topic {topic:?}");
        self.producer
            .send(record, PRODUCE_TIMEOUT)
            .await
            .map_err(|(err, _)| {
                if refused_for_good(&err) {
                    // Sent again it is refused again: the letter stays, the command goes on.
                    TransportError::protocol(format!(
                        "{context}, it stays a dead letter: Kafka refuses it for good (a copy larger with its headers than the topic's max.message.bytes or the producer's message.max.bytes, 1000000, is refused so): {err}"
                    ))
                } else {
                    classify(err, &context, Setting::Topics)
                }
            })?;
        self.remove(std::slice::from_ref(letter)).await
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        let mut doomed: BTreeMap<i32, BTreeSet<i64>> = BTreeMap::new();
        for (partition, offset) in letters.iter().filter_map(|letter| position(&letter.id)) {
            doomed.entry(partition).or_default().insert(offset);
        }
        for (partition, offsets) in doomed {
            self.remove_from(partition, offsets).await?;
        }
        self.drop_stale_markers().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_partition_and_offset() {
        assert_eq!(position("2:41"), Some((2, 41)));
        assert_eq!(position("2"), None);
        assert_eq!(position("x:1"), None);
    }
}
