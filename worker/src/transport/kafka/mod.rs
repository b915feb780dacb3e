//! Apache Kafka: a consumer group (cooperative-sticky assignment) → (store) → offset commits of
//! each partition's contiguous settled prefix.
//!
//! - **Client**: librdkafka (bundled, via `rdkafka`); TLS verifies the brokers' certificates and
//!   host names; SASL PLAIN or SCRAM from the `KAFKA_SASL_*` variables the operator sets from the
//!   spec's Secret references. Auto-commit is off; `isolation.level` is librdkafka's default
//!   `read_committed`, so aborted transactions are never delivered.
//! - **`prepare`** checks that every named topic exists (fatal otherwise, naming
//!   `spec.source.kafka.topics`), then subscribes (a `topicPattern` is librdkafka's `^` regex).
//! - **Receive**: the records librdkafka has fetched, up to the batch size (a receive that
//!   waited for its first record gathers more for up to 100 ms: the pipeline is idle then), each
//!   offset of a partition once. The key is `kafka:{adapter}:{topic}:{topic-id}:{partition}:{offset}`
//!   (`kafka:{adapter}:{topic}:{partition}:{offset}` where the brokers keep no topic ids, before
//!   Kafka 2.8): a topic deleted and created again re-uses its offsets, never its id. The
//!   record's headers become the event's headers and its key (any bytes) the `kafka.key` header;
//!   the pipeline encodes what is not UTF-8 text. A record without a value (a tombstone) or
//!   whose header names are not UTF-8 is undecodable: it is dead-lettered.
//! - **Incarnations**: see [`topic_id`]. A record carries no topic id, so its keys are set only
//!   once its incarnation is certain: the ids of the topics in hand are read (`DescribeTopics`)
//!   after their records were taken from librdkafka, before they are handed on, and a record
//!   takes that id only if the same id had been read before its partition's epoch began (before
//!   its fetch). Ids are never re-used, so the topic was that incarnation all along, and so was
//!   every record fetched in between. A topic the brokers do not describe (deleted) holds its
//!   records; a new id (the topic was re-created) is logged once and the topic's partitions are
//!   read again from their beginning under new epochs (records in hand dropped, the old
//!   incarnation's acknowledgements stale); records fetched before their topic's id was first
//!   read (a topic a pattern picked up later) are fetched again. The ids are also read every
//!   maintenance, so an idle worker notices a re-creation.
//! - **Its own dead letters**: a subscription that includes the dead-letter topic (a pattern
//!   matching `<topic>.dlq`, or `deadLetter.topic` itself) is fatal at start, naming both
//!   settings, and so is a record of it that reaches the worker anyway.
//! - **Delivery count**: Kafka has none, so the worker keeps its own in PostgreSQL
//!   (`switchboard_store::deliveries`): before a batch is handed on, its partitions' *marks* (the
//!   offset up to which records have been handed to a pipeline) are raised in one statement.
//!   A record below the mark its partition had before may have been delivered before (a worker
//!   died, or the partition moved): only such records are counted, by key. A record at or above it
//!   is a first delivery and writes nothing. So a record that kills every worker it reaches
//!   still reaches `maxDeliveries`, and the steady state costs one small upsert per batch.
//! - **Acknowledge**: settled records (stored, duplicate, dead-lettered) are marked in
//!   [`offsets::Offsets`]; each partition commits only its contiguous settled prefix
//!   (asynchronously: a failed commit is sent again with the next one, or by `maintain`).
//! - **Rebalances**: on revoke, the settled prefix of each revoked partition is committed
//!   (synchronously) before it goes, and nothing is committed for a partition no longer owned
//!   (a *lost* assignment commits nothing at all). Batches of a revoked partition still in
//!   flight are abandoned: their acknowledgements are stale, and the new owner's redelivery is
//!   deduplicated by the idempotency key. Each assignment is an epoch carried by its receipts,
//!   so a partition assigned back never takes an acknowledgement of its earlier assignment.
//! - **Dead letters**: produced to `deadLetter.topic` (default `<topic>.dlq`) with `acks=all`
//!   and idempotence; the key, value and headers byte-identical, plus `x-dlq-reason`,
//!   `x-dlq-error`, `x-dlq-original-topic/topic-id/partition/offset` and
//!   `x-dlq-delivery-count`. The pipeline commits past a dead letter only once its produce is
//!   acknowledged. A letter the brokers refuse for good (too large, an invalid record, a
//!   policy) is reported as refused: the pipeline keeps it in PostgreSQL instead.
//! - **Backlog**: once everything delivered of a partition is settled, the consumer's position
//!   is committed (past transaction markers and aborted records, which are never delivered), so
//!   the group's lag counts only records still to be read.
//! - **Queue health**: see [`probe`].

mod client;
mod offsets;
mod probe;
mod topic_id;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::future::join_all;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use switchboard_api::{KafkaSource, StartFrom};
use switchboard_store::{Dedup, Store};

use self::client::{ConsumerState, KafkaContext, LogContext, Setting, base_config, classify};
use self::offsets::{Offsets, TopicPartition};
use self::probe::{KafkaProbe, Topics};
use self::topic_id::{Described, describe_topics};
use crate::metrics::adapter_counter;
use crate::transport::{Acked, DeadLetter, Message, Transport, TransportError};

