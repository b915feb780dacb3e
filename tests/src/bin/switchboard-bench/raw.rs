//! The raw database limit: rows written by the bench itself, with the worker's statement
//! (`ingest_batch`) or with COPY, by concurrent loops — what the worker is compared with.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Result, ensure};
use sqlx::{Connection, PgConnection};
use switchboard_store::{Dedup, IngestBatch, Lookup, NewEvent, Store, Stored};
use tokio::task::JoinSet;

use crate::measure::Measurement;
use crate::redis_stream::stream_position;
use crate::{Bench, ensure_stored_once, order_body};

pub(crate) const RAW_SOURCE: &str = "redis:test/raw";
pub(crate) const RAW_QUEUE: &str = "raw";

/// How the raw database loop stores a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RawMethod {
    /// `Store::ingest_batch`: the worker's own statement.
    WorkerSql,
    /// COPY into a temporary staging table, then INSERT … SELECT into events and todos.
    CopyStaging,
}

impl RawMethod {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RawMethod::WorkerSql => "worker SQL",
            RawMethod::CopyStaging => "COPY+staging",
        }
    }
}

/// Whether the raw rows' keys come with a broker time, as stream entry ids, SQS MessageIds,
/// JetStream and Kafka records do, or without one, as RabbitMQ message-ids: the worker stores
/// them with a different lookup (docs/storage.md), so a broker's raw database reference uses
/// the kind its worker stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyTime {
    Broker,
    Untimed,
}

/// The rows the worker would build for a stream of `order_body` entries, handed out in
/// batches to concurrent loops.
pub(crate) struct RawRows {
    pub(crate) first_ms: u64,
    pub(crate) events: Vec<NewEvent>,
    pub(crate) batch_size: usize,
    pub(crate) next_batch: AtomicUsize,
}

impl RawRows {
    pub(crate) fn new(entries: usize, batch_size: usize, key_time: KeyTime) -> Self {
        let first_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or_default();
        let events = (0..entries)
            .map(|i| {
                let id = format!("{first_ms}-{i}");
                NewEvent {
                    idempotency_key: format!("{RAW_SOURCE}:{id}"),
                    external_id: id,
                    payload: String::from_utf8_lossy(&order_body(i)).into_owned(),
                    headers: "{}".to_owned(),
                    traceparent: None,
                    tracestate: None,
                    lookup: match (key_time, i64::try_from(first_ms)) {
                        (KeyTime::Broker, Ok(ms)) => Lookup::Since(ms),
                        _ => Lookup::Untimed,
                    },
                }
            })
            .collect();
        Self {
            first_ms,
            events,
            batch_size,
            next_batch: AtomicUsize::new(0),
        }
    }

    /// The next batch not yet taken by any loop.
    pub(crate) fn take_batch(&self) -> Option<Range<usize>> {
        let start = self.next_batch.fetch_add(1, Ordering::Relaxed) * self.batch_size;
        (start < self.events.len()).then(|| start..(start + self.batch_size).min(self.events.len()))
    }

    /// The stream position (`ms`, `seq`) of the last row in `batch`.
    pub(crate) fn checkpoint(&self, batch: &Range<usize>) -> (i64, i64) {
        (
            i64::try_from(self.first_ms).unwrap_or(i64::MAX),
            i64::try_from(batch.end).unwrap_or(i64::MAX) - 1,
        )
    }
}

pub(crate) async fn ingest_loop(store: &Store, rows: &RawRows) -> Result<()> {
    while let Some(batch) = rows.take_batch() {
        let outcomes = store
            .ingest_batch(&IngestBatch {
                source: RAW_SOURCE,
                queue: RAW_QUEUE,
                dedup: Dedup::NativeId,
                positions: &[{
                    let (ms, seq) = rows.checkpoint(&batch);
                    stream_position(ms, seq)
                }],
                events: &rows.events[batch],
            })
            .await?;
        ensure!(
            outcomes.iter().all(|outcome| *outcome == Stored::New),
            "fresh rows were not all stored as new"
        );
    }
    Ok(())
}

