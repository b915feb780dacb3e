//! `make bench`: the worker's throughput, CPU cost, latency and memory against real PostgreSQL,
//! Redis and the other brokers (SQS on ElasticMQ, …), next to the raw limits of each server, in
//! one run (see docs/PERFORMANCE.md). The rooms: `measure` (CPU, memory, latency), `table`
//! (medians, ratios, verdicts), `raw` (the database limit), `redis_stream` (the Redis phases),
//! `broker` (every other broker's phases, one file each), `traced` (the cost of trace
//! context); this file runs the rounds.
//!
//! Every phase runs `--repeats` times (3), in rounds (every phase once, then again): the Redis
//! and database rounds first, then each other broker's rounds with its server the only broker
//! server running. The table shows the median of each figure with its spread (min–max), so
//! one noisy run does not decide. Every phase gets a fresh database and a fresh stream, list
//! or queue, and checks its own result: every entry stored exactly once and nothing left
//! pending, or the bench fails.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::{Parser, ValueEnum};
use nix::sys::signal::Signal;
use switchboard_store::Store;
use switchboard_tests::otel::Collector;
use switchboard_tests::servers::Postgres;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::{WorkerEnv, WorkerProcess};
use switchboard_tests::{Fixture, adapter_manifest, migrate_before};

use amqp::{AmqpArgs, AmqpBench};
use kafka::{KafkaArgs, KafkaBench};
use measure::{CpuSnapshot, CpuSpent, Latency, Measurement, StoreUse, cpu_ticks, load_average};
use measure::{machine_summary, server_cpu_ticks, status_kib, ticks_to_duration};
use nats::{NatsArgs, NatsBench};
use raw::{KeyTime, RawMethod};
use sqs::{SqsArgs, SqsBench};
use table::{Stat, Table, print_efficiency, print_table, verdict};

mod amqp;
mod broker;
mod growth;
mod idle;
mod kafka;
mod measure;
mod nats;
mod raw;
mod redis_stream;
mod sqs;
mod table;
mod traced;

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
    /// A setting of the bench's PostgreSQL, after its own (for experiments; printed first).
    #[arg(long = "postgres-setting", value_name = "NAME=VALUE", value_parser = setting)]
    postgres_settings: Vec<(String, String)>,
    #[command(flatten)]
    sqs: SqsArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    amqp: AmqpArgs,
    #[command(flatten)]
    kafka: KafkaArgs,
    #[command(flatten)]
    idle: idle::IdleArgs,
    #[command(flatten)]
    traced: traced::TraceArgs,
    #[command(flatten)]
    growth: growth::GrowthArgs,
}

