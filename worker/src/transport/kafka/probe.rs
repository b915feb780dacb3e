//! Queue health of a consumer group, read on its own connection (a consumer that never joins
//! the group and never commits): lag per partition (high watermark − committed offset),
//! summed, and the age of the oldest un-committed record, from its timestamp. A partition with
//! no committed offset counts from where the group would start: its low watermark under
//! `startFrom: earliest`, its high watermark (nothing to read) under `startFrom: latest`. The
//! transport commits past transaction markers, so they are not counted either.
//!
//! The dead letters: the records each dead-letter topic still holds (high − low watermark,
//! summed over its partitions: letters redriven but not yet expired count too, as Kafka
//! deletes by retention, not by consumption) and the age of the oldest, from the timestamp of
//! each partition's first record. Read for `deadLetter.topic`, else for `<topic>.dlq` of
//! each named topic; not for the default dead-letter topics of a `topicPattern`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use switchboard_api::StartFrom;
use switchboard_telemetry::metrics::register;

use super::client::{LogContext, Setting, classify};
use crate::health::now_ms;
use crate::transport::{QueueHealth, QueueProbe, TransportError};

/// How long one broker request of the probe may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the probe waits for the oldest un-committed records.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// The labels of the per-partition lag gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PartitionLabels {
    pub adapter: String,
    pub topic: String,
    pub partition: String,
}

/// The per-partition lag gauge, registered in `registry`.
pub fn register_lag(registry: &mut Registry) -> Family<PartitionLabels, Gauge> {
    register(
        registry,
        "kafka_partition_lag",
        "Records of each partition past the group's committed offset (high watermark − committed)",
        Family::default(),
    )
}

/// The topics a source reads.
#[derive(Debug, Clone)]
pub enum Topics {
    Named(Vec<String>),
    Pattern(regex::Regex),
}

impl Topics {
    pub fn matches(&self, topic: &str) -> bool {
        match self {
            Topics::Named(names) => names.iter().any(|name| name == topic),
            Topics::Pattern(pattern) => pattern.is_match(topic),
        }
    }
}

/// Reads the group's lag on its own consumer.
pub struct KafkaProbe {
    pub consumer: Arc<BaseConsumer<LogContext>>,
    pub topics: Topics,
    pub start_from: StartFrom,
    pub adapter: String,
    pub lag: Family<PartitionLabels, Gauge>,
    /// The dead-letter topics whose depth is read (see the module doc).
    pub dead_letter_topics: Vec<String>,
}

impl QueueProbe for KafkaProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let consumer = self.consumer.clone();
        let topics = self.topics.clone();
        let start_from = self.start_from;
        let dead_letter_topics = self.dead_letter_topics.clone();
        let (lags, dead_letters) = crate::task::spawn_blocking(move || {
            let lags = partition_lags(&consumer, &topics, start_from)?;
            let dead_letters = (!dead_letter_topics.is_empty())
                .then(|| dead_letter_depth(&consumer, &dead_letter_topics))
                .transpose()?;
            Ok::<_, TransportError>((lags, dead_letters))
        })
        .await
        .map_err(|err| TransportError::protocol(format!("the probe task failed: {err}")))??;
        let mut backlog = 0;
        for lag in &lags {
            backlog += lag.lag;
            self.lag
                .get_or_create(&PartitionLabels {
                    adapter: self.adapter.clone(),
                    topic: lag.topic.clone(),
                    partition: lag.partition.to_string(),
                })
                .set(i64::try_from(lag.lag).unwrap_or(i64::MAX));
        }
        let oldest = lags.iter().filter_map(|lag| lag.oldest_ms).min();
        Ok(QueueHealth {
            backlog: Some(backlog),
            pending: None,
            oldest_pending_age: oldest.map(|ms| Duration::from_millis(now_ms().saturating_sub(ms))),
            dead_letters: dead_letters.map(|(count, _)| count),
            oldest_dead_letter_age: dead_letters.and_then(|(_, oldest)| oldest),
        })
    }
}

struct PartitionLag {
    topic: String,
    partition: i32,
    lag: u64,
    /// The timestamp of the partition's oldest un-committed record (Unix ms).
    oldest_ms: Option<u64>,
}

fn failed(context: &'static str) -> impl Fn(rdkafka::error::KafkaError) -> TransportError {
    move |err| classify(err, context, Setting::Topics)
}

