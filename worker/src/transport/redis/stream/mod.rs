//! Redis Streams with a consumer group: XREADGROUP → (store) → XACK.
//!
//! - The group is created with MKSTREAM at `startFrom`, or at the stored checkpoint when one
//!   exists (a lost group is recreated there: neither `$`, which would skip entries, nor `0`,
//!   which would replay the whole stream).
//! - At start the consumer first replays its own pending entries (`XREADGROUP … 0`).
//! - `maintain` takes over entries idle longer than `claimIdleSeconds` (XAUTOCLAIM), removes
//!   consumers that are idle and hold nothing, and reads lag and pending figures.
//! - Blocking reads use their own connection so acknowledgements never queue behind them.
//!
//! Replies are taken apart in `reply`, housekeeping lives in `maintenance` and the queue health
//! figures in `probe`.

mod maintenance;
mod probe;
mod reply;

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use redis::Value;
use switchboard_api::StartFrom;
use switchboard_store::{Dedup, Store};

pub use probe::StreamProbe;
pub(super) use reply::{RawEntry, parse_entries, parse_id};
use reply::{decode_fields, parse_read_reply, raw_fields_json};

use super::{
    BLOCK, CONTROL_TIMEOUT, Connection, NamedKey, array, error_code, integer, now_rfc3339, open,
    refused_by_dead_letter_key, text,
};
use crate::metrics::{adapter_aliased, broker_reconnects};
use crate::payload::fields_json;
use crate::transport::dead_letter::DeadLetterContext;
use crate::transport::identity::idempotency_key;
use crate::transport::{Acked, DeadLetter, Message, Position, Transport, TransportError};

/// A stream entry id (`ms-seq`): what XACK takes.
pub type EntryId = String;
type Entry = Message<EntryId>;

/// The stream transport's own counters.
#[derive(Debug, Clone)]
struct StreamMetrics {
    reclaimed: Counter,
    group_recreated: Counter,
    consumers_removed: Counter,
    oldest_waiting_age_seconds: Gauge<f64, AtomicU64>,
}

impl StreamMetrics {
    fn register(registry: &mut Registry, adapter: &str) -> Self {
        Self {
            reclaimed: adapter_aliased(
                registry,
                "redis_messages_reclaimed",
                "messages_reclaimed",
                "Messages taken over from consumers that stopped acknowledging them",
                adapter,
            ),
            group_recreated: adapter_aliased(
                registry,
                "redis_consumer_group_recreated",
                "consumer_group_recreated",
                "Times the consumer group was missing (NOGROUP) and recreated at the stored checkpoint",
                adapter,
            ),
            consumers_removed: adapter_aliased(
                registry,
                "redis_consumers_removed",
                "consumers_removed",
                "Idle consumers with no pending entries removed from the group",
                adapter,
            ),
            oldest_waiting_age_seconds: adapter_aliased(
                registry,
                "redis_oldest_waiting_age_seconds",
                "oldest_waiting_age_seconds",
                "Age of the oldest entry not yet delivered to the consumer group (0 when none waits)",
                adapter,
            ),
        }
    }
}

/// Everything the stream transport needs to know.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    pub stream: String,
    pub group: String,
    pub consumer: String,
    pub body_field: String,
    pub start_from: StartFrom,
    pub claim_idle: Duration,
    pub dead_letter_stream: String,
    pub batch_size: usize,
    /// Dead letters older than this are trimmed (`deadLetter.retentionDays`).
    pub dead_letter_retention: Duration,
}

impl StreamSettings {
    /// The keys the transport uses, with the settings that name them.
    fn keys(&self) -> Vec<NamedKey> {
        vec![
            NamedKey::new(&self.stream, "spec.source.redis.stream", "stream"),
            NamedKey::new(
                &self.dead_letter_stream,
                "spec.delivery.deadLetter.stream",
                "stream",
            ),
        ]
    }
}