/// How long an owned partition with a backlog may deliver nothing, with nothing of it in flight,
/// before its fetch is restarted: librdkafka can leave a partition assigned after a cooperative
/// rebalance without ever fetching it (its lag then grows until the worker restarts).
const STALLED_AFTER: Duration = Duration::from_secs(30);
/// How long a blocking receive waits for records.
const RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// How long a blocking receive gathers more records after its first one.
const GATHER: Duration = Duration::from_millis(100);
/// How long a metadata request or a synchronous commit may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a dead letter may wait for the brokers' acknowledgement.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);
/// The error text kept in `x-dlq-error`.
const MAX_ERROR_BYTES: usize = 2048;
/// The header holding the record's key among the event's headers.
const KEY_HEADER: &str = "kafka.key";
/// How far librdkafka fetches ahead of the pipeline: records per partition
/// (`queued.min.messages`) and KiB in all (`queued.max.messages.kbytes`).
const PREFETCH_RECORDS: u32 = 10_000;
const PREFETCH_KIB: u32 = 8 * 1024;

/// What the Kafka transport needs.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    /// `namespace/name`.
    pub adapter: String,
    /// The pod's name: the client id the brokers show.
    pub consumer: String,
    pub spec: KafkaSource,
    /// `spec.delivery.deadLetter.topic`; default `<topic>.dlq`.
    pub dead_letter_topic: Option<String>,
}

/// What the worker needs to commit one record, and to dead-letter it as it came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub partition: TopicPartition,
    /// The topic's id (its incarnation); `None` where the brokers keep none.
    pub topic_id: Option<Arc<str>>,
    pub offset: i64,
    /// The assignment of the partition the record was delivered under.
    pub epoch: u64,
    pub key: Option<Vec<u8>>,
    /// Whether the record had a value (a tombstone has none).
    pub has_value: bool,
    /// How many of the message's headers are the record's own (the key header follows them).
    pub record_headers: usize,
    /// Which of those had no value (`null`, not empty).
    pub null_headers: Vec<usize>,
}

impl Receipt {
    /// `{topic}:{topic-id}:{partition}` (`{topic}:{partition}` without a topic id): the
    /// partition of one incarnation of its topic, as keys and delivery marks name it.
    fn incarnation(&self) -> String {
        let TopicPartition { topic, partition } = &self.partition;
        match &self.topic_id {
            Some(id) => format!("{topic}:{id}:{partition}"),
            None => format!("{topic}:{partition}"),
        }
    }
}

/// What is known of a topic's incarnation.
#[derive(Debug, Clone)]
struct Incarnation {
    /// The topic's id; `None` where the brokers keep none.
    id: Option<Arc<str>>,
    /// When the first read that returned this id completed: the topic was this incarnation
    /// then, and is until a read returns another id.
    seen: Instant,
}

/// A record fetched and not yet handed on.
#[derive(Debug)]
struct Fetched {
    message: Message<Receipt>,
    /// Whether its topic's incarnation is known (its keys are set).
    identified: bool,
    /// Decided once the partition's mark was raised: whether the record may be a redelivery.
    below_mark: Option<bool>,
}

/// The highest offset in hand of each partition under its epoch: a fetch restarted while its
/// records were still in hand delivers them again, and a batch never holds an offset twice.
#[derive(Debug, Default)]
struct InHand(HashMap<TopicPartition, (u64, i64)>);

impl InHand {
    /// Whether the record at `offset` is new (past every one in hand of its partition and epoch).
    fn admit(&mut self, partition: &TopicPartition, epoch: u64, offset: i64) -> bool {
        match self.0.get_mut(partition) {
            Some((held_epoch, last)) if *held_epoch == epoch => {
                let new = offset > *last;
                *last = (*last).max(offset);
                new
            }
            _ => {
                self.0.insert(partition.clone(), (epoch, offset));
                true
            }
        }
    }
}

/// A Kafka consumer group member.
pub struct Kafka {
    source: String,
    adapter: String,
    spec: KafkaSource,
    consumer: Arc<StreamConsumer<KafkaContext>>,
    state: Arc<ConsumerState>,
    producer: Option<FutureProducer<LogContext>>,
    producer_id: String,
    dead_letter_topic: Option<String>,
    store: Store,
    fetched: VecDeque<Fetched>,
    in_hand: InHand,
    /// The id of each topic read (its incarnation), as last described.
    topic_ids: HashMap<Arc<str>, Incarnation>,
    probe: Arc<BaseConsumer<LogContext>>,
    lag: Family<probe::PartitionLabels, prometheus_client::metrics::gauge::Gauge>,
}

