//! Redis Streams with a consumer group: XREADGROUP → (store) → XACK.
//!
//! - The group is created with MKSTREAM at `startFrom`, or at the stored checkpoint when one
//!   exists (a lost group is recreated there: neither `$`, which would skip entries, nor `0`,
//!   which would replay the whole stream).
//! - At start the consumer first replays its own pending entries (`XREADGROUP … 0`).
//! - `maintain` takes over entries idle longer than `claimIdleSeconds` (XAUTOCLAIM), removes
//!   consumers that are idle and hold nothing, and reads lag and pending figures.
//! - Blocking reads use their own connection so acknowledgements never queue behind them.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use redis::Value;
use switchboard_api::StartFrom;
use switchboard_store::{Dedup, Store};

use super::{
    refused_by_dead_letter_key,
    BLOCK, CONTROL_TIMEOUT, Connection, NamedKey, array, error_code, integer, now_rfc3339, open,
    protocol, rfc3339_ms, text,
};
use crate::health::now_ms;
use crate::metrics::{adapter_counter, adapter_gauge};
use crate::payload::fields_json;
use crate::transport::{
    Acked, DeadLetter, Message, Position, QueueHealth, QueueProbe, Transport, TransportError,
};

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
            reclaimed: adapter_counter(
                registry,
                "messages_reclaimed",
                "Messages taken over from consumers that stopped acknowledging them",
                adapter,
            ),
            group_recreated: adapter_counter(
                registry,
                "consumer_group_recreated",
                "Times the consumer group was missing (NOGROUP) and recreated at the stored checkpoint",
                adapter,
            ),
            consumers_removed: adapter_counter(
                registry,
                "consumers_removed",
                "Idle consumers with no pending entries removed from the group",
                adapter,
            ),
            oldest_waiting_age_seconds: adapter_gauge(
                registry,
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

/// One stream entry as Redis returned it, field names and values as raw bytes (Redis allows any
/// bytes in both); `fields` is `None` for an entry deleted from the stream while it was pending.
#[derive(Debug)]
pub(super) struct RawEntry {
    pub(super) id: String,
    pub(super) fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
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

/// `ms-seq` → (ms, seq).
pub(super) fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// `ms-seq` → its checkpoint position.
fn position(id: &str) -> Option<Position> {
    let (ms, seq) = parse_id(id)?;
    Some(Position {
        partition: PARTITION.to_owned(),
        value: vec![i64::try_from(ms).ok()?, i64::try_from(seq).ok()?],
    })
}

fn into_array(value: Value) -> Option<Vec<Value>> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

fn into_bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.into_bytes()),
        _ => None,
    }
}

fn into_text(value: Value) -> Option<String> {
    into_bytes(value).and_then(|bytes| String::from_utf8(bytes).ok())
}

/// Stream entries, taken out of the reply without copying their bytes.
pub(super) fn parse_entries(
    command: &'static str,
    value: Value,
) -> Result<Vec<RawEntry>, TransportError> {
    let items = into_array(value).ok_or_else(|| protocol(command, "entries are not an array"))?;
    items
        .into_iter()
        .map(|entry| {
            let mut parts = into_array(entry)
                .ok_or_else(|| protocol(command, "entry is not an array"))?
                .into_iter();
            let id = parts
                .next()
                .and_then(into_text)
                .ok_or_else(|| protocol(command, "entry has no id"))?;
            let fields = match parts.next() {
                None | Some(Value::Nil) => None,
                Some(value) => {
                    let mut flat = into_array(value)
                        .ok_or_else(|| protocol(command, "fields are not an array"))?
                        .into_iter();
                    let mut pairs = Vec::with_capacity(flat.len() / 2);
                    while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                        let name =
                            into_bytes(name).ok_or_else(|| protocol(command, "field name"))?;
                        let value =
                            into_bytes(value).ok_or_else(|| protocol(command, "field value"))?;
                        pairs.push((name, value));
                    }
                    Some(pairs)
                }
            };
            Ok(RawEntry { id, fields })
        })
        .collect()
}

/// XREADGROUP's reply: nil on timeout, else `[[stream, entries]]`.
fn parse_read_reply(value: Value) -> Result<Vec<RawEntry>, TransportError> {
    const COMMAND: &str = "XREADGROUP";
    match value {
        Value::Nil => Ok(Vec::new()),
        Value::Array(streams) => match streams.into_iter().next() {
            None => Ok(Vec::new()),
            Some(stream) => {
                let entries = into_array(stream)
                    .and_then(|parts| parts.into_iter().nth(1))
                    .ok_or_else(|| protocol(COMMAND, "no entries"))?;
                parse_entries(COMMAND, entries)
            }
        },
        _ => Err(protocol(COMMAND, "unexpected reply type")),
    }
}