/// The Redis stream transport.
#[derive(Debug)]
pub struct RedisStream {
    settings: StreamSettings,
    source: String,
    /// Blocking reads only, so acknowledgements never queue behind them.
    reader: Connection,
    control: Connection,
    client: redis::Client,
    store: Store,
    metrics: StreamMetrics,
    /// While `Some`, the consumer is replaying its own pending entries after this id.
    replay_after: Option<String>,
    reclaimed: VecDeque<Entry>,
}

fn is_nogroup(err: &TransportError) -> bool {
    error_code(err) == Some("NOGROUP")
}

/// The checkpoint partition of a stream: a stream has a single sequence.
const PARTITION: &str = "";

/// `ms-seq` → its checkpoint position.
fn position(id: &str) -> Option<Position> {
    let (ms, seq) = parse_id(id)?;
    Some(Position {
        partition: PARTITION.to_owned(),
        value: vec![i64::try_from(ms).ok()?, i64::try_from(seq).ok()?],
    })
}

impl RedisStream {
    pub fn new(
        settings: StreamSettings,
        redis_url: &str,
        store: Store,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let client = open(redis_url)?;
        let keys = settings.keys();
        let reconnects = broker_reconnects(registry, &settings.adapter, None);
        Ok(Self {
            source: format!("redis:{}", settings.adapter),
            metrics: StreamMetrics::register(registry, &settings.adapter),
            settings,
            reader: Connection::new(client.clone(), BLOCK + CONTROL_TIMEOUT)
                .naming(keys.clone())
                .counting_reconnects(reconnects),
            control: Connection::new(client.clone(), CONTROL_TIMEOUT).naming(keys),
            client,
            store,
            replay_after: Some("0".to_owned()),
            reclaimed: VecDeque::new(),
        })
    }

    async fn control(
        &mut self,
        command: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<Value, TransportError> {
        self.control.query(command, cmd).await
    }

    fn group_cmd(&self, name: &str) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(&self.settings.stream).arg(&self.settings.group);
        cmd
    }