/// Inserts the staged batch like the worker's statement does (dedup within the partition of
/// now, todos for new events, checkpoint), without returning per-row outcomes, nor the
/// worker's check of the other partitions and its locks: a ceiling, not a safe ingest.
pub(crate) const STAGED_INGEST_SQL: &str = r#"
WITH new_events AS (
    INSERT INTO events (source, external_id, payload, headers)
    SELECT $1, external_id, payload, headers FROM staging ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING id, external_id, payload
), new_todos AS (
    INSERT INTO todos (queue, idempotency_key, event_id, payload)
    SELECT $2, staging.idempotency_key, new_events.id, new_events.payload
    FROM new_events JOIN staging USING (external_id)
    ORDER BY staging.ord
    ON CONFLICT (queue, idempotency_key) WHERE status IN ('pending', 'claimed') DO NOTHING
)
INSERT INTO source_positions (source, partition, position)
SELECT $1, '', ARRAY[$3::bigint, $4::bigint] WHERE EXISTS (SELECT 1 FROM new_events)
ON CONFLICT (source, partition) DO UPDATE
    SET position = EXCLUDED.position, updated_at = now()
    WHERE source_positions.position < EXCLUDED.position
"#;

pub(crate) async fn copy_loop(url: &str, rows: &RawRows) -> Result<()> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query(
        "CREATE TEMPORARY TABLE staging (ord bigint, external_id text, idempotency_key text, \
         payload jsonb, headers jsonb) ON COMMIT DELETE ROWS",
    )
    .execute(&mut conn)
    .await?;
    let mut data = Vec::new();
    while let Some(batch) = rows.take_batch() {
        data.clear();
        for (ord, event) in rows.events[batch.clone()].iter().enumerate() {
            for (column, value) in [
                ord.to_string().as_str(),
                &event.external_id,
                &event.idempotency_key,
                &event.payload,
                &event.headers,
            ]
            .into_iter()
            .enumerate()
            {
                if column > 0 {
                    data.push(b'\t');
                }
                push_copy_text(&mut data, value);
            }
            data.push(b'\n');
        }
        let (ms, seq) = rows.checkpoint(&batch);
        let mut tx = conn.begin().await?;
        let mut copy = tx
            .copy_in_raw(
                "COPY staging (ord, external_id, idempotency_key, payload, headers) FROM STDIN",
            )
            .await?;
        copy.send(data.as_slice()).await?;
        copy.finish().await?;
        sqlx::query(STAGED_INGEST_SQL)
            .bind(RAW_SOURCE)
            .bind(RAW_QUEUE)
            .bind(ms)
            .bind(seq)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Appends `value` escaped for COPY's text format.
pub(crate) fn push_copy_text(out: &mut Vec<u8>, value: &str) {
    for byte in value.bytes() {
        match byte {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            other => out.push(other),
        }
    }
}

impl Bench {
    /// The raw database limit a worker phase is held against, measured right before and right
    /// after it: the worker's SQL on the most `--connections`, `rows` = (as many rows as the
    /// worker gets messages, in batches of the worker's size). This VM's speed drifts by tens
    /// of percent within a round, so the worker is compared with the limit of the same moment:
    /// both runs together, which a steady drift moves as much as the worker.
    pub(crate) async fn raw_database_reference(
        &mut self,
        rows: (usize, usize),
        key_time: KeyTime,
    ) -> Result<Measurement> {
        let connections = self.args.connections.iter().copied().max().unwrap_or(1);
        self.raw_database(RawMethod::WorkerSql, connections, rows, key_time)
            .await
    }

    /// `entries` rows like those the worker stores, with no broker: `connections` loops pulling
    /// batches of `batch_size`.
    pub(crate) async fn raw_database(
        &mut self,
        method: RawMethod,
        connections: usize,
        (entries, batch_size): (usize, usize),
        key_time: KeyTime,
    ) -> Result<Measurement> {
        let rows = Arc::new(RawRows::new(entries, batch_size, key_time));
        let database = self.fresh_database(u32::try_from(connections)?).await?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let mut loops = JoinSet::new();
        for _ in 0..connections {
            let rows = Arc::clone(&rows);
            let store = database.store.clone();
            let url = database.url.clone();
            loops.spawn(async move {
                match method {
                    RawMethod::WorkerSql => ingest_loop(&store, &rows).await,
                    RawMethod::CopyStaging => copy_loop(&url, &rows).await,
                }
            });
        }
        while let Some(result) = loops.join_next().await {
            result??;
        }
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, None);
        ensure_stored_once(&database.store, RAW_QUEUE, entries).await?;
        self.drop_database(database).await?;
        Ok(Measurement {
            name: format!(
                "raw DB {} x{connections}{}",
                method.as_str(),
                match key_time {
                    KeyTime::Broker => "",
                    KeyTime::Untimed => " untimed keys",
                }
            ),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store: None,
        })
    }
}