impl Kafka {
    /// Builds the clients (connections are made lazily by librdkafka) and registers the
    /// transport's metrics in `registry`.
    pub fn new(
        settings: KafkaSettings,
        store: Store,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let KafkaSettings {
            adapter,
            consumer: client_id,
            spec,
            dead_letter_topic,
        } = settings;
        let group = spec.group_id(&adapter);
        let session_ms = u64::from(spec.session_timeout_seconds) * 1000;
        let state = Arc::new(ConsumerState {
            offsets: Mutex::new(Offsets::default()),
            rebalances: adapter_counter(
                registry,
                "kafka_rebalances",
                "Partition assignments and revocations this worker took part in",
                &adapter,
            ),
            abandoned: adapter_counter(
                registry,
                "kafka_abandoned_records",
                "Records of revoked partitions still being stored at the revocation (redelivered to the new owner and deduplicated)",
                &adapter,
            ),
            commit_failures: adapter_counter(
                registry,
                "kafka_commit_failures",
                "Offset commits the brokers refused or did not answer (sent again)",
                &adapter,
            ),
            fetch_restarts: adapter_counter(
                registry,
                "kafka_fetch_restarts",
                "Fetches restarted of partitions that held a backlog and delivered nothing",
                &adapter,
            ),
        });
        let lag =
            Family::<probe::PartitionLabels, prometheus_client::metrics::gauge::Gauge>::default();
        registry.register(
            "kafka_partition_lag",
            "Records of each partition past the group's committed offset (high watermark − committed)",
            lag.clone(),
        );
        let start_from = match spec.start_from {
            StartFrom::Earliest => "earliest",
            StartFrom::Latest => "latest",
        };
        let mut config = base_config(&spec, &client_id)?;
        config
            .set("group.id", &group)
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", start_from)
            .set("session.timeout.ms", session_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (session_ms / 3).min(3000).to_string(),
            )
            .set("enable.partition.eof", "false")
            // librdkafka prefetches up to 100,000 records or 64 MiB per partition by default;
            // a fraction of a second of what one worker stores is plenty, and keeps the pod
            // within its memory limit.
            .set("queued.min.messages", PREFETCH_RECORDS.to_string())
            .set("queued.max.messages.kbytes", PREFETCH_KIB.to_string())
            // A partition whose prefetch is full is fetched again after this (default 1 s,
            // which starves a worker that drains its prefetch in a fraction of that).
            .set("fetch.queue.backoff.ms", "10");
        let consumer: StreamConsumer<KafkaContext> = config
            .create_with_context(KafkaContext {
                state: state.clone(),
                span: tracing::Span::current(),
            })
            .map_err(|err| classify(err, "could not create the Kafka consumer", Setting::Topics))?;
        let mut probe_config = base_config(&spec, &format!("{client_id}-probe"))?;
        probe_config
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        let probe: BaseConsumer<LogContext> = probe_config
            .create_with_context(LogContext::current())
            .map_err(|err| classify(err, "could not create the Kafka probe", Setting::Topics))?;
        Ok(Self {
            source: format!("kafka:{adapter}"),
            adapter,
            spec,
            consumer: Arc::new(consumer),
            state,
            producer: None,
            producer_id: format!("{client_id}-dlq"),
            dead_letter_topic,
            store,
            fetched: VecDeque::new(),
            in_hand: InHand::default(),
            topic_ids: HashMap::new(),
            probe: Arc::new(probe),
            lag,
        })
    }

