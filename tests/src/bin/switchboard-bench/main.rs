//! `make bench`: the worker's throughput, CPU cost, latency and memory against real PostgreSQL,
//! Redis and the other brokers (SQS on ElasticMQ, …), next to the raw limits of each server, in
//! one run (see docs/PERFORMANCE.md; every other broker's phases are in `broker.rs`).
//!
//! Every phase runs `--repeats` times (3), in rounds (every phase once, then again): the Redis
//! and database rounds first, then each other broker's rounds with its server the only broker
//! server running. The table shows the median of each figure with its spread (min–max), so
//! one noisy run does not decide. Every phase gets a fresh database and a fresh stream, list
//! or queue, and checks its own result: every entry stored exactly once and nothing left
//! pending, or the bench fails.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use clap::{Parser, ValueEnum};
use nix::sys::signal::Signal;
use sqlx::{Connection, PgConnection};
use switchboard_store::{Dedup, IngestBatch, NewEvent, Position, Store, Stored};
use switchboard_tests::servers::{Postgres, children_of};
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerEnv, WorkerProcess};
use switchboard_tests::{Fixture, adapter_manifest};
use tokio::task::JoinSet;

use amqp::{AmqpArgs, AmqpBench};
use kafka::{KafkaArgs, KafkaBench};
use nats::{NatsArgs, NatsBench};
use sqs::{SqsArgs, SqsBench};

mod amqp;
mod broker;
mod kafka;
mod nats;
mod sqs;

/// Measures the worker end to end and the raw limits of PostgreSQL and Redis.
#[derive(Debug, Parser)]
#[command(name = "switchboard-bench")]
struct Args {
    /// The worker binary to measure (a release build).
    #[arg(long)]
    worker: PathBuf,
    /// Entries preloaded for the batched worker runs and the raw limits.
    #[arg(long, default_value_t = 200_000)]
    entries: usize,
    /// Entries for the batchSize-1 run (one transaction per message, so slow).
    #[arg(long, default_value_t = 20_000)]
    naive_entries: usize,
    /// The worker's delivery.batchSize, and the batch of the raw loops.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Offered rate of the latency run, messages per second.
    #[arg(long, default_value_t = 2_000)]
    rate: u64,
    /// Length of the latency run, seconds.
    #[arg(long, default_value_t = 30)]
    latency_seconds: u64,
    /// Connection counts tried for the raw database limit.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    connections: Vec<usize>,
    /// Broker modes run end to end (the first is the reference for the ratios).
    #[arg(long, value_delimiter = ',', default_value = "stream,list")]
    modes: Vec<Mode>,
    /// Batches in flight tried in the model of the worker's loop.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    depths: Vec<usize>,
    /// How many times every phase runs; the table shows the median and the spread (min–max).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[command(flatten)]
    sqs: SqsArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    amqp: AmqpArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
}

/// How long any one phase may take before the bench gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);

/// `/proc` reports CPU times in USER_HZ ticks, which Linux fixes at 100 per second.
const USER_HZ: u64 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Stream,
    List,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Stream => "stream",
            Mode::List => "list",
        }
    }

    /// The body of `spec.source.redis` reading `key`.
    fn source(self, key: &str) -> String {
        let mode = self.as_str();
        format!("mode: {mode}, {mode}: {key}")
    }

    /// XADDs (stream) or LPUSHes (list) one message per body.
    fn preload(self, fx: &Fixture, key: &str, bodies: impl Iterator<Item = Vec<u8>>) -> Result<()> {
        match self {
            Mode::Stream => fx.produce(key, bodies).map(drop),
            Mode::List => fx.push(key, bodies),
        }
    }

    /// Fails unless the broker holds nothing undelivered or unacknowledged for `key`.
    fn ensure_drained(self, fx: &Fixture, key: &str) -> Result<()> {
        match self {
            Mode::Stream => {
                let pending = fx.pending(key, "switchboard")?;
                ensure!(pending == 0, "{pending} entries of {key} still pending");
            }
            Mode::List => {
                let left = fx.llen(key)?;
                let processing = fx.processing_items(key)?;
                ensure!(
                    left == 0 && processing == 0,
                    "{left} items left in {key}, {processing} in its processing lists"
                );
            }
        }
        Ok(())
    }
}

