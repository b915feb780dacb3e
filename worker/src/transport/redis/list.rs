//! Redis reliable list: producers `LPUSH`; the worker moves items into its own processing list
//! (`BLMOVE`, then `LMOVE` to fill the batch), stores them, then removes exactly those items
//! (`LREM … -1 item` per item, so identical bodies are handled one by one).
//!
//! Keys, for a list `L` and a consumer `C`:
//! - `L:processing:C` — what `C` holds un-acknowledged; re-processed first when `C` restarts;
//! - `L:heartbeat:C` — refreshed by a background task with a TTL of `claimIdleSeconds`;
//! - `L:consumers` — every consumer that ever held items;
//! - `L:deliveries`, `L:first-seen` — delivery count and first delivery time per body hash,
//!   cleared when the body is stored;
//! - `L:reaper` — a short lock: one live consumer at a time moves the items of consumers whose
//!   heartbeat expired back to `L`.

use std::collections::HashSet;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use redis::Value;
use switchboard_store::Dedup;
use tokio::task::JoinHandle;

use super::{
    BLOCK, CONTROL_TIMEOUT, Connection, NamedKey, Origin, array, dead_letter_record, integer, open,
    record_time_ms, refused_by_dead_letter_key, text,
};
use crate::health::now_ms;
use crate::metrics::{adapter_aliased, broker_reconnects};
use crate::transport::identity::{body_hash, body_id, idempotency_key};
use crate::transport::{
    Acked, DeadLetter, Message, QueueHealth, QueueProbe, Transport, TransportError,
};

/// The hex SHA-256 of an item's body: its delivery count and first-seen time are kept under it.
pub type BodyHash = String;
type Item = Message<BodyHash>;

/// Everything the list transport needs to know.
#[derive(Debug, Clone)]
pub struct ListSettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    pub list: String,
    pub consumer: String,
    /// Heartbeat TTL: a consumer silent this long is presumed dead and its items reaped.
    pub heartbeat_ttl: Duration,
    pub dead_letter_list: String,
    pub batch_size: usize,
    /// Dead letters older than this are deleted (`deadLetter.retentionDays`).
    pub dead_letter_retention: Duration,
}

/// The Redis reliable-list transport.
#[derive(Debug)]
pub struct RedisList {
    settings: ListSettings,
    source: String,
    processing: String,
    consumers: String,
    deliveries: String,
    first_seen: String,
    reaper_lock: String,
    client: redis::Client,
    reader: Connection,
    control: Connection,
    /// Items moved back from processing lists of dead consumers.
    reaped: Counter,
    /// Re-process the own processing list before taking new items.
    replay: bool,
    heartbeat: Option<JoinHandle<()>>,
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        _ => None,
    }
}

impl RedisList {
    pub fn new(
        settings: ListSettings,
        redis_url: &str,
        registry: &mut Registry,
    ) -> Result<Self, TransportError> {
        let client = open(redis_url)?;
        let list = &settings.list;
        let keys = Self::keys(&settings);
        let reconnects = broker_reconnects(registry, &settings.adapter, None);
        Ok(Self {
            source: format!("redis:{}", settings.adapter),
            processing: Self::processing_key(list, &settings.consumer),
            consumers: format!("{list}:consumers"),
            deliveries: format!("{list}:deliveries"),
            first_seen: format!("{list}:first-seen"),
            reaper_lock: format!("{list}:reaper"),
            reader: Connection::new(client.clone(), BLOCK + CONTROL_TIMEOUT)
                .naming(keys.clone())
                .counting_reconnects(reconnects),
            control: Connection::new(client.clone(), CONTROL_TIMEOUT).naming(keys),
            client,
            reaped: adapter_aliased(
                registry,
                "redis_messages_reaped",
                "messages_reaped",
                "Items moved back to the list from processing lists of consumers whose heartbeat expired",
                &settings.adapter,
            ),
            settings,
            replay: true,
            heartbeat: None,
        })
    }

