//! The Redis stream phases: the worker's commit latency under a steady load, the raw Redis
//! limit (XREADGROUP + XACK by the bench), and the pipelined ceiling of read → commit → ack.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use switchboard_store::{Dedup, IngestBatch, Lookup, NewEvent, Position};
use switchboard_tests::wait::wait_for;

use crate::measure::status_kib;
use crate::measure::{Latency, Measurement};
use crate::{Bench, Mode, PHASE_TIMEOUT, order_body};
use crate::{ensure_stored_once, stop_worker, store_use, wait_acked};

impl Bench {
    /// Offers `rate` stream entries per second for `latency_seconds` to a running worker and
    /// reads each row's commit time from PostgreSQL's commit timestamps.
    pub(crate) async fn latency_under_load(&mut self) -> Result<(Measurement, Latency)> {
        let name = &format!("stream-latency-r{}", self.round);
        let (rate, seconds) = (self.args.rate, self.args.latency_seconds);
        let total = usize::try_from(rate * seconds)?;
        let database = self.fresh_database(4).await?;
        let worker = self.start_worker(&database, Mode::Stream, name, self.args.batch_size, &[])?;
        wait_for(PHASE_TIMEOUT, "the worker is ready", || async {
            Ok(worker.http_get("/readyz")?.0 == 200)
        })
        .await?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        offer_steady_load(&self.fx.redis.url(), name, rate, total).await?;
        wait_acked(&worker, name, total).await?;
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, Some(worker.pid()));
        let peak_rss_kib = status_kib(worker.pid(), "VmHWM");
        let store = Some(store_use(&worker, name, elapsed)?);
        stop_worker(worker)?;
        ensure_stored_once(&database.store, name, total).await?;
        Mode::Stream.ensure_drained(&self.fx, name)?;
        let (p50_ms, p99_ms, max_ms): (f64, f64, f64) = sqlx::query_as(
            "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY ms), \
                    percentile_disc(0.99) WITHIN GROUP (ORDER BY ms), max(ms) \
             FROM (SELECT (extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000 \
                           - split_part(external_id, '-', 1)::bigint)::float8 AS ms \
                   FROM events) AS latencies",
        )
        .fetch_one(database.store.pool())
        .await?;
        self.drop_database(database).await?;
        Ok((
            Measurement {
                name: format!("worker stream steady {rate}/s"),
                messages: total,
                elapsed,
                cpu,
                peak_rss_kib,
                store,
            },
            Latency {
                p50_ms,
                p99_ms,
                max_ms,
            },
        ))
    }

    /// XREADGROUP COUNT batch + XACK of `entries` preloaded entries, no database.
    pub(crate) async fn raw_broker(&mut self) -> Result<Measurement> {
        let key = &format!("raw-broker-r{}", self.round);
        let entries = self.args.entries;
        Mode::Stream.preload(&self.fx, key, (0..entries).map(order_body))?;
        let mut conn = self.group_connection(key).await?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let mut received = 0;
        loop {
            let ids: Vec<String> = read_group_batch(&mut conn, key, self.args.batch_size)
                .await?
                .into_iter()
                .map(|entry| entry.id)
                .collect();
            if ids.is_empty() {
                break;
            }
            received += ids.len();
            acknowledge(&mut conn, key, &ids).await?;
        }
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, None);
        ensure!(
            received == entries,
            "raw broker loop read {received} of {entries} entries"
        );
        Mode::Stream.ensure_drained(&self.fx, key)?;
        Ok(Measurement {
            name: format!("raw broker XREADGROUP+XACK {}", self.args.batch_size),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store: None,
        })
    }

    /// An async connection, with the group `switchboard` created at the start of `key`.
    pub(crate) async fn group_connection(
        &self,
        key: &str,
    ) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.fx.redis.url())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(key)
            .arg("switchboard")
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<()>(&mut conn)
            .await?;
        Ok(conn)
    }

    /// A model of the worker's loop — XREADGROUP, build rows, `ingest_batch`, XACK after the
    /// commit — with up to `depth` batches stored at once (acks in receive order). Depth 1 is
    /// the worker's current shape; deeper shows what overlapping would gain.
    pub(crate) async fn pipelined_ceiling(&mut self, depth: usize) -> Result<Measurement> {
        let name = format!("pipelined-depth{depth}-r{}", self.round);
        let entries = self.args.entries;
        let database = self.fresh_database(u32::try_from(depth)?).await?;
        Mode::Stream.preload(&self.fx, &name, (0..entries).map(order_body))?;
        let mut conn = self.group_connection(&name).await?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let mut in_flight = std::collections::VecDeque::new();
        let mut exhausted = false;
        while !(exhausted && in_flight.is_empty()) {
            if exhausted || in_flight.len() == depth {
                let stored: tokio::task::JoinHandle<Result<Vec<String>>> =
                    in_flight.pop_front().context("a batch is in flight")?;
                acknowledge(&mut conn, &name, &stored.await??).await?;
                continue;
            }
            let batch = read_group_batch(&mut conn, &name, self.args.batch_size).await?;
            if batch.is_empty() {
                exhausted = true;
                continue;
            }
            let events = batch
                .iter()
                .map(|entry| stream_event(&name, entry))
                .collect::<Result<Vec<_>>>()?;
            let positions: Vec<Position> = batch
                .last()
                .and_then(|entry| entry_position(&entry.id))
                .into_iter()
                .collect();
            let (store, source) = (database.store.clone(), format!("redis:test/{name}"));
            let queue = name.clone();
            in_flight.push_back(tokio::spawn(async move {
                store
                    .ingest_batch(&IngestBatch {
                        source: &source,
                        queue: &queue,
                        dedup: Dedup::NativeId,
                        positions: &positions,
                        events: &events,
                    })
                    .await?;
                Ok(events.into_iter().map(|event| event.external_id).collect())
            }));
        }
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, None);
        ensure_stored_once(&database.store, &name, entries).await?;
        Mode::Stream.ensure_drained(&self.fx, &name)?;
        self.drop_database(database).await?;
        Ok(Measurement {
            name: format!("model loop, {depth} batch(es) in flight"),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store: None,
        })
    }
}