/// A small order as JSON, unique per `i` (list mode deduplicates on the body hash).
fn order_body(i: usize) -> Vec<u8> {
    format!(
        r#"{{"order":{i},"customer":"customer-{}","amount_cents":{},"currency":"EUR","items":[{{"sku":"sku-{}","qty":{}}}],"note":"benchmark order"}}"#,
        i % 997,
        100 + i % 10_000,
        i % 101,
        1 + i % 5
    )
    .into_bytes()
}

/// CPU ticks of `pid` (user + system), plus those of its reaped children when asked.
fn cpu_ticks(pid: u32, with_reaped_children: bool) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let Some((_, after_name)) = stat.rsplit_once(')') else {
        return 0;
    };
    // Fields after the command name start at field 3 (state); utime is field 14.
    let fields: Vec<u64> = after_name
        .split_whitespace()
        .skip(11)
        .take(4)
        .map(|field| field.parse().unwrap_or(0))
        .collect();
    let own: u64 = fields.iter().take(2).sum();
    let reaped: u64 = fields.iter().skip(2).sum();
    if with_reaped_children {
        own + reaped
    } else {
        own
    }
}

/// CPU ticks of a server and everything it forked (PostgreSQL: postmaster and backends,
/// including backends that have exited since).
fn server_cpu_ticks(pid: u32) -> u64 {
    let children = i32::try_from(pid).map(children_of).unwrap_or_default();
    cpu_ticks(pid, true)
        + children
            .into_iter()
            .filter_map(|child| u32::try_from(child).ok())
            .map(|child| cpu_ticks(child, false))
            .sum::<u64>()
}

fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_millis(ticks * 1000 / USER_HZ)
}

/// A line `Name: value kB` of `/proc/PID/status`, in KiB.
fn status_kib(pid: u32, name: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// CPU time spent, per side.
#[derive(Debug, Clone, Copy, Default)]
struct CpuSpent {
    /// The worker process, or the bench itself in the raw loops.
    client: Duration,
    postgres: Duration,
    redis: Duration,
    /// The server of the broker being measured beside Redis (ElasticMQ's JVM, …), the only
    /// broker server running.
    broker: Duration,
}

/// One line of the table.
#[derive(Debug, Clone)]
struct Measurement {
    name: String,
    messages: usize,
    elapsed: Duration,
    cpu: CpuSpent,
    peak_rss_kib: Option<u64>,
    /// The share of the wall time the worker spent in `ingest_batch`.
    store_share: Option<f64>,
}

impl Measurement {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }

    fn micros_per_message(&self, spent: Duration) -> f64 {
        spent.as_secs_f64() * 1e6 / self.messages as f64
    }

    /// This raw database run and `after`, one run each side of the worker phase of `kind` at
    /// `batch_size`, as one row (`<kind>: raw DB …`): their messages, time and CPU added up.
    fn around(&self, after: &Measurement, kind: &str, batch_size: usize) -> Measurement {
        Measurement {
            name: format!("{kind}: {} batch {batch_size}", self.name),
            messages: self.messages + after.messages,
            elapsed: self.elapsed + after.elapsed,
            cpu: CpuSpent {
                client: self.cpu.client + after.cpu.client,
                postgres: self.cpu.postgres + after.cpu.postgres,
                redis: self.cpu.redis + after.cpu.redis,
                broker: self.cpu.broker + after.cpu.broker,
            },
            peak_rss_kib: None,
            store_share: None,
        }
    }
}

