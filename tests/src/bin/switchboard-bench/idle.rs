//! The idle cost of an adapter: a QueueAdapter is a worker pod, so many quiet adapters cost
//! memory, CPU and database connections. `--idle-workers` workers, one per adapter, each on an
//! empty queue of its own, spread over Redis streams and lists and every broker measured, with
//! all their servers up; once every worker is ready, each one's RSS, CPU over
//! `--idle-seconds` and PostgreSQL connections.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, Result};
use clap::Args as ClapArgs;
use switchboard_tests::source_manifest;
use switchboard_tests::wait::wait_for;
use switchboard_tests::worker::WorkerProcess;

use crate::broker::BenchBroker;
use crate::measure::{USER_HZ, cpu_ticks, private_kib, status_kib};
use crate::table::{Stat, verdict};
use crate::{Bench, Brokers, Mode, stop_worker};

/// Worker RSS at or under this (MiB) is a pass.
const RSS_TARGET_MIB: f64 = 24.0;
/// CPU per idle minute at or under this (seconds) is a pass.
const CPU_TARGET_SECONDS: f64 = 0.2;
/// Idle PostgreSQL connections per worker at or under this is a pass.
const CONNECTIONS_TARGET: f64 = 1.0;
/// How long the idle workers may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Debug, Clone, ClapArgs)]
pub struct IdleArgs {
    /// Idle workers of the idle-cost phase, spread over every broker measured (0: no phase).
    #[arg(long, default_value_t = 50)]
    idle_workers: usize,
    /// How long the idle workers are watched once all are ready, seconds.
    #[arg(long, default_value_t = 60)]
    idle_seconds: u64,
}

/// One adapter to start: its broker, the body of `spec.source` and the environment it needs.
struct Adapter {
    kind: &'static str,
    queue: String,
    source: String,
    env: Vec<(&'static str, String)>,
}

/// What one idle worker cost.
struct Cost {
    kind: &'static str,
    rss_mib: f64,
    /// The part of its RSS no other process maps (the binary's code is shared by every worker
    /// of one image on a node).
    private_mib: f64,
    cpu_per_minute: f64,
    connections: f64,
}

impl Bench {
    /// The idle-cost phase: starts every measured broker's server, one idle worker per adapter,
    /// and prints the figures per broker and the verdicts.
    pub async fn idle_cost(&mut self, args: &IdleArgs, brokers: &mut Brokers) -> Result<()> {
        if args.idle_workers == 0 {
            println!("idle cost: not measured (--idle-workers 0)");
            return Ok(());
        }
        brokers.start_servers().await?;
        let measured = self.measure_idle(args, brokers).await;
        brokers.stop_servers();
        let costs = measured?;
        print_idle(&costs, args);
        Ok(())
    }

    async fn measure_idle(&mut self, args: &IdleArgs, brokers: &mut Brokers) -> Result<Vec<Cost>> {
        let adapters = brokers.idle_adapters(args.idle_workers).await?;
        let database = self.fresh_database(1).await?;
        let mut workers = Vec::with_capacity(adapters.len());
        for (index, adapter) in adapters.iter().enumerate() {
            let manifest = self.fx.manifest(
                &format!("idle-{index}.yaml"),
                &source_manifest(&adapter.queue, &adapter.source, "batchSize: 100", ""),
            )?;
            let env: Vec<(&str, &str)> = adapter
                .env
                .iter()
                .map(|(name, value)| (*name, value.as_str()))
                .collect();
            workers.push(WorkerProcess::start_binary(
                &self.args.worker,
                &self.worker_env(&database),
                &manifest,
                &format!("idle-{index}"),
                &env,
            )?);
        }
        for worker in &workers {
            wait_for(READY_TIMEOUT, "an idle worker is ready", || async {
                Ok(worker
                    .http_get("/readyz")
                    .is_ok_and(|(status, _)| status == 200))
            })
            .await
            .with_context(|| worker.log_tail())?;
        }
        let before: Vec<u64> = workers.iter().map(|w| cpu_ticks(w.pid(), false)).collect();
        // A measurement window, not a synchronisation: the workers are idle throughout.
        tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
        let connections = self.connections_by_application(&database.name).await?;
        let minutes = args.idle_seconds as f64 / 60.0;
        let costs = workers
            .iter()
            .zip(&adapters)
            .zip(before)
            .enumerate()
            .map(|(index, ((worker, adapter), before))| {
                let ticks = cpu_ticks(worker.pid(), false) - before;
                let name = switchboard_worker::database_application_name(&format!("idle-{index}"));
                Cost {
                    kind: adapter.kind,
                    rss_mib: status_kib(worker.pid(), "VmRSS").unwrap_or(0) as f64 / 1024.0,
                    private_mib: private_kib(worker.pid()).unwrap_or(0) as f64 / 1024.0,
                    cpu_per_minute: ticks as f64 / USER_HZ as f64 / minutes,
                    connections: connections.get(&name).copied().unwrap_or(0) as f64,
                }
            })
            .collect();
        for worker in workers {
            stop_worker(worker)?;
        }
        self.drop_database(database).await?;
        Ok(costs)
    }

    /// The connections to `database`, per `application_name`.
    async fn connections_by_application(&self, database: &str) -> Result<BTreeMap<String, i64>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT application_name, count(*) FROM pg_stat_activity \
             WHERE datname = $1 GROUP BY application_name",
        )
        .bind(database)
        .fetch_all(self.fx.pool())
        .await?;
        Ok(rows.into_iter().collect())
    }
}

