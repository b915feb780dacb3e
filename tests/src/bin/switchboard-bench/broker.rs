//! The brokers measured beside Redis (SQS, and each broker of the family as it joins): every
//! one gets the same phases against its own real server, each from a fresh queue preloaded
//! with the same messages — the raw receive + ack limit of the server (no database), and the
//! worker draining the queue between two runs of the raw database limit — and one verdict line. A broker joins by implementing
//! [`BenchBroker`] in a module of its own and one line in `Brokers`.

use std::time::Instant;

use anyhow::{Context, Result, ensure};

use crate::measure::{Measurement, load_average, status_kib};
use crate::raw::KeyTime;
use crate::table::{Table, print_efficiency, verdict};
use crate::{Bench, PHASE_TIMEOUT, ensure_stored_once};
use crate::{stop_worker, store_use, todo_count, wait_acked};
use switchboard_tests::source_manifest;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;

/// The client library of a raw loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RawClient {
    /// The one the worker uses for the broker.
    Workers,
    /// amqprs, tried against the worker's lapin on RabbitMQ's raw loop: its rows are named
    /// `raw amqprs …`, so the verdicts keep lapin's loop as the raw limit.
    Amqprs,
}

/// `count` raw loops at once, with `client`.
#[derive(Debug, Clone, Copy)]
pub struct RawLoops {
    pub count: usize,
    pub client: RawClient,
}

impl RawLoops {
    /// `count` loops with the worker's client library.
    pub fn workers(count: usize) -> Self {
        Self {
            count,
            client: RawClient::Workers,
        }
    }
}

/// One broker of the family, as the bench drives it.
#[allow(async_fn_in_trait)]
pub trait BenchBroker {
    /// The broker's name in phase names (`sqs`).
    fn kind(&self) -> &'static str;

    /// Messages preloaded for every phase; 0 leaves the broker out.
    fn messages(&self) -> usize;

    /// The worker's `delivery.batchSize`.
    fn batch_size(&self) -> usize;

    /// The raw loops tried: how many run at once, with which client library.
    fn raw_loops(&self) -> Vec<RawLoops>;

    /// The share of the slower of its raw limit and the raw database limit the worker had to
    /// reach (the retired wall-clock verdict, printed beside the new ones for comparison).
    fn target(&self) -> f64;

    /// Whether the worker stores this broker's keys with a broker time: its raw database
    /// reference stores keys of the same kind.
    fn key_time(&self) -> KeyTime {
        KeyTime::Broker
    }

    /// Whether the CPU-efficiency and shared-CPU-ceiling verdicts hold the broker to their
    /// targets (not for a stand-in server whose costs are not a production broker's).
    fn cpu_targets(&self) -> bool {
        true
    }

    /// Starts the broker's server.
    async fn start_server(&mut self) -> Result<()>;

    /// Stops the broker's server.
    fn stop_server(&mut self);

    /// The server's process, whose CPU the table shows.
    fn server_pid(&self) -> Option<u32>;

    /// A fresh queue holding `messages` order bodies (not timed); returns its name.
    async fn fresh_queue(&mut self, messages: usize) -> Result<String>;

    /// The raw limit: `loops.count` concurrent receive + ack loops (no database) until `queue`
    /// is empty; returns how many messages were acknowledged, and the phase's name.
    async fn drain_raw(&self, queue: &str, loops: RawLoops) -> Result<(usize, String)>;