    fn topics(&self) -> Result<Topics, TransportError> {
        match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(topics), _) => Ok(Topics::Named(topics.clone())),
            (None, Some(pattern)) => {
                regex::Regex::new(pattern)
                    .map(Topics::Pattern)
                    .map_err(|err| {
                        TransportError::fatal(
                            "spec.source.kafka.topicPattern",
                            format!("is not a regular expression: {err}"),
                            None,
                        )
                    })
            }
            (None, None) => Err(TransportError::fatal(
                "spec.source.kafka",
                "one of topics and topicPattern must be set",
                None,
            )),
        }
    }

    /// The dead-letter producer, created on the first dead letter.
    fn producer(&mut self) -> Result<&FutureProducer<LogContext>, TransportError> {
        if self.producer.is_none() {
            let mut config = base_config(&self.spec, &self.producer_id)?;
            config
                .set("acks", "all")
                .set("enable.idempotence", "true")
                .set(
                    "message.timeout.ms",
                    PRODUCE_TIMEOUT.as_millis().to_string(),
                );
            let producer = config
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

    /// Turns a fetched record into a message, under the epoch of its partition's assignment.
    /// `None`: the partition is no longer owned.
    fn convert(&self, record: &BorrowedMessage<'_>) -> Option<Message<Receipt>> {
        let partition = TopicPartition {
            topic: Arc::from(record.topic()),
            partition: record.partition(),
        };
        let epoch = self.state.offsets().epoch(&partition)?;
        let offset = record.offset();
        let key = record.key().map(<[u8]>::to_vec);
        // rdkafka panics on a header name that is not UTF-8: that record is undecodable.
        let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut headers = Vec::new();
            let mut null_headers = Vec::new();
            if let Some(list) = record.headers() {
                for (index, header) in list.iter().enumerate() {
                    if header.value.is_none() {
                        null_headers.push(index);
                    }
                    headers.push((
                        header.key.to_owned(),
                        header.value.unwrap_or_default().to_vec(),
                    ));
                }
            }
            (headers, null_headers)
        }));
        let (mut headers, null_headers, mut undecodable) = match read {
            Ok((headers, null_headers)) => (headers, null_headers, None),
            Err(_) => (
                Vec::new(),
                Vec::new(),
                Some("a header name of the record is not UTF-8".to_owned()),
            ),
        };
        let record_headers = headers.len();
        if let Some(key) = &key {
            headers.push((KEY_HEADER.to_owned(), key.clone()));
        }
        let has_value = record.payload().is_some();
        if !has_value && undecodable.is_none() {
            undecodable = Some("the record has no value (a tombstone)".to_owned());
        }
        Some(Message {
            // Set once the topic's incarnation is known (`identify`).
            idempotency_key: String::new(),
            // The group's committed offsets are the checkpoint. A position in the database
            // would be read by nothing, and its per-partition row, updated by every batch, would
            // make the batches being stored wait for each other's commits.
            position: None,
            external_id: String::new(),
            body: record.payload().unwrap_or_default().to_vec(),
            headers,
            delivery_count: 1,
            enqueued_at_ms: record
                .timestamp()
                .to_millis()
                .and_then(|ms| u64::try_from(ms).ok()),
            undecodable,
            receipt: Receipt {
                partition,
                topic_id: None,
                offset,
                epoch,
                key,
                has_value,
                record_headers,
                null_headers,
            },
        })
    }

    /// Fetches what librdkafka holds, up to `max` records in hand. With `block` (the pipeline
    /// has nothing in flight), waits a bounded time for the first record, then gathers more for
    /// up to [`GATHER`]: partitions start fetching at different moments, and records of a
    /// partition that come a moment later would otherwise wait behind a whole batch. An error is
    /// returned only when nothing is in hand.
    async fn fetch(&mut self, max: usize, block: bool) -> Result<(), TransportError> {
        let consumer = self.consumer.clone();
        let mut stream = consumer.stream();
        let mut gather_until = None;
        if self.fetched.is_empty() && block {
            gather_until = Some(tokio::time::Instant::now() + RECEIVE_WAIT);
        }
        while self.fetched.len() < max {
            let next = match gather_until {
                Some(until) => match tokio::time::timeout_at(until, stream.next()).await {
                    Ok(next) => next,
                    Err(_elapsed) => break,
                },
                None => stream.next().now_or_never().flatten(),
            };
            let Some(next) = next else { break };
            match next {
                Ok(record) => {
                    let Some(message) = self.convert(&record) else {
                        continue;
                    };
                    let receipt = &message.receipt;
                    if !self
                        .in_hand
                        .admit(&receipt.partition, receipt.epoch, receipt.offset)
                    {
                        continue;
                    }
                    if block && self.fetched.is_empty() {
                        gather_until = Some(tokio::time::Instant::now() + GATHER);
                    }
                    self.fetched.push_back(Fetched {
                        message,
                        identified: false,
                        below_mark: None,
                    });
                }
                Err(err) => {
                    if self.fetched.is_empty() {
                        return Err(classify(err, "could not fetch records", Setting::Topics));
                    }
                    tracing::debug!(error = %err, "fetch error after records in hand");
                    break;
                }
            }
        }
        Ok(())
    }

    /// Sets the keys of the first `max` records in hand whose incarnation is certain. The ids
    /// of their topics are read now, after every record in hand was taken from librdkafka; a
    /// record takes its topic's id only if that id was read before its partition's epoch began,
    /// so before the record was fetched: ids are never re-used, so the topic was that
    /// incarnation from then until now. Records of a topic the brokers do not describe now
    /// (deleted) stay in hand, without keys. A topic whose id changed was re-created (see
    /// [`Kafka::recreated`]); a partition whose records were fetched before its topic's id was
    /// first read is fetched again from its first record in hand, under a new epoch.
    async fn identify(&mut self, max: usize) -> Result<(), TransportError> {
        let wanted: BTreeSet<Arc<str>> = self
            .fetched
            .iter()
            .take(max)
            .filter(|fetched| !fetched.identified)
            .map(|fetched| fetched.message.receipt.partition.topic.clone())
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        for topic in &wanted {
            if !self.topic_ids.contains_key(topic) {
                // A topic read for the first time (a pattern picks up topics created later).
                self.refuse_own_dead_letters(topic)?;
            }
        }
        let existing = self.describe(wanted).await?;
        let mut unproven = BTreeSet::new();
        {
            let offsets = self.state.offsets();
            for fetched in self.fetched.iter_mut().take(max) {
                let receipt = &fetched.message.receipt;
                if fetched.identified || !existing.contains(&receipt.partition.topic) {
                    continue;
                }
                let (Some(known), Some(began)) = (
                    self.topic_ids.get(&receipt.partition.topic),
                    offsets.began(&receipt.partition, receipt.epoch),
                ) else {
                    // Revoked since it was fetched: dropped by the next receive.
                    continue;
                };
                if known.seen > began {
                    unproven.insert(receipt.partition.clone());
                    continue;
                }
                let message = &mut fetched.message;
                message.receipt.topic_id = known.id.clone();
                message.external_id = format!(
                    "{}:{}",
                    message.receipt.incarnation(),
                    message.receipt.offset
                );
                message.idempotency_key = format!("{}:{}", self.source, message.external_id);
                fetched.identified = true;
            }
        }
        if !unproven.is_empty() {
            let restarts: Vec<(TopicPartition, Offset)> = unproven
                .into_iter()
                .filter_map(|partition| {
                    let first = self
                        .fetched
                        .iter()
                        .map(|fetched| &fetched.message.receipt)
                        .filter(|receipt| receipt.partition == partition)
                        .map(|receipt| receipt.offset)
                        .min()?;
                    Some((partition, Offset::Offset(first)))
                })
                .collect();
            tracing::info!(
                partitions = ?restarts.iter().map(|(partition, _)| partition.name()).collect::<Vec<_>>(),
                "records fetched before their topic's id was first read are fetched again"
            );
            self.restart_epochs(&restarts);
        }
        Ok(())
    }

    /// Reads the ids of `topics` and records them; a topic whose id changed was re-created.
    /// Returns the topics the brokers described (they exist now); a topic they do not describe
    /// keeps the id last read.
    async fn describe(
        &mut self,
        topics: BTreeSet<Arc<str>>,
    ) -> Result<BTreeSet<Arc<str>>, TransportError> {
        let consumer = self.consumer.clone();
        let names: Vec<String> = topics.iter().map(|topic| topic.to_string()).collect();
        let described = crate::task::spawn_blocking(move || {
            describe_topics(consumer.client(), &names, REQUEST_TIMEOUT)
        })
        .await
        .map_err(|err| TransportError::protocol(format!("the describe task failed: {err}")))?
        .map_err(|err| classify(err, "could not describe the topics", Setting::Topics))?;
        let seen = Instant::now();
        let mut existing = BTreeSet::new();
        for (name, described) in described {
            let Described::Exists(id) = described else {
                continue;
            };
            let topic: Arc<str> = Arc::from(name);
            existing.insert(topic.clone());
            let id = id.map(Arc::<str>::from);
            let previous = match self.topic_ids.get(&topic) {
                Some(known) if known.id == id => continue,
                previous => previous.map(|known| known.id.clone()),
            };
            self.topic_ids.insert(
                topic.clone(),
                Incarnation {
                    id: id.clone(),
                    seen,
                },
            );
            if let Some(previous) = previous {
                self.recreated(&topic, previous.as_deref(), id.as_deref());
            }
        }
        Ok(existing)
    }

    /// `topic` was deleted and created again (its id changed): its owned partitions are read
    /// again from their beginning under new epochs (every record of the new incarnation is new;
    /// the old one's acknowledgements are stale and commit nothing), and what is in hand of it
    /// is dropped.
    fn recreated(&mut self, topic: &Arc<str>, old: Option<&str>, new: Option<&str>) {
        let partitions = self.state.offsets().owned_of(topic);
        tracing::warn!(
            topic = %topic,
            old_topic_id = old.unwrap_or("none"),
            new_topic_id = new.unwrap_or("none"),
            partitions = partitions.len(),
            "the topic was deleted and created again: its records are new messages, read from its beginning"
        );
        self.fetched
            .retain(|fetched| fetched.message.receipt.partition.topic != *topic);
        let restarts: Vec<(TopicPartition, Offset)> = partitions
            .iter()
            .map(|partition| (partition.clone(), Offset::Beginning))
            .collect();
        self.restart_epochs(&restarts);
        // Committed offsets are kept by topic name: a commit of the old incarnation still in
        // flight could land on the new topic, and a worker that died then would leave the group
        // past the new topic's first records. The new incarnation's beginning is committed
        // after it (same coordinator, in order), synchronously.
        let beginnings = partitions
            .into_iter()
            .map(|partition| (partition, 0))
            .collect();
        if let Err(err) = self.commit(beginnings, CommitMode::Sync) {
            tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), topic = %topic, "could not commit the re-created topic's beginning");
        }
    }

    /// Fetches each owned partition again from its offset, under a new epoch: its records in
    /// hand are dropped, and those librdkafka fetched before are discarded by it.
    fn restart_epochs(&mut self, restarts: &[(TopicPartition, Offset)]) {
        if restarts.is_empty() {
            return;
        }
        self.fetched.retain(|fetched| {
            restarts
                .iter()
                .all(|(partition, _)| *partition != fetched.message.receipt.partition)
        });
        let mut list = TopicPartitionList::new();
        {
            let mut offsets = self.state.offsets();
            for (partition, offset) in restarts {
                offsets.restart_epoch(partition);
                let _ = list.add_partition_offset(&partition.topic, partition.partition, *offset);
            }
        }
        if let Err(err) = self
            .consumer
            .incremental_unassign(&list)
            .and_then(|()| self.consumer.incremental_assign(&list))
        {
            tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not restart the partitions' fetch");
        }
    }

    /// The dead-letter topic of records of `topic`.
    fn dead_letter_topic(&self, topic: &str) -> String {
        self.dead_letter_topic
            .clone()
            .unwrap_or_else(|| format!("{topic}.dlq"))
    }

    /// Fails (fatal, naming both settings) when the subscription reads `topic` and it is a
    /// dead-letter topic of the adapter: the worker would read its own dead letters, and
    /// dead-letter them again.
    fn refuse_own_dead_letters(&self, topic: &str) -> Result<(), TransportError> {
        let dead_letters = match &self.dead_letter_topic {
            Some(dead_letter) => dead_letter == topic,
            None => topic
                .strip_suffix(".dlq")
                .is_some_and(|origin| self.reads(origin)),
        };
        if !dead_letters || !self.reads(topic) {
            return Ok(());
        }
        let (setting, value) = match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(topics), _) => ("spec.source.kafka.topics", topics.join(",")),
            (None, pattern) => (
                "spec.source.kafka.topicPattern",
                pattern.clone().unwrap_or_default(),
            ),
        };
        Err(TransportError::fatal(
            setting,
            format!(
                "{setting} ({value}) includes the dead-letter topic {topic:?} \
                 (spec.delivery.deadLetter.topic, default <topic>.dlq): the worker would read its \
                 own dead letters; set spec.delivery.deadLetter.topic to a topic the \
                 subscription does not include, or narrow the subscription"
            ),
            None,
        ))
    }

    /// Whether the subscription reads `topic`.
    fn reads(&self, topic: &str) -> bool {
        self.topics().is_ok_and(|topics| topics.matches(topic))
    }

    /// Raises the marks of the partitions of the first `count` records in hand and decides which
    /// of them may be redeliveries.
    async fn raise_marks(&mut self, count: usize) -> Result<(), TransportError> {
        let mut marks: BTreeMap<String, i64> = BTreeMap::new();
        for fetched in self.fetched.iter().take(count) {
            let receipt = &fetched.message.receipt;
            let mark = marks.entry(receipt.incarnation()).or_insert(0);
            *mark = (*mark).max(receipt.offset + 1);
        }
        let pairs: Vec<(&str, i64)> = marks
            .iter()
            .map(|(name, mark)| (name.as_str(), *mark))
            .collect();
        let previous = self
            .store
            .raise_delivery_marks(&self.source, &pairs)
            .await
            .map_err(|err| TransportError::database("could not raise the delivery marks", err))?;
        let previous: BTreeMap<&str, Option<i64>> = pairs
            .iter()
            .zip(previous)
            .map(|((name, _), previous)| (*name, previous))
            .collect();
        for fetched in self.fetched.iter_mut().take(count) {
            if fetched.below_mark.is_none() {
                let receipt = &fetched.message.receipt;
                let name = receipt.incarnation();
                let mark = previous.get(name.as_str()).copied().flatten();
                fetched.below_mark = Some(mark.is_some_and(|mark| receipt.offset < mark));
            }
        }
        Ok(())
    }
}