impl Brokers {
    /// Starts the server of every broker measured.
    async fn start_servers(&mut self) -> Result<()> {
        start_measured(&mut self.sqs).await?;
        start_measured(&mut self.nats).await?;
        start_measured(&mut self.amqp).await?;
        start_measured(&mut self.kafka).await
    }

    fn stop_servers(&mut self) {
        self.sqs.stop_server();
        self.nats.stop_server();
        self.amqp.stop_server();
        self.kafka.stop_server();
    }

    /// `count` adapters, each on an empty queue of its own, taken in turn from Redis streams,
    /// Redis lists and every broker measured.
    async fn idle_adapters(&mut self, count: usize) -> Result<Vec<Adapter>> {
        let kinds = 2 + [
            self.sqs.messages(),
            self.nats.messages(),
            self.amqp.messages(),
            self.kafka.messages(),
        ]
        .iter()
        .filter(|&&messages| messages > 0)
        .count();
        let per_kind = |position: usize| (count + kinds - 1 - position) / kinds;
        let mut adapters = Vec::with_capacity(count);
        for (position, mode) in [Mode::Stream, Mode::List].into_iter().enumerate() {
            for index in 0..per_kind(position) {
                let queue = format!("idle-{}-{index}", mode.as_str());
                adapters.push(Adapter {
                    kind: mode.as_str(),
                    source: format!("redis: {{{}}}", mode.source(&queue)),
                    queue,
                    env: Vec::new(),
                });
            }
        }
        let mut position = 2;
        add_adapters(&mut self.sqs, per_kind, &mut position, &mut adapters).await?;
        add_adapters(&mut self.nats, per_kind, &mut position, &mut adapters).await?;
        add_adapters(&mut self.amqp, per_kind, &mut position, &mut adapters).await?;
        add_adapters(&mut self.kafka, per_kind, &mut position, &mut adapters).await?;
        Ok(adapters)
    }
}

async fn start_measured(broker: &mut impl BenchBroker) -> Result<()> {
    if broker.messages() > 0 {
        broker.start_server().await?;
    }
    Ok(())
}

/// The idle adapters of `broker`, if it is measured: `per_kind(position)` of them, each on an
/// empty queue of its own; `position` is the broker's turn among the kinds.
async fn add_adapters(
    broker: &mut impl BenchBroker,
    per_kind: impl Fn(usize) -> usize,
    position: &mut usize,
    adapters: &mut Vec<Adapter>,
) -> Result<()> {
    if broker.messages() == 0 {
        return Ok(());
    }
    for _ in 0..per_kind(*position) {
        let queue = broker.fresh_queue(0).await?;
        let (source, env) = broker.worker_source(&queue);
        adapters.push(Adapter {
            kind: broker.kind(),
            queue,
            source,
            env,
        });
    }
    *position += 1;
    Ok(())
}

/// The figures per broker (median (min–max) over its workers), then the verdicts over every
/// worker (the worst one).
fn print_idle(costs: &[Cost], args: &IdleArgs) {
    println!();
    println!(
        "idle cost: {} workers, each on an empty queue of its own, watched {} s once all were ready",
        costs.len(),
        args.idle_seconds
    );
    println!(
        "| {:<8} | {:>7} | {:>20} | {:>20} | {:>24} | {:>22} |",
        "broker",
        "workers",
        "RSS MiB",
        "of it private MiB",
        "CPU s per idle minute",
        "PostgreSQL connections"
    );
    println!(
        "|{:-<10}|{:->9}|{:->22}|{:->22}|{:->26}|{:->24}|",
        "", "", "", "", "", ""
    );
    let mut kinds: Vec<&str> = costs.iter().map(|cost| cost.kind).collect();
    kinds.dedup();
    for kind in kinds {
        let of_kind: Vec<&Cost> = costs.iter().filter(|cost| cost.kind == kind).collect();
        let stat = |figure: fn(&Cost) -> f64| Stat::of(of_kind.iter().map(|c| figure(c)).collect());
        println!(
            "| {:<8} | {:>7} | {:>20} | {:>20} | {:>24} | {:>22} |",
            kind,
            of_kind.len(),
            stat(|c| c.rss_mib).show(1, 1.0),
            stat(|c| c.private_mib).show(1, 1.0),
            stat(|c| c.cpu_per_minute).show(3, 1.0),
            stat(|c| c.connections).show(0, 1.0)
        );
    }
    let worst = |figure: fn(&Cost) -> f64| costs.iter().map(figure).fold(0.0, f64::max);
    let (rss, cpu, connections) = (
        worst(|c| c.rss_mib),
        worst(|c| c.cpu_per_minute),
        worst(|c| c.connections),
    );
    println!(
        "idle worker RSS (worst):                 {rss:>8.1} MiB target <= {RSS_TARGET_MIB} MiB {}",
        verdict(rss <= RSS_TARGET_MIB)
    );
    println!(
        "idle worker CPU per minute (worst):      {cpu:>8.3} s   target <= {CPU_TARGET_SECONDS} s    {}",
        verdict(cpu <= CPU_TARGET_SECONDS)
    );
    println!(
        "idle worker PostgreSQL connections (worst): {connections:>5.0}     target <= {CONNECTIONS_TARGET}        {}",
        verdict(connections <= CONNECTIONS_TARGET)
    );
}