/// Field names as text. An entry with a name that is not UTF-8 cannot become headers (nor
/// a body found by `bodyField`): its raw fields come back with the reason, for its dead letter.
#[allow(clippy::type_complexity)]
fn decode_fields(
    fields: Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<Vec<(String, Vec<u8>)>, (Vec<(Vec<u8>, Vec<u8>)>, String)> {
    if let Some(index) = fields
        .iter()
        .position(|(name, _)| std::str::from_utf8(name).is_err())
    {
        let reason = format!(
            "stream entry field name #{} is not valid UTF-8; the entry's fields are kept in the dead letter's body \
             (`{{\"fields\": [[name, value], …]}}`, non-UTF-8 names and values as `{{\"base64\": …}}`)",
            index + 1
        );
        return Err((fields, reason));
    }
    Ok(fields
        .into_iter()
        .map(|(name, value)| {
            let name = String::from_utf8(name).unwrap_or_default();
            (name, value)
        })
        .collect())
}

/// An undecodable entry's fields as a JSON document: `{"fields": [[name, value], …]}` in stream
/// order (names may repeat), each name and value a string when UTF-8, else `{"base64": …}`.
fn raw_fields_json(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    use base64::Engine as _;
    let part = |bytes: &[u8]| match std::str::from_utf8(bytes) {
        Ok(text) => serde_json::Value::String(text.to_owned()),
        Err(_) => serde_json::json!({
            "base64": base64::engine::general_purpose::STANDARD.encode(bytes)
        }),
    };
    let pairs: Vec<serde_json::Value> = fields
        .iter()
        .map(|(name, value)| serde_json::json!([part(name), part(value)]))
        .collect();
    serde_json::json!({ "fields": pairs })
        .to_string()
        .into_bytes()
}

/// A flat `[name, value, name, value, …]` reply (XINFO) as a map.
fn flat_map(value: &Value) -> HashMap<String, &Value> {
    array(value)
        .unwrap_or_default()
        .chunks_exact(2)
        .filter_map(|pair| Some((text(&pair[0])?, &pair[1])))
        .collect()
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
        Ok(Self {
            source: format!("redis:{}", settings.adapter),
            metrics: StreamMetrics::register(registry, &settings.adapter),
            settings,
            reader: Connection::new(client.clone(), BLOCK + CONTROL_TIMEOUT).naming(keys.clone()),
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
            idempotency_key: format!("{}:{}", self.source, raw.id),
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

    /// XAUTOCLAIM entries idle longer than `claimIdleSeconds` into `reclaimed`.
    async fn reclaim_idle_entries(&mut self) -> Result<(), TransportError> {
        let limit = self.settings.batch_size.saturating_mul(10);
        let mut cursor = "0-0".to_owned();
        while self.reclaimed.len() < limit {
            let mut cmd = redis::cmd("XAUTOCLAIM");
            cmd.arg(&self.settings.stream)
                .arg(&self.settings.group)
                .arg(&self.settings.consumer)
                .arg(u64::try_from(self.settings.claim_idle.as_millis()).unwrap_or(u64::MAX))
                .arg(&cursor)
                .arg("COUNT")
                .arg(self.settings.batch_size);
            let reply = self.control("XAUTOCLAIM", &cmd).await?;
            let mut parts = into_array(reply)
                .ok_or_else(|| protocol("XAUTOCLAIM", "reply is not an array"))?
                .into_iter();
            let next = parts
                .next()
                .and_then(into_text)
                .ok_or_else(|| protocol("XAUTOCLAIM", "no cursor"))?;
            let entries = parse_entries(
                "XAUTOCLAIM",
                parts.next().unwrap_or(Value::Array(Vec::new())),
            )?;
            if !entries.is_empty() {
                let messages = self.with_counts(entries).await?;
                self.metrics.reclaimed.inc_by(messages.len() as u64);
                tracing::info!(
                    count = messages.len(),
                    "took over entries idle longer than claimIdleSeconds"
                );
                self.reclaimed.extend(messages);
            }
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        Ok(())
    }

    /// Trims dead letters older than the retention (`XTRIM … MINID`: entry ids are times).
    async fn trim_expired_dead_letters(&mut self) -> Result<(), TransportError> {
        let retention =
            u64::try_from(self.settings.dead_letter_retention.as_millis()).unwrap_or(u64::MAX);
        let Some(cutoff) = now_ms().checked_sub(retention) else {
            return Ok(());
        };
        let mut cmd = redis::cmd("XTRIM");
        cmd.arg(&self.settings.dead_letter_stream)
            .arg("MINID")
            .arg(cutoff);
        let trimmed = integer(&self.control("XTRIM", &cmd).await?).unwrap_or(0);
        if trimmed > 0 {
            tracing::info!(
                trimmed,
                "deleted dead letters older than deadLetter.retentionDays"
            );
        }
        Ok(())
    }

    /// Removes other consumers that hold no pending entries and have been idle well beyond a
    /// blocking read. A consumer with pending entries is never removed.
    async fn remove_idle_consumers(&mut self) -> Result<(), TransportError> {
        let threshold = (self.settings.claim_idle * 2).max(BLOCK * 5);
        let mut cmd = redis::cmd("XINFO");
        cmd.arg("CONSUMERS")
            .arg(&self.settings.stream)
            .arg(&self.settings.group);
        let reply = self.control("XINFO CONSUMERS", &cmd).await?;
        for consumer in array(&reply).unwrap_or_default() {
            let info = flat_map(consumer);
            let name = info.get("name").and_then(|v| text(v));
            let pending = info.get("pending").and_then(|v| integer(v));
            let idle = info.get("idle").and_then(|v| integer(v));
            let (Some(name), Some(0), Some(idle)) = (name, pending, idle) else {
                continue;
            };
            if name == self.settings.consumer || Duration::from_millis(idle) < threshold {
                continue;
            }
            let mut cmd = redis::cmd("XGROUP");
            cmd.arg("DELCONSUMER")
                .arg(&self.settings.stream)
                .arg(&self.settings.group)
                .arg(&name);
            self.control("XGROUP DELCONSUMER", &cmd).await?;
            self.metrics.consumers_removed.inc();
            tracing::info!(consumer = %name, idle_ms = idle, "removed idle consumer with no pending entries");
        }
        Ok(())
    }
}

/// Reads the group's lag, pending count and oldest pending entry, the age of the oldest entry
/// still waiting and the dead-letter stream's length, on its own connection.
#[derive(Debug)]
pub struct StreamProbe {
    conn: Connection,
    stream: String,
    group: String,
    dead_letter_stream: String,
    oldest_waiting_age_seconds: Gauge<f64, AtomicU64>,
}

impl StreamProbe {
    /// The age of the first entry after the group's last-delivered id (the oldest not yet
    /// delivered) into its gauge; returns the dead-letter stream's length and the age of its
    /// oldest entry.
    async fn record_waiting_and_count_dead_letters(
        &mut self,
        last_delivered: Option<String>,
    ) -> Result<(Option<u64>, Option<Duration>), TransportError> {
        let age_of = |reply: Option<&Value>| {
            reply
                .and_then(array)
                .and_then(|entries| entries.first())
                .and_then(array)
                .and_then(|entry| entry.first())
                .and_then(text)
                .and_then(|id| parse_id(&id))
                .map(|(ms, _)| Duration::from_millis(now_ms().saturating_sub(ms)))
        };
        let mut pipe = redis::pipe();
        pipe.cmd("XLEN").arg(&self.dead_letter_stream);
        pipe.cmd("XRANGE")
            .arg(&self.dead_letter_stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1);
        if let Some(last) = &last_delivered {
            pipe.cmd("XRANGE")
                .arg(&self.stream)
                .arg(format!("({last}"))
                .arg("+")
                .arg("COUNT")
                .arg(1);
        }
        let replies: Vec<Value> = self.conn.pipeline("XLEN+XRANGE", &pipe).await?;
        if last_delivered.is_some() {
            let age = age_of(replies.get(2)).unwrap_or(Duration::ZERO);
            self.oldest_waiting_age_seconds.set(age.as_secs_f64());
        }
        let count = replies.first().and_then(integer);
        Ok((count, age_of(replies.get(1)).or(Some(Duration::ZERO))))
    }
}

impl QueueProbe for StreamProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let mut cmd = redis::cmd("XINFO");
        cmd.arg("GROUPS").arg(&self.stream);
        let reply = match self.conn.query("XINFO GROUPS", &cmd).await {
            // No stream yet (the group is created with it): nothing waits.
            Err(err) if error_code(&err) == Some("ERR") => Value::Array(Vec::new()),
            other => other?,
        };
        let group = array(&reply)
            .unwrap_or_default()
            .iter()
            .map(flat_map)
            .find(|info| {
                info.get("name").and_then(|v| text(v)).as_deref() == Some(self.group.as_str())
            });
        let last_delivered = group
            .as_ref()
            .and_then(|info| info.get("last-delivered-id").and_then(|v| text(v)));
        let (dead_letters, oldest_dead_letter_age) = self
            .record_waiting_and_count_dead_letters(last_delivered)
            .await?;
        let backlog = group
            .as_ref()
            .and_then(|info| info.get("lag").and_then(|v| integer(v)));
        let pending = group
            .as_ref()
            .and_then(|info| info.get("pending").and_then(|v| integer(v)));
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(&self.stream).arg(&self.group);
        let summary = match self.conn.query("XPENDING", &cmd).await {
            // The group is recreated by the loop; until then nothing is pending.
            Err(err) if is_nogroup(&err) => {
                return Ok(QueueHealth {
                    dead_letters,
                    oldest_dead_letter_age,
                    ..QueueHealth::default()
                });
            }
            other => other?,
        };
        let oldest_pending_age = array(&summary)
            .and_then(|parts| parts.get(1))
            .and_then(text)
            .and_then(|id| parse_id(&id))
            .map(|(ms, _)| Duration::from_millis(now_ms().saturating_sub(ms)));
        Ok(QueueHealth {
            backlog,
            pending,
            oldest_pending_age: oldest_pending_age.or(Some(Duration::ZERO)),
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}

impl Transport for RedisStream {
    type Receipt = EntryId;
    type Probe = StreamProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
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
            let first_seen = message.enqueued_at_ms.map(rfc3339_ms).unwrap_or_default();
            pipe.cmd("XADD")
                .arg(&settings.dead_letter_stream)
                .arg("*")
                .arg("body")
                .arg(&message.body)
                .arg("headers")
                .arg(fields_json(&message.headers))
                .arg("reason")
                .arg(letter.reason.as_str())
                .arg("last_error")
                .arg(&letter.error)
                .arg("delivery_count")
                .arg(message.delivery_count)
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
                .arg(first_seen)
                .arg("last_seen")
                .arg(&last_seen)
                .arg("attempts")
                .arg(letter.attempts.to_json())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn read_reply_with_a_deleted_entry_parses() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![
                Value::Array(vec![
                    bulk("1-0"),
                    Value::Array(vec![bulk("body"), bulk("{}")]),
                ]),
                Value::Array(vec![bulk("2-0"), Value::Nil]),
            ]),
        ])]);
        let entries = parse_read_reply(reply).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(
            entries[0].fields.as_deref(),
            Some(&[(b"body".to_vec(), b"{}".to_vec())][..])
        );
        assert!(entries[1].fields.is_none());
    }

    #[test]
    fn a_field_name_that_is_not_utf8_is_kept_raw_not_a_protocol_error() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![
                    bulk("body"),
                    bulk("{}"),
                    Value::BulkString(vec![0xff, 0xfe]),
                    bulk("v"),
                ]),
            ])]),
        ])]);
        let mut entries = parse_read_reply(reply).expect("parses");
        let fields = entries.remove(0).fields.expect("fields");
        let (raw, reason) = decode_fields(fields).expect_err("undecodable");
        assert!(reason.contains("#2"), "{reason}");
        let json: serde_json::Value = serde_json::from_slice(&raw_fields_json(&raw)).expect("json");
        assert_eq!(
            json,
            serde_json::json!({"fields": [["body", "{}"], [{"base64": "//4="}, "v"]]})
        );
    }

    #[test]
    fn a_structurally_broken_reply_stays_a_protocol_error() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![Value::Array(vec![bulk("1-0"), Value::Int(3)])]),
        ])]);
        assert!(parse_read_reply(reply).is_err());
    }

    #[test]
    fn timeout_reply_is_empty() {
        assert!(parse_read_reply(Value::Nil).expect("nil").is_empty());
    }

    #[test]
    fn ids_parse_into_ms_and_seq() {
        assert_eq!(parse_id("1700000000000-7"), Some((1_700_000_000_000, 7)));
        assert_eq!(parse_id("garbage"), None);
    }
}