    /// The body of `spec.source` for a worker reading `queue`, and the environment it needs.
    fn worker_source(&self, queue: &str) -> (String, Vec<(&'static str, String)>);

    /// Messages of `queue` not acknowledged yet (waiting or delivered).
    async fn unacknowledged(&self, queue: &str) -> Result<u64>;

    /// Fails unless `queue` and its dead letters are empty; then removes them.
    async fn drop_queue(&self, queue: &str) -> Result<()>;
}

impl Bench {
    /// Every round of `broker`, unless it is left out, while its server is the only broker
    /// server running: started before its first round, stopped after its last. The idle
    /// servers of the other brokers (JVMs, a BEAM) would take CPU from its phases on a small
    /// machine, and the broker column shows its server alone.
    pub async fn broker_rounds<B: BenchBroker>(
        &mut self,
        broker: &mut B,
        table: &mut Table,
    ) -> Result<()> {
        if broker.messages() == 0 {
            return Ok(());
        }
        broker.start_server().await?;
        self.broker_pid = broker.server_pid();
        let repeats = self.args.repeats;
        for number in 1..=repeats {
            let started = Instant::now();
            self.broker_round(broker, table).await?;
            eprintln!(
                "{} round {number} of {repeats} took {:.0} s; load average {}",
                broker.kind(),
                started.elapsed().as_secs_f64(),
                load_average()
            );
        }
        broker.stop_server();
        self.broker_pid = None;
        Ok(())
    }

    /// The raw receive + ack limit of `broker` with `loops`.
    pub async fn raw_broker_limit<B: BenchBroker>(
        &self,
        broker: &mut B,
        loops: RawLoops,
    ) -> Result<Measurement> {
        let messages = broker.messages();
        let queue = broker.fresh_queue(messages).await?;
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let drained = tokio::time::timeout(PHASE_TIMEOUT, broker.drain_raw(&queue, loops)).await;
        let (acked, name) = drained.with_context(|| {
            format!(
                "the raw {} loops did not drain {queue} in time",
                broker.kind()
            )
        })??;
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, None);
        ensure!(
            acked == messages,
            "{name}: acknowledged {acked} of {messages} messages"
        );
        broker.drop_queue(&queue).await?;
        Ok(Measurement {
            name,
            messages,
            elapsed,
            cpu,
            peak_rss_kib: None,
            store: None,
        })
    }

    /// Throughput of the worker draining a preloaded queue of `broker`: the clock starts as the
    /// worker is spawned and stops once the worker counts every message acknowledged, the
    /// broker shows nothing left unacknowledged (the worker acks after COMMIT) and every
    /// message is a todo.
    pub async fn broker_worker<B: BenchBroker>(&mut self, broker: &mut B) -> Result<Measurement> {
        let database = self.fresh_database(4).await?;
        let messages = broker.messages();
        let queue = broker.fresh_queue(messages).await?;
        let batch_size = broker.batch_size();
        let (source, env) = broker.worker_source(&queue);
        let manifest = self.fx.manifest(
            &format!("{queue}.yaml"),
            &source_manifest(&queue, &source, &format!("batchSize: {batch_size}"), ""),
        )?;
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let before = self.cpu_snapshot();
        let started = Instant::now();
        let worker = WorkerProcess::start_binary(
            &self.args.worker,
            &self.worker_env(&database),
            &manifest,
            "bench",
            &env,
        )?;
        // The worker's own count first (a scrape of its metrics, which costs the broker
        // nothing), then the broker and the database confirm: a query of the broker every
        // poll would take CPU from the phase it measures (for Kafka a client per query).
        wait_acked(&worker, &queue, messages).await?;
        let expected = i64::try_from(messages)?;
        wait_for(
            PHASE_TIMEOUT,
            &format!("{queue} is drained and holds {messages} todos"),
            || async {
                Ok(broker.unacknowledged(&queue).await? == 0
                    && todo_count(&database.store, &queue).await? >= expected)
            },
        )
        .await
        .with_context(|| worker.log_tail())?;
        let elapsed = started.elapsed();
        let cpu = self.cpu_since(before, Some(worker.pid()));
        let peak_rss_kib = status_kib(worker.pid(), "VmHWM");
        let store = store_use(&worker, &queue, elapsed).ok();
        stop_worker(worker)?;
        ensure_stored_once(&database.store, &queue, messages).await?;
        broker.drop_queue(&queue).await?;
        self.drop_database(database).await?;
        Ok(Measurement {
            name: worker_phase(broker),
            messages,
            elapsed,
            cpu,
            peak_rss_kib,
            store,
        })
    }

    /// Every phase of `broker` once: its raw limits, then the worker between two runs of its
    /// raw database limit ([`Bench::raw_database_reference`]).
    async fn broker_round<B: BenchBroker>(
        &mut self,
        broker: &mut B,
        table: &mut Table,
    ) -> Result<()> {
        for loops in broker.raw_loops() {
            table.add(self.raw_broker_limit(broker, loops).await?);
        }
        let rows = (broker.messages(), broker.batch_size());
        let before = self.raw_database_reference(rows, broker.key_time()).await?;
        let worker = self.broker_worker(broker).await?;
        let after = self.raw_database_reference(rows, broker.key_time()).await?;
        table.add(before.around(&after, broker.kind(), broker.batch_size()));
        table.add(worker);
        Ok(())
    }
}

fn worker_phase(broker: &impl BenchBroker) -> String {
    format!("worker {} batchSize {}", broker.kind(), broker.batch_size())
}

/// The verdict lines of `broker`: CPU efficiency and the share of the shared-CPU ceiling (see
/// [`print_efficiency`]), then the retired verdict — the worker against the slower of its raw
/// limit and the raw database limit measured around it, per round.
pub fn print_broker_verdict(broker: &impl BenchBroker, table: &Table) -> Result<()> {
    let kind = broker.kind();
    if broker.messages() == 0 {
        println!("{kind}: not measured (--{kind}-messages 0)");
        return Ok(());
    }
    let worker = table.row(&worker_phase(broker))?;
    let raw = table
        .best(&format!("raw {kind} "))
        .with_context(|| format!("no raw {kind} run"))?;
    let raw_db = table.raw_db_around(kind)?;
    print_efficiency(kind, worker, raw, raw_db, broker.cpu_targets());
    let target = broker.target();
    let ratio = worker.ratio_to_slower(raw, raw_db);
    println!(
        "{kind} / min({}, {}) (retired verdict):  {:>20}%  target >= {:.0}%    {}",
        raw.name(),
        raw_db.name(),
        ratio.show(1, 100.0),
        target * 100.0,
        verdict(ratio.median >= target)
    );
    Ok(())
}