/// Commit latency percentiles of the steady-load run.
#[derive(Debug, Clone, Copy)]
struct Latency {
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// CPU counters of both servers and of the bench process, read together.
#[derive(Debug, Clone, Copy)]
struct CpuSnapshot {
    bench: u64,
    postgres: u64,
    redis: u64,
    broker: u64,
}

/// A database of its own for one phase, dropped at the end of the phase.
struct PhaseDatabase {
    name: String,
    url: String,
    store: Store,
}

/// The servers and settings shared by every phase.
struct Bench {
    args: Args,
    fx: Fixture,
    postgres_pid: u32,
    redis_pid: u32,
    /// The server of the broker being measured beside Redis, if one is running.
    broker_pid: Option<u32>,
    databases_created: usize,
    /// The current round (1-based): Redis keys carry it, so no round reuses a stream or group.
    round: usize,
}

impl Bench {
    async fn start(args: Args) -> Result<Self> {
        // Realistic durability: every commit is flushed to disk before it is acknowledged.
        // Commit timestamps give the latency run the exact commit time of every row.
        let postgres = Postgres::start_with(&[
            ("fsync", "on"),
            ("synchronous_commit", "on"),
            ("full_page_writes", "on"),
            ("track_commit_timestamp", "on"),
        ])?;
        let fx = Fixture::start_with(postgres).await?;
        let postgres_pid = fx.postgres.pid().context("postgres is not running")?;
        let redis_pid = fx.redis.pid().context("redis-server is not running")?;
        Ok(Self {
            args,
            fx,
            postgres_pid,
            redis_pid,
            broker_pid: None,
            databases_created: 0,
            round: 0,
        })
    }

    fn cpu_snapshot(&self) -> CpuSnapshot {
        CpuSnapshot {
            bench: cpu_ticks(std::process::id(), false),
            postgres: server_cpu_ticks(self.postgres_pid),
            redis: cpu_ticks(self.redis_pid, false),
            broker: self.broker_pid.map_or(0, |pid| cpu_ticks(pid, false)),
        }
    }

    /// CPU spent since `before`; the client is the worker process when given, else the bench.
    fn cpu_since(&self, before: CpuSnapshot, worker: Option<u32>) -> CpuSpent {
        let now = self.cpu_snapshot();
        let client = match worker {
            Some(pid) => cpu_ticks(pid, false),
            None => now.bench - before.bench,
        };
        CpuSpent {
            client: ticks_to_duration(client),
            postgres: ticks_to_duration(now.postgres - before.postgres),
            redis: ticks_to_duration(now.redis - before.redis),
            broker: ticks_to_duration(now.broker - before.broker),
        }
    }

    /// Creates and migrates a fresh database, after a checkpoint so that no phase inherits
    /// the previous one's dirty pages.
    async fn fresh_database(&mut self, connections: u32) -> Result<PhaseDatabase> {
        self.databases_created += 1;
        let name = format!("bench_{}", self.databases_created);
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(self.fx.pool())
            .await?;
        let url = self.fx.postgres.url_for(&name);
        let store = Store::connect(&url, connections, "switchboard-bench").await?;
        store.migrate().await?;
        sqlx::query("CHECKPOINT").execute(self.fx.pool()).await?;
        Ok(PhaseDatabase { name, url, store })
    }

    async fn drop_database(&self, database: PhaseDatabase) -> Result<()> {
        database.store.pool().close().await;
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", database.name))
            .execute(self.fx.pool())
            .await?;
        Ok(())
    }

    fn worker_env(&self, database: &PhaseDatabase) -> WorkerEnv {
        WorkerEnv {
            database_url: database.url.clone(),
            redis_url: self.fx.redis.url(),
            log_dir: self.fx.dir.path().to_path_buf(),
        }
    }

    fn start_worker(
        &self,
        database: &PhaseDatabase,
        mode: Mode,
        name: &str,
        batch_size: usize,
    ) -> Result<WorkerProcess> {
        let manifest = self.fx.manifest(
            &format!("{name}.yaml"),
            &adapter_manifest(
                name,
                &mode.source(name),
                &format!("batchSize: {batch_size}"),
                "",
            ),
        )?;
        WorkerProcess::start_binary(
            &self.args.worker,
            &self.worker_env(database),
            &manifest,
            "bench",
            &[],
        )
    }

    /// Throughput of the worker draining `entries` preloaded messages.
    async fn worker_throughput(
        &mut self,
        mode: Mode,
        batch_size: usize,
        entries: usize,
    ) -> Result<Measurement> {
        let name = format!("{}-batch{batch_size}-r{}", mode.as_str(), self.round);
        let database = self.fresh_database(4).await?;
        mode.preload(&self.fx, &name, (0..entries).map(order_body))?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let worker = self.start_worker(&database, mode, &name, batch_size)?;
        wait_acked(&worker, &name, entries).await?;
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, Some(worker.pid()));
        let peak_rss_kib = status_kib(worker.pid(), "VmHWM");
        let store_share = Some(seconds_in_store(&worker, &name)? / elapsed.as_secs_f64());
        stop_worker(worker)?;
        ensure_stored_once(&database.store, &name, entries).await?;
        mode.ensure_drained(&self.fx, &name)?;
        self.drop_database(database).await?;
        Ok(Measurement {
            name: format!("worker {} batchSize {batch_size}", mode.as_str()),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib,
            store_share,
        })
    }