fn partition_lags(
    consumer: &BaseConsumer<LogContext>,
    topics: &Topics,
    start_from: StartFrom,
) -> Result<Vec<PartitionLag>, TransportError> {
    let metadata = match topics {
        Topics::Named(names) if names.len() == 1 => {
            consumer.fetch_metadata(Some(&names[0]), REQUEST_TIMEOUT)
        }
        _ => consumer.fetch_metadata(None, REQUEST_TIMEOUT),
    }
    .map_err(failed("could not read the topics' metadata"))?;
    let mut wanted = TopicPartitionList::new();
    for topic in metadata.topics() {
        if topic.error().is_some() || !topics.matches(topic.name()) {
            continue;
        }
        for partition in topic.partitions() {
            wanted.add_partition(topic.name(), partition.id());
        }
    }
    let committed = consumer
        .committed_offsets(wanted, REQUEST_TIMEOUT)
        .map_err(failed("could not read the group's committed offsets"))?;
    let mut lags = Vec::new();
    let mut unread = TopicPartitionList::new();
    for element in committed.elements() {
        let (low, high) = consumer
            .fetch_watermarks(element.topic(), element.partition(), REQUEST_TIMEOUT)
            .map_err(failed("could not read the partitions' watermarks"))?;
        let from = match (element.offset(), start_from) {
            (Offset::Offset(offset), _) => offset.max(low),
            (_, StartFrom::Earliest) => low,
            (_, StartFrom::Latest) => high,
        };
        let lag = u64::try_from(high - from).unwrap_or(0);
        if lag > 0 {
            let _ = unread.add_partition_offset(
                element.topic(),
                element.partition(),
                Offset::Offset(from),
            );
        }
        lags.push(PartitionLag {
            topic: element.topic().to_owned(),
            partition: element.partition(),
            lag,
            oldest_ms: None,
        });
    }
    if unread.count() > 0 {
        oldest_timestamps(consumer, &unread, &mut lags)?;
    }
    Ok(lags)
}

/// The records the dead-letter `topics` hold, and the age of the oldest (zero when none).
fn dead_letter_depth(
    consumer: &BaseConsumer<LogContext>,
    topics: &[String],
) -> Result<(u64, Option<Duration>), TransportError> {
    let mut held = Vec::new();
    let mut first = TopicPartitionList::new();
    for name in topics {
        let metadata = consumer
            .fetch_metadata(Some(name), REQUEST_TIMEOUT)
            .map_err(failed("could not read the dead-letter topic's metadata"))?;
        for topic in metadata.topics().iter().filter(|t| t.error().is_none()) {
            for partition in topic.partitions() {
                let (low, high) = consumer
                    .fetch_watermarks(topic.name(), partition.id(), REQUEST_TIMEOUT)
                    .map_err(failed("could not read the dead-letter topic's watermarks"))?;
                let depth = u64::try_from(high - low).unwrap_or(0);
                if depth > 0 {
                    let _ = first.add_partition_offset(
                        topic.name(),
                        partition.id(),
                        Offset::Offset(low),
                    );
                }
                held.push(PartitionLag {
                    topic: topic.name().to_owned(),
                    partition: partition.id(),
                    lag: depth,
                    oldest_ms: None,
                });
            }
        }
    }
    let count = held.iter().map(|partition| partition.lag).sum();
    if count == 0 {
        return Ok((0, Some(Duration::ZERO)));
    }
    oldest_timestamps(consumer, &first, &mut held)?;
    let oldest = held
        .iter()
        .filter_map(|partition| partition.oldest_ms)
        .min();
    Ok((
        count,
        oldest.map(|ms| Duration::from_millis(now_ms().saturating_sub(ms))),
    ))
}

/// Reads the first record of each partition of `unread` (from its offset) for its timestamp.
fn oldest_timestamps(
    consumer: &BaseConsumer<LogContext>,
    unread: &TopicPartitionList,
    lags: &mut [PartitionLag],
) -> Result<(), TransportError> {
    consumer
        .assign(unread)
        .map_err(|err| classify(err, "could not read the oldest records", Setting::Topics))?;
    let deadline = Instant::now() + FETCH_TIMEOUT;
    let mut missing = unread.count();
    while missing > 0 && Instant::now() < deadline {
        let Some(Ok(record)) = consumer.poll(deadline.saturating_duration_since(Instant::now()))
        else {
            continue;
        };
        let Some(lag) = lags
            .iter_mut()
            .find(|lag| lag.topic == record.topic() && lag.partition == record.partition())
        else {
            continue;
        };
        if lag.oldest_ms.is_none() {
            lag.oldest_ms = record
                .timestamp()
                .to_millis()
                .and_then(|ms| u64::try_from(ms).ok());
            missing -= 1;
        }
    }
    let _ = consumer.unassign();
    Ok(())
}
