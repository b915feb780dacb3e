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
//!   offset of a partition once. Up to four batches (at most 4 MiB of bodies) are taken into
//!   hand ahead, so one topic-id read proves several batches. The key is `kafka:{adapter}:{topic}:{topic-id}:{partition}:{offset}`
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
//!   (asynchronously: a commit that failed, or that the broker refused, is sent again with the
//!   next one, or by `maintain`; see [`async_commit`]).
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
//! - **`dlq`**: see [`reader`].

mod async_commit;
pub(crate) mod client;
mod commit;
mod dead_letter;
mod incarnation;
mod offsets;
mod probe;
pub mod reader;
mod receive;
mod retention;
mod subscribe;
mod topic_id;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rdkafka::consumer::{BaseConsumer, CommitMode, StreamConsumer};
use rdkafka::producer::FutureProducer;
use switchboard_api::KafkaSource;
use switchboard_store::{Dedup, Store};

use self::client::{
    ConsumerState, KafkaContext, LogContext, Setting, classify, consumer_config, probe_config,
};
use self::incarnation::Incarnation;
use self::offsets::TopicPartition;
use self::probe::{KafkaProbe, Topics};
use self::receive::{Fetched, InHand};
use crate::transport::retention::Retention;
use crate::transport::{Acked, DeadLetter, Message, SourceRetention, Transport, TransportError};

/// How long a metadata request or a synchronous commit may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// `retentionDays` and `acceptShorterRetention`: held on each dead-letter topic.
    pub dead_letter_retention: Retention,
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

/// A partition and the id of its topic's incarnation.
type IncarnationOf<'a> = (&'a TopicPartition, Option<&'a Arc<str>>);

impl Receipt {
    /// `{topic}:{topic-id}:{partition}` (`{topic}:{partition}` without a topic id): the
    /// partition of one incarnation of its topic, as keys and delivery marks name it.
    fn incarnation(&self) -> String {
        let TopicPartition { topic, partition } = &self.partition;
        // Sized once, room left for the offset of `external_id`: built for every record.
        let mut name = String::with_capacity(topic.len() + 80);
        name.push_str(topic);
        name.push(':');
        if let Some(id) = &self.topic_id {
            name.push_str(id);
            name.push(':');
        }
        name.push_str(itoa::Buffer::new().format(*partition));
        name
    }

    /// Which partition incarnation the record is of, borrowed: [`Receipt::incarnation`]
    /// unwritten.
    fn incarnation_of(&self) -> IncarnationOf<'_> {
        (&self.partition, self.topic_id.as_ref())
    }

    /// The record's external id: `{incarnation}:{offset}`.
    fn external_id(&self) -> String {
        let mut id = self.incarnation();
        id.push(':');
        id.push_str(itoa::Buffer::new().format(self.offset));
        id
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
    retention: retention::DeadLetterRetention,
    /// The longest `retention.ms` of the named topics, read at start.
    source_retention: SourceRetention,
    store: Store,
    fetched: VecDeque<Fetched>,
    in_hand: InHand,
    /// The id of each topic read (its incarnation), as last described.
    topic_ids: HashMap<Arc<str>, Incarnation>,
    probe: Arc<BaseConsumer<LogContext>>,
    lag: Family<probe::PartitionLabels, Gauge>,
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
            dead_letter_retention,
        } = settings;
        let group = spec.group_id(&adapter);
        let state = Arc::new(ConsumerState::register(registry, &adapter));
        let lag = probe::register_lag(registry);
        let consumer: StreamConsumer<KafkaContext> = consumer_config(&spec, &client_id, &group)?
            .create_with_context(KafkaContext {
                state: state.clone(),
                span: tracing::Span::current(),
            })
            .map_err(|err| classify(err, "could not create the Kafka consumer", Setting::Topics))?;
        let probe: BaseConsumer<LogContext> = probe_config(&spec, &client_id, &group)?
            .create_with_context(LogContext::current())
            .map_err(|err| classify(err, "could not create the Kafka probe", Setting::Topics))?;
        let retention =
            retention::DeadLetterRetention::new(dead_letter_retention, &spec, &client_id);
        Ok(Self {
            source: format!("kafka:{adapter}"),
            adapter,
            spec,
            consumer: Arc::new(consumer),
            state,
            producer: None,
            producer_id: format!("{client_id}-dlq"),
            dead_letter_topic,
            retention,
            source_retention: SourceRetention::Unknown,
            store,
            fetched: VecDeque::new(),
            in_hand: InHand::default(),
            topic_ids: HashMap::new(),
            probe: Arc::new(probe),
            lag,
        })
    }
}

impl Transport for Kafka {
    type Receipt = Receipt;
    type Probe = KafkaProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        crate::transport::endpoint::endpoints(&self.spec.bootstrap_servers)
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    fn stable_enqueue_time(&self) -> bool {
        true
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.subscribe().await?;
        // The dead-letter topics of a pattern's topics are held before their first letter.
        let named: Vec<String> = (self.spec.topics.iter().flatten())
            .map(|topic| self.dead_letter_topic(topic))
            .collect();
        self.retention.hold(named).await?;
        let sources = self.spec.topics.clone().unwrap_or_default();
        self.source_retention = self.retention.of_sources(&sources).await;
        Ok(())
    }

    /// The longest `retention.ms` of the named topics (a pattern's: unknown).
    fn source_retention(&self) -> SourceRetention {
        self.source_retention.clone()
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<Message<Receipt>>, TransportError> {
        self.receive_records(max, block).await
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        self.produce_dead_letters(letters).await
    }

    async fn ack(&mut self, messages: &[&Message<Receipt>]) -> Result<Acked, TransportError> {
        self.settle(messages)
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
            dead_letter_topics: match (&self.dead_letter_topic, &self.spec.topics) {
                (Some(topic), _) => vec![topic.clone()],
                (None, Some(named)) => named.iter().map(|t| self.dead_letter_topic(t)).collect(),
                (None, None) => Vec::new(),
            },
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