    /// The keys the transport uses, with the settings that name them (the keys it derives
    /// from the list's name are named by `spec.source.redis.list`).
    fn keys(settings: &ListSettings) -> Vec<NamedKey> {
        const LIST: &str = "spec.source.redis.list";
        let list = &settings.list;
        vec![
            NamedKey::new(list, LIST, "list"),
            NamedKey::new(Self::processing_key(list, &settings.consumer), LIST, "list"),
            NamedKey::new(format!("{list}:consumers"), LIST, "set"),
            NamedKey::new(format!("{list}:deliveries"), LIST, "hash"),
            NamedKey::new(format!("{list}:first-seen"), LIST, "hash"),
            NamedKey::new(
                &settings.dead_letter_list,
                "spec.delivery.deadLetter.list",
                "list",
            ),
        ]
    }

    fn processing_key(list: &str, consumer: &str) -> String {
        format!("{list}:processing:{consumer}")
    }

    fn heartbeat_key(list: &str, consumer: &str) -> String {
        format!("{list}:heartbeat:{consumer}")
    }

    fn heartbeat_cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("SET");
        cmd.arg(Self::heartbeat_key(
            &self.settings.list,
            &self.settings.consumer,
        ))
        .arg(now_ms())
        .arg("PX")
        .arg(millis(self.settings.heartbeat_ttl));
        cmd
    }

    /// Refreshes the heartbeat every third of its TTL, for as long as the process lives.
    fn spawn_heartbeat(&mut self) {
        if self
            .heartbeat
            .as_ref()
            .is_some_and(|task| !task.is_finished())
        {
            return;
        }
        let ttl = self.settings.heartbeat_ttl;
        let list = self.settings.list.clone();
        let consumer = self.settings.consumer.clone();
        let ttl_ms = millis(ttl);
        let client = self.client.clone();
        let consumers = self.consumers.clone();
        self.heartbeat = Some(crate::task::spawn(async move {
            let mut conn = Connection::new(client, CONTROL_TIMEOUT);
            loop {
                tokio::time::sleep(ttl / 3).await;
                // Re-register too: a reaper that took a slow consumer for dead forgot it.
                let mut pipe = redis::pipe();
                pipe.cmd("SET")
                    .arg(Self::heartbeat_key(&list, &consumer))
                    .arg(now_ms())
                    .arg("PX")
                    .arg(ttl_ms)
                    .ignore();
                pipe.cmd("SADD").arg(&consumers).arg(&consumer).ignore();
                if let Err(err) = conn.pipeline::<()>("SET heartbeat", &pipe).await {
                    tracing::debug!(error = %err, "heartbeat refresh failed");
                }
            }
        }));
    }

    /// Counts a delivery of each distinct body (once per batch) and builds the messages.
    async fn deliver(&mut self, items: Vec<Vec<u8>>) -> Result<Vec<Item>, TransportError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let hashes: Vec<String> = items.iter().map(|item| body_hash(item)).collect();
        let mut distinct: Vec<&String> = Vec::new();
        let mut seen = HashSet::new();
        for hash in &hashes {
            if seen.insert(hash) {
                distinct.push(hash);
            }
        }
        let now = now_ms();
        let mut pipe = redis::pipe();
        for hash in &distinct {
            pipe.cmd("HINCRBY").arg(&self.deliveries).arg(*hash).arg(1);
            pipe.cmd("HSETNX")
                .arg(&self.first_seen)
                .arg(*hash)
                .arg(now)
                .ignore();
            pipe.cmd("HGET").arg(&self.first_seen).arg(*hash);
        }
        let replies: Vec<Value> = self.control.pipeline("HINCRBY", &pipe).await?;
        let counts: std::collections::HashMap<&String, (u64, Option<u64>)> = distinct
            .iter()
            .zip(replies.chunks_exact(2))
            .map(|(hash, pair)| (*hash, (integer(&pair[0]).unwrap_or(1), integer(&pair[1]))))
            .collect();
        Ok(items
            .into_iter()
            .zip(&hashes)
            .map(|(body, hash)| {
                let (delivery_count, first_seen) = counts.get(hash).copied().unwrap_or((1, None));
                let external_id = body_id(hash);
                Message {
                    receipt: hash.clone(),
                    idempotency_key: idempotency_key(&self.source, &external_id),
                    external_id,
                    body,
                    headers: Vec::new(),
                    delivery_count,
                    enqueued_at_ms: first_seen,
                    position: None,
                    undecodable: None,
                }
            })
            .collect())
    }

    /// Adds to `pipe`: remove handled items from the processing list (one occurrence each) and
    /// forget their delivery counts.
    fn settle(&self, pipe: &mut redis::Pipeline, messages: &[&Item]) {
        for message in messages {
            pipe.cmd("LREM")
                .arg(&self.processing)
                .arg(-1)
                .arg(&message.body)
                .ignore();
        }
        let hashes: Vec<&str> = messages.iter().map(|m| m.receipt.as_str()).collect();
        pipe.cmd("HDEL").arg(&self.deliveries).arg(&hashes).ignore();
        pipe.cmd("HDEL").arg(&self.first_seen).arg(&hashes).ignore();
    }

    /// Moves every item of `from` back to the tail of the source list (next to be taken),
    /// oldest last so the original order is kept. Returns how many moved.
    async fn move_back(&mut self, from: &str) -> Result<u64, TransportError> {
        let mut llen = redis::cmd("LLEN");
        llen.arg(from);
        let len = integer(&self.control.query("LLEN", &llen).await?).unwrap_or(0);
        if len == 0 {
            return Ok(0);
        }
        let mut pipe = redis::pipe();
        for _ in 0..len {
            pipe.cmd("LMOVE")
                .arg(from)
                .arg(&self.settings.list)
                .arg("LEFT")
                .arg("RIGHT");
        }
        let moved: Vec<Value> = self.control.pipeline("LMOVE", &pipe).await?;
        Ok(moved
            .into_iter()
            .filter(|v| !matches!(v, Value::Nil))
            .count() as u64)
    }

    /// Moves the items of consumers whose heartbeat expired back to the list. One reaper at a
    /// time holds a short lock.
    async fn reap_dead_consumers(&mut self) -> Result<(), TransportError> {
        let mut lock = redis::cmd("SET");
        lock.arg(&self.reaper_lock)
            .arg(&self.settings.consumer)
            .arg("NX")
            .arg("PX")
            .arg(millis(self.maintenance_interval()));
        if matches!(self.control.query("SET reaper", &lock).await?, Value::Nil) {
            return Ok(());
        }
        let others: Vec<String> = consumers(&mut self.control, &self.consumers)
            .await?
            .into_iter()
            .filter(|name| *name != self.settings.consumer)
            .collect();
        for consumer in others {
            let mut alive = redis::cmd("EXISTS");
            alive.arg(Self::heartbeat_key(&self.settings.list, &consumer));
            if integer(&self.control.query("EXISTS", &alive).await?) != Some(0) {
                continue;
            }
            let moved = self
                .move_back(&Self::processing_key(&self.settings.list, &consumer))
                .await?;
            let mut forget = redis::cmd("SREM");
            forget.arg(&self.consumers).arg(&consumer);
            self.control.query("SREM", &forget).await?;
            if moved > 0 {
                self.reaped.inc_by(moved);
                tracing::info!(consumer = %consumer, items = moved, "moved the items of a dead consumer back to the list");
            }
        }
        Ok(())
    }

    /// Deletes dead letters older than the retention from the list's oldest (right) end, at
    /// most a batch per call.
    async fn trim_expired_dead_letters(&mut self) -> Result<(), TransportError> {
        let retention =
            u64::try_from(self.settings.dead_letter_retention.as_millis()).unwrap_or(u64::MAX);
        let Some(cutoff) = now_ms().checked_sub(retention) else {
            return Ok(());
        };
        let mut trimmed = 0;
        while trimmed < self.settings.batch_size {
            let mut oldest = redis::cmd("LINDEX");
            oldest.arg(&self.settings.dead_letter_list).arg(-1);
            let Value::BulkString(record) = self.control.query("LINDEX", &oldest).await? else {
                break;
            };
            if record_time_ms(&record).is_none_or(|at| at >= cutoff) {
                break;
            }
            let mut remove = redis::cmd("LREM");
            remove
                .arg(&self.settings.dead_letter_list)
                .arg(-1)
                .arg(&record);
            self.control.query("LREM", &remove).await?;
            trimmed += 1;
        }
        if trimmed > 0 {
            tracing::info!(
                trimmed,
                "deleted dead letters older than deadLetter.retentionDays"
            );
        }
        Ok(())
    }

    /// The own processing list first (after a start or a failure), then new items.
    async fn take_items(&mut self, max: usize, block: bool) -> Result<Vec<Item>, TransportError> {
        if self.replay {
            let mut range = redis::cmd("LRANGE");
            range.arg(&self.processing).arg(0).arg(-1);
            let held: Vec<Vec<u8>> = array(&self.control.query("LRANGE", &range).await?)
                .unwrap_or_default()
                .iter()
                .cloned()
                .filter_map(bytes)
                .rev()
                .collect();
            self.replay = false;
            if !held.is_empty() {
                tracing::info!(
                    items = held.len(),
                    "re-processing items left in the own processing list"
                );
                return self.deliver(held).await;
            }
        }
        let mut items = Vec::with_capacity(max);
        if block {
            let mut blocking = redis::cmd("BLMOVE");
            blocking
                .arg(&self.settings.list)
                .arg(&self.processing)
                .arg("RIGHT")
                .arg("LEFT")
                .arg(BLOCK.as_secs_f64());
            let Some(first) = bytes(self.reader.query("BLMOVE", &blocking).await?) else {
                return Ok(Vec::new());
            };
            items.push(first);
        }
        if items.len() < max {
            let mut pipe = redis::pipe();
            for _ in items.len()..max {
                pipe.cmd("LMOVE")
                    .arg(&self.settings.list)
                    .arg(&self.processing)
                    .arg("RIGHT")
                    .arg("LEFT");
            }
            let more: Vec<Value> = self.control.pipeline("LMOVE", &pipe).await?;
            items.extend(more.into_iter().filter_map(bytes));
        }
        self.deliver(items).await
    }
}