    /// Offers `rate` stream entries per second for `latency_seconds` to a running worker and
    /// reads each row's commit time from PostgreSQL's commit timestamps.
    async fn latency_under_load(&mut self) -> Result<(Measurement, Latency)> {
        let name = &format!("stream-latency-r{}", self.round);
        let (rate, seconds) = (self.args.rate, self.args.latency_seconds);
        let total = usize::try_from(rate * seconds)?;
        let database = self.fresh_database(4).await?;
        let worker = self.start_worker(&database, Mode::Stream, name, self.args.batch_size)?;
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
        let store_share = Some(seconds_in_store(&worker, name)? / elapsed.as_secs_f64());
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
                store_share,
            },
            Latency {
                p50_ms,
                p99_ms,
                max_ms,
            },
        ))
    }

    /// XREADGROUP COUNT batch + XACK of `entries` preloaded entries, no database.
    async fn raw_broker(&mut self) -> Result<Measurement> {
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
            store_share: None,
        })
    }

    /// An async connection, with the group `switchboard` created at the start of `key`.
    async fn group_connection(&self, key: &str) -> Result<redis::aio::MultiplexedConnection> {
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
    async fn pipelined_ceiling(&mut self, depth: usize) -> Result<Measurement> {
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
            store_share: None,
        })
    }

    /// The raw database limit a worker phase is held against, measured right before and right
    /// after it: the worker's SQL on the most `--connections`, `rows` = (as many rows as the
    /// worker gets messages, in batches of the worker's size). This VM's speed drifts by tens
    /// of percent within a round, so the worker is compared with the limit of the same moment:
    /// both runs together, which a steady drift moves as much as the worker.
    async fn raw_database_reference(&mut self, rows: (usize, usize)) -> Result<Measurement> {
        let connections = self.args.connections.iter().copied().max().unwrap_or(1);
        self.raw_database(RawMethod::WorkerSql, connections, rows)
            .await
    }

    /// `entries` rows like those the worker stores, with no broker: `connections` loops pulling
    /// batches of `batch_size`.
    async fn raw_database(
        &mut self,
        method: RawMethod,
        connections: usize,
        (entries, batch_size): (usize, usize),
    ) -> Result<Measurement> {
        let rows = Arc::new(RawRows::new(entries, batch_size));
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
            name: format!("raw DB {} x{connections}", method.as_str()),
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store_share: None,
        })
    }
}

async fn todo_count(store: &Store, queue: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1")
            .bind(queue)
            .fetch_one(store.pool())
            .await?,
    )
}