    /// Creates the consumer group unless it exists: at the stored checkpoint if there is one,
    /// else at `startFrom`. Returns whether it was created.
    async fn ensure_group(&mut self) -> Result<bool, TransportError> {
        let checkpoint = self
            .store
            .position(&self.source, PARTITION)
            .await
            .map_err(TransportError::checkpoint)?;
        let start = match (&checkpoint, self.settings.start_from) {
            (Some(position), _) => position
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join("-"),
            (None, StartFrom::Earliest) => "0".to_owned(),
            (None, StartFrom::Latest) => "$".to_owned(),
        };
        let mut cmd = redis::cmd("XGROUP");
        cmd.arg("CREATE")
            .arg(&self.settings.stream)
            .arg(&self.settings.group)
            .arg(&start)
            .arg("MKSTREAM");
        match self.control("XGROUP CREATE", &cmd).await {
            Ok(_) => {
                if checkpoint.is_some() {
                    self.metrics.group_recreated.inc();
                    tracing::warn!(
                        stream = %self.settings.stream,
                        group = %self.settings.group,
                        start = %start,
                        "consumer group was missing (Redis restarted without persistence, or the group was deleted); recreated at the last stored entry"
                    );
                } else {
                    tracing::info!(stream = %self.settings.stream, group = %self.settings.group, start = %start, "created consumer group");
                }
                Ok(true)
            }
            Err(err) if error_code(&err) == Some("BUSYGROUP") => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// NOGROUP: the group vanished under us. Recreate it; own pending entries went with it.
    async fn recover_group(&mut self) -> Result<(), TransportError> {
        self.replay_after = None;
        self.ensure_group().await.map(drop)
    }

    fn to_message(&self, raw: RawEntry) -> Option<Entry> {
        let raw_fields = raw.fields?;
        let enqueued_at_ms = parse_id(&raw.id).map(|(ms, _)| ms);
        let position = position(&raw.id);
        let (body, headers, undecodable) = match decode_fields(raw_fields) {
            Ok(fields) => {
                let (body, headers) = match fields
                    .iter()
                    .position(|(name, _)| *name == self.settings.body_field)
                {
                    Some(index) => {
                        let mut headers = fields;
                        let (_, body) = headers.remove(index);
                        (body, headers)
                    }
                    None => (fields_json(&fields).into_bytes(), Vec::new()),
                };
                (body, headers, None)
            }
            Err((raw_fields, reason)) => (raw_fields_json(&raw_fields), Vec::new(), Some(reason)),
        };
        Some(Message {
            receipt: raw.id.clone(),
            idempotency_key: idempotency_key(&self.source, &raw.id),
            external_id: raw.id,
            body,
            headers,
            delivery_count: 1,
            enqueued_at_ms,
            position,
            undecodable,
        })
    }

    /// Delivery counts of this consumer's pending entries between `first` and `last`.
    async fn delivery_counts(
        &mut self,
        first: &str,
        last: &str,
        count: usize,
    ) -> Result<HashMap<String, u64>, TransportError> {
        let mut cmd = self.group_cmd("XPENDING");
        cmd.arg(first)
            .arg(last)
            .arg(count)
            .arg(&self.settings.consumer);
        let reply = self.control("XPENDING", &cmd).await?;
        Ok(array(&reply)
            .unwrap_or_default()
            .iter()
            .filter_map(|row| {
                let row = array(row)?;
                Some((text(row.first()?)?, integer(row.get(3)?)?))
            })
            .collect())
    }

    /// Turns raw entries into messages with their delivery counts; acknowledges entries that
    /// were deleted from the stream while pending (there is nothing left to store).
    async fn with_counts(&mut self, entries: Vec<RawEntry>) -> Result<Vec<Entry>, TransportError> {
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Ok(Vec::new());
        };
        let (first, last, len) = (first.id.clone(), last.id.clone(), entries.len());
        let deleted: Vec<String> = entries
            .iter()
            .filter(|e| e.fields.is_none())
            .map(|e| e.id.clone())
            .collect();
        if !deleted.is_empty() {
            tracing::warn!(
                count = deleted.len(),
                "pending entries were deleted from the stream before they were stored; acknowledging them"
            );
            let mut cmd = self.group_cmd("XACK");
            cmd.arg(&deleted);
            self.control("XACK", &cmd).await?;
        }
        let counts = self.delivery_counts(&first, &last, len).await?;
        Ok(entries
            .into_iter()
            .filter_map(|raw| self.to_message(raw))
            .map(|mut message| {
                message.delivery_count = counts.get(&message.external_id).copied().unwrap_or(1);
                message
            })
            .collect())
    }

    async fn replay_own_pending(
        &mut self,
        after: String,
        max: usize,
    ) -> Result<Vec<Entry>, TransportError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.settings.group)
            .arg(&self.settings.consumer)
            .arg("COUNT")
            .arg(max)
            .arg("STREAMS")
            .arg(&self.settings.stream)
            .arg(&after);
        let entries = parse_read_reply(self.control("XREADGROUP", &cmd).await?)?;
        match entries.last() {
            None => {
                tracing::info!(consumer = %self.settings.consumer, "own pending entries replayed; reading new entries");
                self.replay_after = None;
            }
            Some(last) => self.replay_after = Some(last.id.clone()),
        }
        self.with_counts(entries).await
    }

    async fn read_new(&mut self, max: usize, block: bool) -> Result<Vec<Entry>, TransportError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.settings.group)
            .arg(&self.settings.consumer)
            .arg("COUNT")
            .arg(max);
        if block {
            cmd.arg("BLOCK")
                .arg(u64::try_from(BLOCK.as_millis()).unwrap_or(1000));
        }
        cmd.arg("STREAMS").arg(&self.settings.stream).arg(">");
        let reply = self.reader.query("XREADGROUP", &cmd).await?;
        Ok(parse_read_reply(reply)?
            .into_iter()
            .filter_map(|raw| self.to_message(raw))
            .collect())
    }
}