/// How long any one phase may take before the bench gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);
/// The batch statement's PostgreSQL CPU per message at most this many times a `COPY`'s.
const STATEMENT_COST_TARGET: f64 = 1.5;

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
                let left = fx.unacknowledged_items(key)?;
                ensure!(
                    left == 0,
                    "{left} items left in {key} or its processing lists"
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
        // Commit timestamps give the latency run the exact commit time of every row. Shared
        // buffers as a production server is sized (PostgreSQL's documentation starts at a
        // quarter of the memory; the default 128 MB is for a laptop): the growth row's indexes
        // are gigabytes. WAL as a server with random keys needs it: checkpoints by time, not
        // forced by the default 1 GB of WAL (after each checkpoint the first change to a page
        // writes the whole page to the WAL; random keys change a new index page per insert).
        // No autovacuum: it visits a phase's database at a moment of its own choosing (every
        // minute, one database at a time) and spent up to 1 s of CPU in one phase — 10 µs
        // per message over 100,000 — so it landed on whichever phase it hit. The worker and
        // the raw database path write the same rows, so it would cost both the same; the
        // growth row analyzes its filled tables itself.
        let shared_buffers = format!(
            "{}MB",
            measure::memory_total_kib().map_or(128, |kib| kib / 4 / 1024)
        );
        let mut settings = vec![
            ("fsync", "on"),
            ("synchronous_commit", "on"),
            ("full_page_writes", "on"),
            ("track_commit_timestamp", "on"),
            ("shared_buffers", &shared_buffers),
            ("max_wal_size", "8GB"),
            ("autovacuum", "off"),
        ];
        for (name, value) in &args.postgres_settings {
            println!("PostgreSQL: {name} = {value} (--postgres-setting)");
            settings.push((name, value));
        }
        let postgres = Postgres::start_with(&settings)?;
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
        let database = self.new_database(connections).await?;
        database.store.migrate().await?;
        sqlx::query("CHECKPOINT").execute(self.fx.pool()).await?;
        Ok(database)
    }

    /// A fresh database migrated only up to (not including) migration `version`: the layout of
    /// an earlier release.
    async fn fresh_database_before(
        &mut self,
        version: i64,
        connections: u32,
    ) -> Result<PhaseDatabase> {
        let database = self.new_database(connections).await?;
        migrate_before(database.store.pool(), version).await?;
        Ok(database)
    }

    /// A new empty database and a store of `connections` on it.
    async fn new_database(&mut self, connections: u32) -> Result<PhaseDatabase> {
        self.databases_created += 1;
        let name = format!("bench_{}", self.databases_created);
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(self.fx.pool())
            .await?;
        let url = self.fx.postgres.url_for(&name);
        let store = Store::connect(&url, connections, "switchboard-bench").await?;
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
        extra_env: &[(&str, &str)],
    ) -> Result<WorkerProcess> {
        self.start_worker_with(database, mode, name, batch_size, "", extra_env)
    }

    /// [`Bench::start_worker`] with `payload` as the body of `spec.payload`.
    fn start_worker_with(
        &self,
        database: &PhaseDatabase,
        mode: Mode,
        name: &str,
        batch_size: usize,
        payload: &str,
        extra_env: &[(&str, &str)],
    ) -> Result<WorkerProcess> {
        let manifest = self.fx.manifest(
            &format!("{name}.yaml"),
            &adapter_manifest(
                name,
                &mode.source(name),
                &format!("batchSize: {batch_size}"),
                payload,
            ),
        )?;
        WorkerProcess::start_binary(
            &self.args.worker,
            &self.worker_env(database),
            &manifest,
            "bench",
            extra_env,
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
        let label = format!("worker {} batchSize {batch_size}", mode.as_str());
        let preload = |fx: &Fixture, key: &str| mode.preload(fx, key, (0..entries).map(order_body));
        self.drain(
            Drain {
                mode,
                name,
                label,
                batch_size,
                entries,
            },
            preload,
            &[],
        )
        .await
    }

    /// Preloads `drain.entries` messages with `preload`, then measures the worker (run with
    /// `extra_env`) draining them: time, CPU, peak RSS; checks each was stored once.
    async fn drain(
        &mut self,
        drain: Drain,
        preload: impl FnOnce(&Fixture, &str) -> Result<()>,
        extra_env: &[(&str, &str)],
    ) -> Result<Measurement> {
        let Drain {
            mode,
            name,
            label,
            batch_size,
            entries,
        } = drain;
        let database = self.fresh_database(4).await?;
        preload(&self.fx, &name)?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let worker = self.start_worker(&database, mode, &name, batch_size, extra_env)?;
        let measurement = self
            .measure_worker(worker, &name, label, entries, (before, started))
            .await?;
        ensure_stored_once(&database.store, &name, entries).await?;
        mode.ensure_drained(&self.fx, &name)?;
        self.drop_database(database).await?;
        Ok(measurement)
    }

    /// Waits until `worker` (adapter `test/{name}`) has acknowledged `entries` messages, stops
    /// it, and measures it from `since` (the CPU counters and the time it started at).
    async fn measure_worker(
        &self,
        worker: WorkerProcess,
        name: &str,
        label: String,
        entries: usize,
        since: (CpuSnapshot, Instant),
    ) -> Result<Measurement> {
        let (before, started) = since;
        wait_acked(&worker, name, entries).await?;
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, Some(worker.pid()));
        let peak_rss_kib = status_kib(worker.pid(), "VmHWM");
        let store = Some(store_use(&worker, name, elapsed)?);
        stop_worker(worker)?;
        Ok(Measurement {
            name: label,
            messages: entries,
            elapsed,
            cpu,
            peak_rss_kib,
            store,
        })
    }
}