/// XREADGROUP of up to `count` new entries of `key` for consumer `bench`, without blocking.
async fn read_group_batch(
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

async fn acknowledge(
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
fn stream_event(name: &str, entry: &redis::streams::StreamId) -> Result<NewEvent> {
    let body: Vec<u8> = entry.get("body").context("entry has no body field")?;
    serde_json::from_slice::<serde::de::IgnoredAny>(&body).context("body is not JSON")?;
    Ok(NewEvent {
        idempotency_key: format!("redis:test/{name}:{}", entry.id),
        external_id: entry.id.clone(),
        payload: String::from_utf8(body)?,
        headers: "{}".to_owned(),
    })
}

/// The stream position (`[ms, seq]`) of an entry id.
fn entry_position(id: &str) -> Option<Position> {
    let (ms, seq) = id.split_once('-')?;
    Some(stream_position(ms.parse().ok()?, seq.parse().ok()?))
}

fn stream_position(ms: i64, seq: i64) -> Position {
    Position {
        partition: String::new(),
        value: vec![ms, seq],
    }
}

/// Waits until the worker has acknowledged `expected` messages of adapter `test/{name}`.
async fn wait_acked(worker: &WorkerProcess, name: &str, expected: usize) -> Result<()> {
    let metric = format!(r#"switchboard_messages_acked_total{{adapter="test/{name}"}}"#);
    let expected = expected as f64;
    wait_for(
        PHASE_TIMEOUT,
        &format!("the worker acked {expected} messages"),
        || async { Ok(worker.metric(&metric)? >= expected) },
    )
    .await
    .with_context(|| worker.log_tail())
}

/// Seconds the worker of adapter `test/{name}` has spent storing batches.
fn seconds_in_store(worker: &WorkerProcess, name: &str) -> Result<f64> {
    worker.metric(&format!(
        r#"switchboard_commit_duration_seconds_sum{{adapter="test/{name}"}}"#
    ))
}

/// SIGTERM, and a clean exit.
fn stop_worker(mut worker: WorkerProcess) -> Result<()> {
    worker.signal(Signal::SIGTERM)?;
    let status = worker.wait_exit(Duration::from_secs(30))?;
    ensure!(
        status.success(),
        "worker exited with {status}\n{}",
        worker.log_tail()
    );
    Ok(())
}

/// Fails unless `queue` holds exactly `expected` todos with distinct keys, one event each.
async fn ensure_stored_once(store: &Store, queue: &str, expected: usize) -> Result<()> {
    let (todos, keys, events): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM todos WHERE queue = $1), \
                (SELECT count(DISTINCT idempotency_key) FROM todos WHERE queue = $1), \
                (SELECT count(*) FROM events)",
    )
    .bind(queue)
    .fetch_one(store.pool())
    .await?;
    let expected = i64::try_from(expected)?;
    ensure!(
        todos == expected && keys == expected && events == expected,
        "{queue}: expected {expected} todos, distinct keys and events; \
         found {todos} todos, {keys} distinct keys, {events} events"
    );
    Ok(())
}

/// XADDs `total` entries to `stream` at `rate` per second, on a timer.
async fn offer_steady_load(redis_url: &str, stream: &str, rate: u64, total: usize) -> Result<()> {
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

const RAW_SOURCE: &str = "redis:test/raw";
const RAW_QUEUE: &str = "raw";

/// How the raw database loop stores a batch.
#[derive(Debug, Clone, Copy)]
enum RawMethod {
    /// `Store::ingest_batch`: the worker's own statement.
    WorkerSql,
    /// COPY into a temporary staging table, then INSERT … SELECT into events and todos.
    CopyStaging,
}

impl RawMethod {
    fn as_str(self) -> &'static str {
        match self {
            RawMethod::WorkerSql => "worker SQL",
            RawMethod::CopyStaging => "COPY+staging",
        }
    }
}

/// The rows the worker would build for a stream of `order_body` entries, handed out in
/// batches to concurrent loops.
struct RawRows {
    first_ms: u64,
    events: Vec<NewEvent>,
    batch_size: usize,
    next_batch: AtomicUsize,
}

impl RawRows {
    fn new(entries: usize, batch_size: usize) -> Self {
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
    fn take_batch(&self) -> Option<Range<usize>> {
        let start = self.next_batch.fetch_add(1, Ordering::Relaxed) * self.batch_size;
        (start < self.events.len()).then(|| start..(start + self.batch_size).min(self.events.len()))
    }

    /// The stream position (`ms`, `seq`) of the last row in `batch`.
    fn checkpoint(&self, batch: &Range<usize>) -> (i64, i64) {
        (
            i64::try_from(self.first_ms).unwrap_or(i64::MAX),
            i64::try_from(batch.end).unwrap_or(i64::MAX) - 1,
        )
    }
}

async fn ingest_loop(store: &Store, rows: &RawRows) -> Result<()> {
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

/// Inserts the staged batch like the worker's statement does (dedup, todos for new events,
/// checkpoint), without returning per-row outcomes.
const STAGED_INGEST_SQL: &str = r#"
WITH new_events AS (
    INSERT INTO events (source, external_id, payload, headers)
    SELECT $1, external_id, payload, headers FROM staging ORDER BY ord
    ON CONFLICT (source, external_id) DO NOTHING
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

async fn copy_loop(url: &str, rows: &RawRows) -> Result<()> {
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
fn push_copy_text(out: &mut Vec<u8>, value: &str) {
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

fn machine_summary() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map(|(_, model)| model.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let memory_gib = memory_total_kib().unwrap_or(0) as f64 / 1024.0 / 1024.0;
    format!("{cpus} CPUs ({model}), {memory_gib:.1} GiB RAM")
}

fn memory_total_kib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|load| {
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// The median and the spread of one figure over the repetitions.
#[derive(Debug, Clone, Copy)]
struct Stat {
    median: f64,
    min: f64,
    max: f64,
}

impl Stat {
    fn of(mut values: Vec<f64>) -> Self {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let median = match n {
            0 => f64::NAN,
            _ if n % 2 == 1 => values[n / 2],
            _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
        };
        Self {
            median,
            min: values.first().copied().unwrap_or(f64::NAN),
            max: values.last().copied().unwrap_or(f64::NAN),
        }
    }

    /// `median (min–max)` with `decimals` decimals, scaled by `scale` (e.g. 100 for percent).
    fn show(self, decimals: usize, scale: f64) -> String {
        format!(
            "{:.decimals$} ({:.decimals$}–{:.decimals$})",
            self.median * scale,
            self.min * scale,
            self.max * scale
        )
    }
}

/// Every repetition of one phase.
#[derive(Debug, Clone)]
struct Row {
    runs: Vec<Measurement>,
}

impl Row {
    fn name(&self) -> &str {
        &self.runs[0].name
    }

    fn stat(&self, figure: impl Fn(&Measurement) -> f64) -> Stat {
        Stat::of(self.runs.iter().map(figure).collect())
    }

    fn rate(&self) -> Stat {
        self.stat(Measurement::rate)
    }

    /// This row's rate over the slower of `a` and `b`, per round.
    fn ratio_to_slower(&self, a: &Row, b: &Row) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(a.runs.iter().zip(&b.runs))
                .map(|(m, (a, b))| m.rate() / a.rate().min(b.rate()))
                .collect(),
        )
    }

    /// This row's rate over `other`'s, per round (the same round ran both).
    fn ratio_to(&self, other: &Row) -> Stat {
        Stat::of(
            self.runs
                .iter()
                .zip(&other.runs)
                .map(|(a, b)| a.rate() / b.rate())
                .collect(),
        )
    }
}

/// The rows in the order the first round ran them.
#[derive(Debug, Default)]
struct Table {
    rows: Vec<Row>,
}

impl Table {
    fn add(&mut self, measurement: Measurement) {
        eprintln!(
            "{}: {:.0} msg/s ({:.2} s)",
            measurement.name,
            measurement.rate(),
            measurement.elapsed.as_secs_f64()
        );
        match self
            .rows
            .iter_mut()
            .find(|row| row.name() == measurement.name)
        {
            Some(row) => row.runs.push(measurement),
            None => self.rows.push(Row {
                runs: vec![measurement],
            }),
        }
    }

    fn row(&self, name: &str) -> Result<&Row> {
        self.rows
            .iter()
            .find(|row| row.name() == name)
            .with_context(|| format!("no phase {name:?} was measured"))
    }

    /// The raw database limit measured around the worker phase of `kind`.
    fn raw_db_around(&self, kind: &str) -> Result<&Row> {
        let prefix = format!("{kind}: raw DB ");
        self.rows
            .iter()
            .find(|row| row.name().starts_with(&prefix))
            .with_context(|| format!("no raw database run around the {kind} worker"))
    }

    /// The row with the best median rate among those whose name starts with `prefix`.
    fn best(&self, prefix: &str) -> Option<&Row> {
        self.rows
            .iter()
            .filter(|row| row.name().starts_with(prefix))
            .max_by(|a, b| a.rate().median.total_cmp(&b.rate().median))
    }
}

fn print_table(table: &Table) {
    println!(
        "| {:<44} | {:>8} | {:>7} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} |",
        "phase",
        "messages",
        "seconds",
        "msg/s (min–max)",
        "client µs/msg",
        "postgres µs/msg",
        "redis µs/msg",
        "broker µs/msg",
        "peak RSS",
        "in store"
    );
    println!(
        "|{:-<46}|{:->10}|{:->9}|{:->25}|{:->19}|{:->22}|{:->16}|{:->18}|{:->10}|{:->10}|",
        "", "", "", "", "", "", "", "", "", ""
    );
    for row in &table.rows {
        let per_message = |side: fn(&CpuSpent) -> Duration| {
            row.stat(|m| m.micros_per_message(side(&m.cpu)))
                .show(1, 1.0)
        };
        let rss = if row.runs.iter().all(|m| m.peak_rss_kib.is_some()) {
            format!(
                "{:.1} MiB",
                row.stat(|m| m.peak_rss_kib.unwrap_or(0) as f64).median / 1024.0
            )
        } else {
            "-".to_owned()
        };
        let store_share = if row.runs.iter().all(|m| m.store_share.is_some()) {
            format!(
                "{:.0}%",
                row.stat(|m| m.store_share.unwrap_or(0.0)).median * 100.0
            )
        } else {
            "-".to_owned()
        };
        println!(
            "| {:<44} | {:>8} | {:>7.2} | {:>23} | {:>17} | {:>20} | {:>14} | {:>16} | {:>8} | {:>8} |",
            row.name(),
            row.runs[0].messages,
            row.stat(|m| m.elapsed.as_secs_f64()).median,
            row.rate().show(0, 1.0),
            per_message(|cpu| cpu.client),
            per_message(|cpu| cpu.postgres),
            per_message(|cpu| cpu.redis),
            per_message(|cpu| cpu.broker),
            rss,
            store_share
        );
    }
}

fn verdict(passed: bool) -> &'static str {
    if passed { "PASS" } else { "FAIL" }
}

/// The brokers measured beside Redis, one field each.
struct Brokers {
    sqs: SqsBench,
    nats: NatsBench,
    amqp: AmqpBench,
    kafka: KafkaBench,
}

impl Brokers {
    fn new(args: &Args) -> Self {
        Self {
            sqs: SqsBench::new(args.sqs.clone()),
            nats: NatsBench::new(args.nats.clone()),
            amqp: AmqpBench::new(args.amqp.clone()),
            kafka: KafkaBench::new(args.kafka.clone()),
        }
    }

    /// Each broker's rounds in turn, one broker server running at a time.
    async fn rounds(&mut self, bench: &mut Bench, table: &mut Table) -> Result<()> {
        bench.broker_rounds(&mut self.sqs, table).await?;
        bench.broker_rounds(&mut self.nats, table).await?;
        bench.broker_rounds(&mut self.amqp, table).await?;
        bench.broker_rounds(&mut self.kafka, table).await
    }

    fn print_verdicts(&self, table: &Table) -> Result<()> {
        broker::print_broker_verdict(&self.sqs, table)?;
        broker::print_broker_verdict(&self.nats, table)?;
        broker::print_broker_verdict(&self.amqp, table)?;
        broker::print_broker_verdict(&self.kafka, table)
    }
}

/// One round of the Redis and database phases: every phase once, in this order.
async fn round(bench: &mut Bench, table: &mut Table, latencies: &mut Vec<Latency>) -> Result<()> {
    let args = &bench.args;
    let (batch_size, naive_entries, entries, modes) = (
        args.batch_size,
        args.naive_entries,
        args.entries,
        args.modes.clone(),
    );
    let (connections, depths) = (args.connections.clone(), args.depths.clone());

    table.add(bench.raw_broker().await?);
    for method in [RawMethod::WorkerSql, RawMethod::CopyStaging] {
        for &count in &connections {
            table.add(
                bench
                    .raw_database(method, count, (entries, batch_size))
                    .await?,
            );
        }
    }
    for &depth in &depths {
        table.add(bench.pipelined_ceiling(depth).await?);
    }
    for &mode in &modes {
        if mode != Mode::Stream {
            table.add(bench.worker_throughput(mode, batch_size, entries).await?);
            continue;
        }
        // The stream verdict's worker, between two runs of its raw database limit.
        let before = bench.raw_database_reference((entries, batch_size)).await?;
        let worker = bench.worker_throughput(mode, batch_size, entries).await?;
        let after = bench.raw_database_reference((entries, batch_size)).await?;
        table.add(before.around(&after, mode.as_str(), batch_size));
        table.add(worker);
    }
    table.add(
        bench
            .worker_throughput(Mode::Stream, 1, naive_entries)
            .await?,
    );
    let (steady, latency) = bench.latency_under_load().await?;
    eprintln!(
        "latency p50/p99/max: {:.0}/{:.1}/{:.0} ms",
        latency.p50_ms, latency.p99_ms, latency.max_ms
    );
    table.add(steady);
    latencies.push(latency);
    Ok(())
}

async fn run(args: Args) -> Result<()> {
    println!("machine: {}", machine_summary());
    println!("load average before: {}", load_average());
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    let started = Instant::now();
    let mut brokers = Brokers::new(&args);
    let mut bench = Bench::start(args).await?;
    let repeats = bench.args.repeats;
    let mut table = Table::default();
    let mut latencies = Vec::new();
    for number in 1..=repeats {
        let round_started = Instant::now();
        eprintln!("round {number} of {repeats}");
        bench.round = number;
        round(&mut bench, &mut table, &mut latencies).await?;
        eprintln!(
            "round {number} took {:.0} s; load average {}",
            round_started.elapsed().as_secs_f64(),
            load_average()
        );
    }
    brokers.rounds(&mut bench, &mut table).await?;
    let args = &bench.args;
    let batch_size = args.batch_size;

    println!();
    println!(
        "median of {repeats} rounds (min–max); CPU columns are µs of CPU per message; \
         ratios are per round, median (min–max)"
    );
    println!();
    print_table(&table);
    println!();
    let p50 = Stat::of(latencies.iter().map(|l| l.p50_ms).collect());
    let p99 = Stat::of(latencies.iter().map(|l| l.p99_ms).collect());
    let max = Stat::of(latencies.iter().map(|l| l.max_ms).collect());
    println!(
        "latency at {} msg/s offered for {} s (XADD entry-id time → commit timestamp of the row): \
         p50 {} ms, p99 {} ms, max {} ms",
        args.rate,
        args.latency_seconds,
        p50.show(1, 1.0),
        p99.show(1, 1.0),
        max.show(0, 1.0)
    );
    let raw_db = table.best("raw DB ").context("no raw database run")?;
    println!(
        "raw database limit: {} ({} msg/s)",
        raw_db.name(),
        raw_db.rate().show(0, 1.0)
    );
    println!();
    let stream = table.row(&format!("worker stream batchSize {batch_size}"))?;
    let naive = table.row("worker stream batchSize 1")?;
    let vs_naive = stream.ratio_to(naive);
    let stream_raw_db = table.raw_db_around(Mode::Stream.as_str())?;
    let vs_raw = stream.ratio_to(stream_raw_db);
    let peak_rss_mib = table
        .rows
        .iter()
        .flat_map(|row| &row.runs)
        .filter_map(|m| m.peak_rss_kib)
        .max()
        .unwrap_or(0) as f64
        / 1024.0;
    println!(
        "stream batch {batch_size} / batch 1 (1/2):  {:>20}x  target >= 4x     {}",
        vs_naive.show(2, 1.0),
        verdict(vs_naive.median >= 4.0)
    );
    println!(
        "stream batch {batch_size} / {} (1/3): {:>20}%  target >= 75%    {}",
        stream_raw_db.name(),
        vs_raw.show(1, 100.0),
        verdict(vs_raw.median >= 0.75)
    );
    println!(
        "p99 latency at {} msg/s:      {:>20} ms target <= 50 ms  {}",
        args.rate,
        p99.show(1, 1.0),
        verdict(p99.median <= 50.0)
    );
    println!(
        "worker peak RSS (max of runs):   {peak_rss_mib:>20.1} MiB target <= 64 MiB {}",
        verdict(peak_rss_mib <= 64.0)
    );
    match table.row(&format!("worker list batchSize {batch_size}")) {
        Ok(list) => {
            let vs_stream = list.ratio_to(stream);
            println!(
                "list / stream:                   {:>20}%  target >= 60%    {}",
                vs_stream.show(1, 100.0),
                verdict(vs_stream.median >= 0.6)
            );
        }
        Err(_) => println!("list / stream: not measured (--modes has no list)"),
    }
    brokers.print_verdicts(&table)?;
    println!();
    println!("correctness: every phase stored each entry exactly once with nothing pending");
    println!(
        "load average after: {}; bench took {:.0} s",
        load_average(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    run(Args::parse()).await
}