/// Every consumer that has held items of the list whose consumer set is `key`.
async fn consumers(conn: &mut Connection, key: &str) -> Result<Vec<String>, TransportError> {
    let mut members = redis::cmd("SMEMBERS");
    members.arg(key);
    Ok(array(&conn.query("SMEMBERS", &members).await?)
        .unwrap_or_default()
        .iter()
        .filter_map(text)
        .collect())
}

/// Reads the list's length, what its consumers hold, the oldest first delivery and the
/// dead-letter list's length, on its own connection. How long the oldest item has waited in the
/// list is unknown (items carry no enqueue time), so it is not exported.
#[derive(Debug)]
pub struct ListProbe {
    conn: Connection,
    list: String,
    consumers: String,
    first_seen: String,
    dead_letter_list: String,
}

impl QueueProbe for ListProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let members = consumers(&mut self.conn, &self.consumers).await?;
        let mut pipe = redis::pipe();
        pipe.cmd("LLEN").arg(&self.dead_letter_list);
        pipe.cmd("LLEN").arg(&self.list);
        for consumer in &members {
            pipe.cmd("LLEN")
                .arg(RedisList::processing_key(&self.list, consumer));
        }
        let mut lengths: Vec<u64> = self.conn.pipeline("LLEN", &pipe).await?;
        let dead_letters = (!lengths.is_empty()).then(|| lengths.remove(0));
        // Dead letters are pushed on the left: the oldest is the rightmost.
        let mut oldest_letter = redis::cmd("LINDEX");
        oldest_letter.arg(&self.dead_letter_list).arg(-1);
        let oldest_dead_letter_age = match self.conn.query("LINDEX", &oldest_letter).await? {
            Value::BulkString(record) => {
                record_time_ms(&record).map(|ms| Duration::from_millis(now_ms().saturating_sub(ms)))
            }
            _ => Some(Duration::ZERO),
        };
        // First delivery times of every body delivered and not yet stored.
        let mut first_seen = redis::cmd("HVALS");
        first_seen.arg(&self.first_seen);
        let oldest = array(&self.conn.query("HVALS", &first_seen).await?)
            .unwrap_or_default()
            .iter()
            .filter_map(integer)
            .min();
        Ok(QueueHealth {
            backlog: lengths.first().copied(),
            pending: Some(lengths.iter().skip(1).sum()),
            oldest_pending_age: Some(Duration::from_millis(
                oldest.map_or(0, |ms| now_ms().saturating_sub(ms)),
            )),
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}

impl Transport for RedisList {
    type Receipt = BodyHash;
    type Probe = ListProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn endpoint(&self) -> String {
        self.control.endpoint()
    }

    fn dedup(&self) -> Dedup {
        Dedup::BodyHash
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD")
            .arg(&self.consumers)
            .arg(&self.settings.consumer)
            .ignore();
        pipe.add_command(self.heartbeat_cmd()).ignore();
        self.control.pipeline::<()>("SADD+SET", &pipe).await?;
        self.spawn_heartbeat();
        Ok(())
    }

    async fn receive(&mut self, max: usize, block: bool) -> Result<Vec<Item>, TransportError> {
        let result = self.take_items(max, block).await;
        if result.is_err() {
            // Items may have been moved into the processing list and not handed out: re-read it.
            self.replay = true;
        }
        result
    }

    async fn ack(&mut self, messages: &[&Item]) -> Result<Acked, TransportError> {
        if messages.is_empty() {
            return Ok(Acked::all());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        self.settle(&mut pipe, messages);
        self.control.pipeline::<()>("LREM", &pipe).await?;
        Ok(Acked::all())
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, BodyHash>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let origin = Origin {
            kind: "list",
            name: &self.settings.list,
            adapter: &self.settings.adapter,
            consumer: &self.settings.consumer,
        };
        let mut write = redis::cmd("LPUSH");
        write.arg(&self.settings.dead_letter_list);
        for letter in letters {
            write.arg(dead_letter_record(letter, origin));
        }
        self.control
            .query("LPUSH", &write)
            .await
            .map(drop)
            .map_err(|err| refused_by_dead_letter_key(err, letters.len()))
    }

    async fn maintain(&mut self) -> Result<(), TransportError> {
        self.reap_dead_consumers().await?;
        // Housekeeping: a failure is tried again next time (a dead-letter key of the wrong type
        // stops the worker when a dead letter is written, not before).
        if let Err(err) = self.trim_expired_dead_letters().await {
            tracing::debug!(error = %err, "cannot trim the dead-letter list");
        }
        Ok(())
    }

    fn maintenance_interval(&self) -> Duration {
        (self.settings.heartbeat_ttl / 2).clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    fn probe(&self) -> ListProbe {
        ListProbe {
            conn: Connection::new(self.client.clone(), CONTROL_TIMEOUT)
                .naming(Self::keys(&self.settings)),
            list: self.settings.list.clone(),
            consumers: self.consumers.clone(),
            first_seen: self.first_seen.clone(),
            dead_letter_list: self.settings.dead_letter_list.clone(),
        }
    }

    async fn shutdown(&mut self) {
        // Close the blocking connection so no late BLMOVE lands after the hand-back.
        self.reader.disconnect();
        if let Some(task) = self.heartbeat.take() {
            task.abort();
        }
        let processing = self.processing.clone();
        match self.move_back(&processing).await {
            Ok(moved) => tracing::info!(
                items = moved,
                "handed un-acknowledged items back to the list"
            ),
            Err(err) => {
                tracing::warn!(error = %err, "could not hand items back; a live consumer will reap them")
            }
        }
        // Without a heartbeat, any straggler is reaped by a live consumer (which also forgets us).
        let mut forget = redis::cmd("DEL");
        forget.arg(Self::heartbeat_key(
            &self.settings.list,
            &self.settings.consumer,
        ));
        let _ = self.control.query("DEL heartbeat", &forget).await;
    }
}

impl Drop for RedisList {
    fn drop(&mut self) {
        if let Some(task) = self.heartbeat.take() {
            task.abort();
        }
    }
}