/// One worker run of [`Bench::drain`]: the mode and key read, the row's label, the batch size
/// and how many messages are preloaded.
struct Drain {
    mode: Mode,
    name: String,
    label: String,
    batch_size: usize,
    entries: usize,
}

async fn todo_count(store: &Store, queue: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM todos WHERE queue = $1")
            .bind(queue)
            .fetch_one(store.pool())
            .await?,
    )
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

/// The batches the worker of adapter `test/{name}` has stored in a phase of `elapsed`.
fn store_use(worker: &WorkerProcess, name: &str, elapsed: Duration) -> Result<StoreUse> {
    let metric =
        |series: &str| worker.metric(&format!(r#"switchboard_{series}{{adapter="test/{name}"}}"#));
    Ok(StoreUse {
        share: metric("commit_duration_seconds_sum")? / elapsed.as_secs_f64(),
        mean_batch: metric("batch_size_sum")? / metric("batch_size_count")?.max(1.0),
    })
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
        self.amqp.print_client_comparison(table);
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
                    .raw_database(method, count, (entries, batch_size), KeyTime::Broker)
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
        let before = bench
            .raw_database_reference((entries, batch_size), KeyTime::Broker)
            .await?;
        let worker = bench.worker_throughput(mode, batch_size, entries).await?;
        let after = bench
            .raw_database_reference((entries, batch_size), KeyTime::Broker)
            .await?;
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
    // Kafka and ElasticMQ as production servers run: the tests' C1-only JIT starts them faster
    // and costs more CPU per message.
    switchboard_tests::servers::jvm_full_jit();
    let started = Instant::now();
    let mut brokers = Brokers::new(&args);
    let mut bench = Bench::start(args).await?;
    bench.ensure_disk_for_growth()?;
    let repeats = bench.args.repeats;
    let mut table = Table::default();
    if bench.args.growth.growth_only {
        bench.growth().await?;
        println!("bench took {:.0} s", started.elapsed().as_secs_f64());
        return Ok(());
    }
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
    let collector = (bench.args.traced.trace_messages > 0)
        .then(|| Collector::start(&bench.fx))
        .transpose()?;
    if let Some(collector) = &collector {
        for number in 1..=repeats {
            eprintln!("trace-context round {number} of {repeats}");
            bench.round = number;
            bench.trace_rounds(collector, &mut table).await?;
        }
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
    print_statement_cost(&table, &args.connections)?;
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
    let raw_stream = table
        .best("raw broker ")
        .context("no raw Redis stream run")?;
    print_efficiency("stream", stream, raw_stream, stream_raw_db, true);
    println!(
        "stream batch {batch_size} / {} (1/3, retired verdict): {:>20}%  target >= 75%    {}",
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
    if collector.is_some() {
        traced::print_verdicts(&table)?;
    }
    bench.growth().await?;
    let idle = bench.args.idle.clone();
    bench.idle_cost(&idle, &mut brokers).await?;
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

/// The batch statement's PostgreSQL CPU per message over a plain `COPY`'s, both into empty
/// tables with the most connections measured: a change of the statement (a plan that loops
/// over the batch, a lookup too many) shows here whatever the machine's speed. 1.1-1.2 with
/// migrations 0010 and 0012; 2.1-2.6 with 0011, whose joins grew with the square of the batch.
fn print_statement_cost(table: &Table, connections: &[usize]) -> Result<()> {
    let most = connections.iter().max().context("no --connections")?;
    let statement = table.row(&format!("raw DB worker SQL x{most}"))?;
    let copy = table.row(&format!("raw DB COPY+staging x{most}"))?;
    let cost = statement.postgres_ratio_to(copy);
    println!(
        "PostgreSQL CPU per message, batch statement / COPY+staging (x{most}): {:>16}x  \
         target <= {STATEMENT_COST_TARGET}x  {}",
        cost.show(2, 1.0),
        verdict(cost.median <= STATEMENT_COST_TARGET)
    );
    Ok(())
}

/// `NAME=VALUE` of `--postgres-setting`.
fn setting(text: &str) -> Result<(String, String), String> {
    let (name, value) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected NAME=VALUE"))?;
    Ok((name.trim().to_owned(), value.trim().to_owned()))
}