impl Transport for RedisStream {
    type Receipt = EntryId;
    type Probe = StreamProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        self.control.endpoint()
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    fn stable_enqueue_time(&self) -> bool {
        true
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        self.ensure_group().await.map(drop)
    }

    async fn receive(&mut self, max: usize, block: bool) -> Result<Vec<Entry>, TransportError> {
        if !self.reclaimed.is_empty() {
            let take = max.min(self.reclaimed.len());
            return Ok(self.reclaimed.drain(..take).collect());
        }
        let result = match self.replay_after.take() {
            Some(after) => {
                let result = self.replay_own_pending(after.clone(), max).await;
                if result.is_err() && self.replay_after.is_none() {
                    self.replay_after = Some(after);
                }
                result
            }
            None => self.read_new(max, block).await,
        };
        match result {
            Err(err) if is_nogroup(&err) => self.recover_group().await.map(|()| Vec::new()),
            other => other,
        }
    }

    async fn ack(&mut self, messages: &[&Entry]) -> Result<Acked, TransportError> {
        if messages.is_empty() {
            return Ok(Acked::all());
        }
        let mut cmd = self.group_cmd("XACK");
        for message in messages {
            cmd.arg(&message.receipt);
        }
        self.control("XACK", &cmd).await?;
        Ok(Acked::all())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, EntryId>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let settings = &self.settings;
        let last_seen = now_rfc3339();
        let mut pipe = redis::pipe();
        for letter in letters {
            let message = letter.message;
            let context = DeadLetterContext::new(letter);
            pipe.cmd("XADD")
                .arg(&settings.dead_letter_stream)
                .arg("*")
                .arg("body")
                .arg(&message.body)
                .arg("headers")
                .arg(fields_json(&message.headers))
                .arg("reason")
                .arg(context.reason)
                // The whole error, as ever: the context's is cut to 2 KiB.
                .arg("last_error")
                .arg(&letter.error)
                .arg("delivery_count")
                .arg(context.delivery_count)
                .arg("origin_stream")
                .arg(&settings.stream)
                .arg("origin_id")
                .arg(&message.external_id)
                .arg("group")
                .arg(&settings.group)
                .arg("consumer")
                .arg(&settings.consumer)
                .arg("adapter")
                .arg(&settings.adapter)
                .arg("first_seen")
                .arg(context.first_seen.unwrap_or_default())
                .arg("last_seen")
                .arg(&last_seen)
                .arg("attempts")
                .arg(context.attempts)
                .ignore();
        }
        self.control
            .pipeline::<()>("XADD", &pipe)
            .await
            .map_err(|err| refused_by_dead_letter_key(err, letters.len()))
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        let result = async {
            self.reclaim_idle_entries().await?;
            self.remove_idle_consumers().await?;
            // Housekeeping: a failure is tried again next time (a dead-letter key of the wrong
            // type stops the worker when a dead letter is written, not before).
            if let Err(err) = self.trim_expired_dead_letters().await {
                tracing::debug!(error = %err, "cannot trim the dead-letter stream");
            }
            Ok(())
        }
        .await;
        match result {
            Err(err) if is_nogroup(&err) => self.recover_group().await,
            other => other,
        }
    }

    fn maintenance_interval(&self) -> Duration {
        (self.settings.claim_idle / 2).clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    fn probe(&self) -> StreamProbe {
        StreamProbe {
            conn: Connection::new(self.client.clone(), CONTROL_TIMEOUT)
                .naming(self.settings.keys()),
            stream: self.settings.stream.clone(),
            group: self.settings.group.clone(),
            dead_letter_stream: self.settings.dead_letter_stream.clone(),
            oldest_waiting_age_seconds: self.metrics.oldest_waiting_age_seconds.clone(),
        }
    }
}