impl Transport for Kafka {
    type Receipt = Receipt;
    type Probe = KafkaProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        let topics = self.topics()?;
        if let Some(dead_letter) = &self.dead_letter_topic {
            self.refuse_own_dead_letters(dead_letter)?;
        }
        // The topics read now: their ids are read before any partition is assigned, so their
        // first records need not be fetched again (see `identify`).
        let mut read_now = BTreeSet::new();
        match &topics {
            Topics::Named(names) => {
                for name in names {
                    self.refuse_own_dead_letters(name)?;
                    read_now.insert(Arc::from(name.as_str()));
                }
            }
            Topics::Pattern(_) => {
                // The default dead-letter topic of each topic the pattern matches now (created
                // or not); a topic created later is checked when its first record comes.
                let consumer = self.consumer.clone();
                let metadata = crate::task::spawn_blocking(move || {
                    consumer.fetch_metadata(None, REQUEST_TIMEOUT)
                })
                .await
                .map_err(|err| {
                    TransportError::protocol(format!("the metadata task failed: {err}"))
                })?
                .map_err(|err| {
                    classify(err, "could not read the topics' metadata", Setting::Topics)
                })?;
                for topic in metadata.topics() {
                    if self.reads(topic.name()) {
                        self.refuse_own_dead_letters(topic.name())?;
                        self.refuse_own_dead_letters(&self.dead_letter_topic(topic.name()))?;
                        read_now.insert(Arc::from(topic.name()));
                    }
                }
            }
        }
        if let Topics::Named(names) = &topics {
            for name in names {
                let consumer = self.consumer.clone();
                let topic = name.clone();
                let metadata = crate::task::spawn_blocking(move || {
                    consumer.fetch_metadata(Some(&topic), REQUEST_TIMEOUT)
                })
                .await
                .map_err(|err| {
                    TransportError::protocol(format!("the metadata task failed: {err}"))
                })?
                .map_err(|err| {
                    classify(err, "could not read the topic's metadata", Setting::Topics)
                })?;
                let missing = metadata
                    .topics()
                    .iter()
                    .find(|topic| topic.name() == name)
                    .is_none_or(|topic| topic.error().is_some() || topic.partitions().is_empty());
                if missing {
                    return Err(TransportError::fatal(
                        "spec.source.kafka.topics",
                        format!("the topic {name:?} does not exist"),
                        None,
                    ));
                }
            }
        }
        if !read_now.is_empty() {
            self.describe(read_now).await?;
        }
        let subscription: Vec<&str> = match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(names), _) => names.iter().map(String::as_str).collect(),
            (None, Some(pattern)) => vec![pattern.as_str()],
            (None, None) => Vec::new(),
        };
        self.consumer
            .subscribe(&subscription)
            .map_err(|err| classify(err, "could not subscribe", Setting::Topics))
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<Message<Receipt>>, TransportError> {
        self.fetch(max, block).await?;
        // Records of partitions revoked since they were fetched are not handed on.
        {
            let offsets = self.state.offsets();
            self.fetched.retain(|fetched| {
                let receipt = &fetched.message.receipt;
                offsets.epoch(&receipt.partition) == Some(receipt.epoch)
            });
        }
        self.identify(max).await?;
        // Records whose keys are not set (their topic is not described now) stay in hand, in
        // order, behind those handed on.
        let window = self.fetched.len().min(max);
        let (ready, held): (Vec<Fetched>, Vec<Fetched>) = self
            .fetched
            .drain(..window)
            .partition(|fetched| fetched.identified);
        let count = ready.len();
        let held_topics: BTreeSet<Arc<str>> = held
            .iter()
            .map(|fetched| fetched.message.receipt.partition.topic.clone())
            .collect();
        for fetched in held.into_iter().rev().chain(ready.into_iter().rev()) {
            self.fetched.push_front(fetched);
        }
        if count == 0 {
            if !held_topics.is_empty() {
                return Err(TransportError::protocol(format!(
                    "the brokers do not describe topic(s) {held_topics:?} (deleted?): their \
                     records in hand are held until their incarnation is known"
                )));
            }
            return Ok(Vec::new());
        }
        if self
            .fetched
            .iter()
            .take(count)
            .any(|f| f.below_mark.is_none())
        {
            self.raise_marks(count).await?;
        }
        let redelivered: Vec<usize> = (0..count)
            .filter(|&index| self.fetched[index].below_mark == Some(true))
            .collect();
        if !redelivered.is_empty() {
            let keys: Vec<&str> = redelivered
                .iter()
                .map(|&index| self.fetched[index].message.idempotency_key.as_str())
                .collect();
            let counts = self
                .store
                .count_redeliveries(&self.source, &keys)
                .await
                .map_err(|err| TransportError::database("could not count the redeliveries", err))?;
            for (index, count) in redelivered.into_iter().zip(counts) {
                self.fetched[index].message.delivery_count = count;
            }
        }
        let mut offsets = self.state.offsets();
        Ok(self
            .fetched
            .drain(..count)
            .map(|fetched| fetched.message)
            .filter(|message| {
                let receipt = &message.receipt;
                offsets.deliver(&receipt.partition, receipt.epoch, receipt.offset)
            })
            .collect())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        let topics: Vec<String> = letters
            .iter()
            .map(|letter| self.dead_letter_topic(&letter.message.receipt.partition.topic))
            .collect();
        let contexts: Vec<[(&str, String); 8]> = letters.iter().map(dead_letter_context).collect();
        let producer = self.producer()?;
        let sends = letters
            .iter()
            .zip(&topics)
            .zip(&contexts)
            .map(|((letter, topic), context)| {
                let message = letter.message;
                let receipt = &message.receipt;
                let mut headers =
                    OwnedHeaders::new_with_capacity(receipt.record_headers + context.len());
                for (index, (name, value)) in
                    message.headers[..receipt.record_headers].iter().enumerate()
                {
                    let value =
                        (!receipt.null_headers.contains(&index)).then_some(value.as_slice());
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
                producer.send(record, PRODUCE_TIMEOUT)
            });
        let mut refused = Vec::new();
        let mut refusal = None;
        for (index, result) in join_all(sends).await.into_iter().enumerate() {
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

    async fn ack(&mut self, messages: &[&Message<Receipt>]) -> Result<Acked, TransportError> {
        let mut acked = Acked::all();
        let commits = {
            let mut offsets = self.state.offsets();
            for (index, message) in messages.iter().enumerate() {
                let receipt = &message.receipt;
                if !offsets.settle(&receipt.partition, receipt.epoch, receipt.offset) {
                    acked.stale.push(index);
                }
            }
            offsets.committable()
        };
        self.commit(commits, CommitMode::Async)?;
        Ok(acked)
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        let known: BTreeSet<Arc<str>> = self.topic_ids.keys().cloned().collect();
        if !known.is_empty()
            && let Err(err) = self.describe(known).await
        {
            tracing::debug!(error = %switchboard_telemetry::ErrorChain(&err), "could not describe the topics read; tried again later");
        }
        self.advance_to_positions();
        let commits = self.state.offsets().committable();
        self.commit(commits, CommitMode::Async)?;
        self.restart_stalled_fetches().await;
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        Duration::from_secs(5)
    }

    fn probe(&self) -> KafkaProbe {
        KafkaProbe {
            consumer: self.probe.clone(),
            topics: self.topics().unwrap_or(Topics::Named(Vec::new())),
            start_from: self.spec.start_from,
            adapter: self.adapter.clone(),
            lag: self.lag.clone(),
        }
    }

    async fn shutdown(&mut self) {
        let commits = self.state.offsets().committable();
        if let Err(err) = self.commit(commits, CommitMode::Sync) {
            tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not commit the settled offsets at shutdown; their records are redelivered and deduplicated");
        }
        let unsettled = self.state.offsets().unsettled();
        if unsettled > 0 {
            tracing::info!(
                unsettled,
                "records left un-committed at shutdown are redelivered"
            );
        }
    }
}

impl Kafka {
    /// Moves each owned partition with nothing in flight and nothing in hand to the consumer's
    /// position (past transaction markers and aborted records, which are never delivered), so
    /// that it is committed and the group's lag counts only records still to be read.
    fn advance_to_positions(&mut self) {
        let positions = match self.consumer.position() {
            Ok(positions) => positions,
            Err(err) => {
                tracing::debug!(error = %err, "could not read the consumer's positions");
                return;
            }
        };
        let in_hand: BTreeSet<&TopicPartition> = self
            .fetched
            .iter()
            .map(|fetched| &fetched.message.receipt.partition)
            .collect();
        let mut offsets = self.state.offsets();
        for element in positions.elements() {
            let Offset::Offset(position) = element.offset() else {
                continue;
            };
            let partition = TopicPartition {
                topic: Arc::from(element.topic()),
                partition: element.partition(),
            };
            if !in_hand.contains(&partition) {
                offsets.advance_to(&partition, position);
            }
        }
    }

    /// Restarts the fetch of owned partitions that hold a backlog (the probe's lag) but delivered
    /// nothing for [`STALLED_AFTER`] with nothing in flight: from the offset after their settled
    /// prefix, else from the group's committed offset (read by the probe's client). A partition
    /// with no committed offset is left to `auto.offset.reset`; a restart that fails is tried
    /// again at the next maintenance.
    async fn restart_stalled_fetches(&mut self) {
        let idle = self.state.offsets().idle(STALLED_AFTER);
        let stalled: Vec<(TopicPartition, Option<i64>)> = idle
            .into_iter()
            .filter(|(partition, _)| {
                let labels = probe::PartitionLabels {
                    adapter: self.adapter.clone(),
                    topic: partition.topic.to_string(),
                    partition: partition.partition.to_string(),
                };
                self.lag.get_or_create(&labels).get() > 0
            })
            .collect();
        if stalled.is_empty() {
            return;
        }
        let mut unknown = TopicPartitionList::new();
        for (partition, _) in stalled.iter().filter(|(_, from)| from.is_none()) {
            unknown.add_partition(&partition.topic, partition.partition);
        }
        let probe = self.probe.clone();
        let committed = match crate::task::spawn_blocking(move || match unknown.count() {
            0 => Ok(unknown),
            _ => probe.committed_offsets(unknown, REQUEST_TIMEOUT),
        })
        .await
        {
            Ok(Ok(committed)) => committed,
            Ok(Err(err)) => {
                tracing::debug!(error = %switchboard_telemetry::ErrorChain(&err), "could not read the committed offsets of stalled partitions");
                return;
            }
            Err(err) => {
                tracing::debug!(error = %err, "the committed-offsets task failed");
                return;
            }
        };
        let mut restart = TopicPartitionList::new();
        for (partition, from) in &stalled {
            let offset = match from {
                Some(from) => Offset::Offset(*from),
                None => committed
                    .find_partition(&partition.topic, partition.partition)
                    .map_or(Offset::Invalid, |element| element.offset()),
            };
            if let Offset::Offset(offset) = offset {
                tracing::warn!(
                    partition = %partition.name(),
                    offset,
                    idle_seconds = STALLED_AFTER.as_secs(),
                    "a partition with a backlog delivered nothing: restarting its fetch"
                );
                let _ = restart.add_partition_offset(
                    &partition.topic,
                    partition.partition,
                    Offset::Offset(offset),
                );
            }
        }
        if restart.count() == 0 {
            return;
        }
        let restarted = self
            .consumer
            .incremental_unassign(&restart)
            .and_then(|()| self.consumer.incremental_assign(&restart));
        match restarted {
            Ok(()) => {
                let mut offsets = self.state.offsets();
                for (partition, _) in &stalled {
                    offsets.restarted(partition);
                }
                self.state.fetch_restarts.inc_by(restart.count() as u64);
            }
            Err(err) => {
                tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not restart the fetch of stalled partitions; tried again later")
            }
        }
    }

    /// Commits `commits` (each partition's settled prefix). A commit that cannot be sent marks
    /// its partitions for the next one.
    fn commit(
        &self,
        commits: Vec<(TopicPartition, i64)>,
        mode: CommitMode,
    ) -> Result<(), TransportError> {
        if commits.is_empty() {
            return Ok(());
        }
        let mut list = TopicPartitionList::new();
        for (partition, up_to) in &commits {
            let _ = list.add_partition_offset(
                &partition.topic,
                partition.partition,
                Offset::Offset(*up_to),
            );
        }
        self.consumer.commit(&list, mode).map_err(|err| {
            self.state.commit_failures.inc();
            let mut offsets = self.state.offsets();
            for (partition, _) in &commits {
                offsets.recommit(partition);
            }
            classify(err, "could not commit offsets", Setting::Topics)
        })
    }
}

/// Whether the brokers (or librdkafka, before sending) refused a record for what it is, so
/// that producing it again can never succeed: too large for `message.max.bytes` (the
/// producer's or the topic's), an invalid or corrupt record, a record the topic's policy or
/// message format refuses. Everything else (brokers down, timeouts, leadership moving, a
/// different record of the same batch refused) may succeed later; a topic that does not exist
/// or is denied is a setting to fix.
fn refused_for_good(err: &KafkaError) -> bool {
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

/// The `x-dlq-*` headers of a dead letter.
fn dead_letter_context(letter: &DeadLetter<'_, Receipt>) -> [(&'static str, String); 8] {
    let receipt = &letter.message.receipt;
    let mut error = letter.error.clone();
    if error.len() > MAX_ERROR_BYTES {
        let mut end = MAX_ERROR_BYTES;
        while !error.is_char_boundary(end) {
            end -= 1;
        }
        error.truncate(end);
    }
    [
        ("x-dlq-reason", letter.reason.as_str().to_owned()),
        ("x-dlq-error", error),
        ("x-dlq-original-topic", receipt.partition.topic.to_string()),
        (
            "x-dlq-original-topic-id",
            receipt.topic_id.as_deref().unwrap_or_default().to_owned(),
        ),
        (
            "x-dlq-original-partition",
            receipt.partition.partition.to_string(),
        ),
        ("x-dlq-original-offset", receipt.offset.to_string()),
        (
            "x-dlq-delivery-count",
            letter.message.delivery_count.to_string(),
        ),
        ("x-dlq-attempts", letter.attempts.to_json()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_fetched_again_while_in_hand_is_not_taken_twice() {
        let partition = TopicPartition {
            topic: Arc::from("orders"),
            partition: 0,
        };
        let mut in_hand = InHand::default();
        for offset in 5..8 {
            assert!(in_hand.admit(&partition, 1, offset));
        }
        // The fetch restarted from 5 while 5..8 were still in hand.
        for offset in 5..8 {
            assert!(!in_hand.admit(&partition, 1, offset), "{offset} twice");
        }
        assert!(in_hand.admit(&partition, 1, 8));
        // A new assignment (or a re-created topic) reads from wherever it starts.
        assert!(in_hand.admit(&partition, 2, 0));
    }
}