/// XREADGROUP of up to `count` new entries of `key` for consumer `bench`, without blocking.
pub(crate) async fn read_group_batch(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    count: usize,
) -> Result<Vec<redis::streams::StreamId>> {
    let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("switchboard")
        .arg("bench")
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(key)
        .arg(">")
        .query_async(conn)
        .await?;
    Ok(reply
        .into_iter()
        .flat_map(|reply| reply.keys)
        .flat_map(|stream| stream.ids)
        .collect())
}

pub(crate) async fn acknowledge(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    ids: &[String],
) -> Result<()> {
    redis::cmd("XACK")
        .arg(key)
        .arg("switchboard")
        .arg(ids)
        .query_async::<u64>(conn)
        .await?;
    Ok(())
}

/// The row the worker builds for a stream entry of adapter `test/{name}`.
pub(crate) fn stream_event(name: &str, entry: &redis::streams::StreamId) -> Result<NewEvent> {
    let body: Vec<u8> = entry.get("body").context("entry has no body field")?;
    serde_json::from_slice::<serde::de::IgnoredAny>(&body).context("body is not JSON")?;
    Ok(NewEvent {
        idempotency_key: format!("redis:test/{name}:{}", entry.id),
        external_id: entry.id.clone(),
        payload: String::from_utf8(body)?,
        headers: "{}".to_owned(),
        traceparent: None,
        tracestate: None,
        lookup: entry
            .id
            .split_once('-')
            .and_then(|(ms, _)| ms.parse().ok())
            .map_or(Lookup::Untimed, Lookup::Since),
    })
}

/// The stream position (`[ms, seq]`) of an entry id.
pub(crate) fn entry_position(id: &str) -> Option<Position> {
    let (ms, seq) = id.split_once('-')?;
    Some(stream_position(ms.parse().ok()?, seq.parse().ok()?))
}

pub(crate) fn stream_position(ms: i64, seq: i64) -> Position {
    Position {
        partition: String::new(),
        value: vec![ms, seq],
    }
}

/// XADDs `total` entries to `stream` at `rate` per second, on a timer.
pub(crate) async fn offer_steady_load(
    redis_url: &str,
    stream: &str,
    rate: u64,
    total: usize,
) -> Result<()> {
    let client = redis::Client::open(redis_url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let started = Instant::now();
    let mut sent = 0;
    while sent < total {
        ticks.tick().await;
        let due = usize::try_from(started.elapsed().as_millis() * u128::from(rate) / 1000)?;
        let due = due.min(total);
        if due > sent {
            let mut pipe = redis::pipe();
            for i in sent..due {
                pipe.cmd("XADD")
                    .arg(stream)
                    .arg("*")
                    .arg("body")
                    .arg(order_body(i))
                    .ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
            sent = due;
        }
    }
    Ok(())
}
