//! Switchboard queue-adapter worker: pulls broker messages into durable PostgreSQL todos,
//! acknowledging each message only after its todo is committed (store-then-ack).

mod brokers;
pub mod dlq;
pub mod envelope;
pub mod health;
pub mod metrics;
pub mod payload;
pub mod pipeline;
mod secret_files;
pub mod send;
mod task;
mod text;
pub mod trace_context;
pub mod transport;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use switchboard_api::{Broker, ManifestError, QueueAdapter, QueueAdapterSpec, load_manifest};
use switchboard_store::{Store, StoreError};
use switchboard_telemetry::{Backoff, ErrorChain, Probes};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::brokers::{Context, Loop, Plugin, Use};
use crate::health::{Dependency, Health};
use crate::metrics::Metrics;
use crate::pipeline::{Pipeline, PipelineError, PipelineSettings};
use crate::secret_files::SecretFiles;
use crate::transport::{Transport, TransportError};

/// Environment variable for the testing hook that aborts between commit and ack.
pub const ABORT_AFTER_COMMITS_ENV: &str = "SWITCHBOARD_TEST_ABORT_AFTER_COMMITS";

/// The `application_name` of a worker's database connections, so `pg_stat_activity` shows which
/// consumer (pod) holds each one. PostgreSQL keeps 63 bytes; pod names differ at their end, so a
/// longer name keeps the consumer's tail (`switchboard-worker/~…`).
pub fn database_application_name(consumer: &str) -> String {
    const PREFIX: &str = "switchboard-worker/";
    const KEPT: usize = 63;
    let name = format!("{PREFIX}{consumer}");
    if name.len() <= KEPT {
        return name;
    }
    let room = KEPT - PREFIX.len() - 1;
    let mut start = consumer.len() - room;
    while !consumer.is_char_boundary(start) {
        start += 1;
    }
    format!("{PREFIX}~{}", &consumer[start..])
}

/// Why the worker could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot read manifest {path}")]
    ReadManifest {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("manifest {path} is not usable")]
    Manifest {
        path: PathBuf,
        #[source]
        source: ManifestError,
    },
    #[error("environment variable {0} is not set")]
    MissingEnv(&'static str),
    #[error("no consumer name: pass --consumer or set HOSTNAME")]
    NoConsumer,
    #[error(
        "the manifest has no supported source (spec.source.{})",
        switchboard_api::broker_list("")
    )]
    NoSource,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("cannot serve metrics on {addr}")]
    Serve {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Dlq(#[from] dlq::DlqError),
    #[error("cannot read the message body from standard input")]
    Stdin(#[source] std::io::Error),
}

impl WorkerError {
    /// The process's exit code for this error: 2 for a command line that cannot be done as
    /// said (as for a flag clap refuses), `128 + n` for a stop by signal `n`, else 1.
    pub fn exit_code(&self) -> u8 {
        match self {
            WorkerError::Dlq(dlq::DlqError::Usage(_)) => 2,
            WorkerError::Dlq(dlq::DlqError::Stopped { signal }) => {
                u8::try_from(128 + signal).unwrap_or(1)
            }
            _ => 1,
        }
    }
}

/// Options of `switchboard-worker run`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub file: PathBuf,
    pub consumer: Option<String>,
    pub metrics_addr: SocketAddr,
    pub shutdown_timeout: Duration,
    /// Bound on each batch, probe and checkpoint read against PostgreSQL.
    pub database_timeout: Duration,
    /// Where the Secrets the worker reads are mounted (`<secret>/<variable>`): a file that
    /// differs from its variable stops the worker gracefully so that it restarts onto it.
    pub secrets_dir: Option<PathBuf>,
}

pub(crate) fn env(name: &'static str) -> Result<String, WorkerError> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .ok_or(WorkerError::MissingEnv(name))
}

/// `switchboard-worker migrate`: applies the migrations to `DATABASE_URL`.
pub async fn migrate() -> Result<(), WorkerError> {
    let store = Store::connect(&env("DATABASE_URL")?, 1, "switchboard-worker/migrate").await?;
    store.migrate().await?;
    tracing::info!("migrations applied");
    Ok(())
}

fn consumer_name(explicit: Option<String>) -> Result<String, WorkerError> {
    explicit
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .ok_or(WorkerError::NoConsumer)
}

/// `switchboard-worker lint --file`: the checks `run` makes of a manifest before it connects
/// to anything (the loader's schema bounds and the API server's rules, a source set), with no
/// environment and no server. What a valid manifest runs, in one line.
pub fn lint(path: &PathBuf) -> Result<String, WorkerError> {
    let adapter = read_adapter(path)?;
    let broker = adapter.spec.source.broker().ok_or(WorkerError::NoSource)?;
    let disabled = if adapter.spec.enabled {
        ""
    } else {
        " (disabled: spec.enabled is false)"
    };
    Ok(format!(
        "{}: {} {}, {}{disabled}",
        adapter.adapter_name(),
        broker.kind(),
        broker.mode(),
        broker.guarantee().as_str()
    ))
}

pub(crate) fn read_adapter(path: &PathBuf) -> Result<QueueAdapter, WorkerError> {
    let yaml = std::fs::read_to_string(path).map_err(|source| WorkerError::ReadManifest {
        path: path.clone(),
        source,
    })?;
    load_manifest(&yaml).map_err(|source| WorkerError::Manifest {
        path: path.clone(),
        source,
    })
}

/// Waits until the database answers and is migrated. `Ok(false)`: cancelled while waiting.
async fn wait_for_schema(
    store: &Store,
    health: &Health,
    cancel: &CancellationToken,
) -> Result<bool, WorkerError> {
    let mut backoff = Backoff::default();
    loop {
        match store.ensure_migrated().await {
            Ok(()) => return Ok(true),
            Err(err) if err.is_retryable() => {
                if backoff.attempts() == 0 {
                    tracing::warn!(error = %ErrorChain(&err), "database unavailable at start; retrying with backoff");
                }
                health.set_down(Dependency::Database, &ErrorChain(&err).to_string());
                let delay = backoff.next_delay();
                // Waiting for the database is not being stuck.
                health.beat(delay + Duration::from_secs(60));
                tokio::select! {
                    () = cancel.cancelled() => return Ok(false),
                    () = tokio::time::sleep(delay) => {}
                }
            }
            Err(err) => return Err(err.into()),
        }
    }
}

struct Signals {
    terminate: Signal,
    interrupt: Signal,
}

impl Signals {
    fn install() -> Result<Self, WorkerError> {
        Ok(Self {
            terminate: signal(SignalKind::terminate()).map_err(WorkerError::Signals)?,
            interrupt: signal(SignalKind::interrupt()).map_err(WorkerError::Signals)?,
        })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }

    /// First SIGTERM/SIGINT cancels `cancel`; a second one exits at once.
    fn spawn(mut self, cancel: CancellationToken) {
        crate::task::spawn(async move {
            self.next().await;
            tracing::info!("shutdown requested; finishing the batch in hand");
            cancel.cancel();
            self.next().await;
            tracing::warn!("second shutdown signal; exiting at once");
            std::process::exit(130);
        });
    }
}

/// What every pipeline shares.
struct Deps {
    /// `namespace/name`.
    adapter: String,
    store: Store,
    health: Arc<Health>,
    cancel: CancellationToken,
    shutdown_timeout: Duration,
    settings: PipelineSettings,
    secret_files: Option<SecretFiles>,
}

/// Runs the loop until it stops, or until the shutdown timeout after cancellation: dropping the
/// loop there leaves its batch un-acknowledged, never half-acknowledged. The common metrics
/// join the transport's own in `registry` and are served from then on.
async fn drive<T: Transport>(
    transport: T,
    registry: Registry,
    broker: &dyn Broker,
    deps: Deps,
    probes: &WorkerProbes,
) -> Result<(), WorkerError> {
    let Deps {
        adapter,
        store,
        health,
        cancel,
        shutdown_timeout,
        settings,
        secret_files,
    } = deps;
    let mut registry = registry;
    if let Some(files) = secret_files {
        let restarts = crate::metrics::adapter_counter(
            &mut registry,
            "worker_secret_restarts",
            "Stops to restart onto a changed mounted Secret",
            &adapter,
        );
        files.stop_on_change(cancel.clone(), restarts);
    }
    let metrics = Arc::new(Metrics::new(&adapter, broker.guarantee(), registry));
    let _ = probes.metrics.set(metrics.clone());
    let pipeline = Pipeline::new(transport, store, settings, metrics, health, cancel.clone());
    tokio::select! {
        result = pipeline.run() => result?,
        () = async { cancel.cancelled().await; tokio::time::sleep(shutdown_timeout).await } => {
            tracing::warn!(timeout = ?shutdown_timeout, "shutdown timeout reached; leaving the batch in hand un-acknowledged");
        }
    }
    Ok(())
}

/// The pipeline settings of `spec`, for consumer `worker` of adapter `adapter`.
fn pipeline_settings(
    spec: &QueueAdapterSpec,
    broker: &dyn Broker,
    adapter: &str,
    worker: &str,
) -> PipelineSettings {
    PipelineSettings {
        adapter: adapter.to_owned(),
        worker: worker.to_owned(),
        queue: spec.target.queue.clone(),
        batch_size: spec.delivery.batch_size as usize,
        max_deliveries: u64::from(spec.delivery.max_deliveries),
        format: spec.payload.format,
        max_bytes: spec.payload.max_bytes as usize,
        envelope: spec.payload.envelope,
        abort_after_commits: std::env::var(ABORT_AFTER_COMMITS_ENV)
            .ok()
            .and_then(|v| v.parse().ok()),
        dead_letter_retention: spec.delivery.dead_letter.retention(),
        messaging: broker.messaging(adapter),
    }
}

/// `/healthz`: the loop makes progress; `/readyz`: started and every dependency answers;
/// `/metrics`: the loop's metrics, once its transport has registered its own.
struct WorkerProbes {
    health: Arc<Health>,
    metrics: std::sync::OnceLock<Arc<Metrics>>,
}

impl Probes for WorkerProbes {
    fn is_live(&self) -> bool {
        self.health.is_live()
    }

    fn is_ready(&self) -> bool {
        self.health.is_ready()
    }

    fn not_ready_because(&self) -> String {
        self.health.not_ready_because()
    }

    fn metrics(&self) -> String {
        self.metrics
            .get()
            .map(|metrics| {
                metrics.ready.set(i64::from(self.health.is_ready()));
                metrics.encode()
            })
            .unwrap_or_default()
    }
}

/// `switchboard-worker run`: one store-then-ack loop for the adapter in `options.file`.
/// Every line it logs, its tasks' lines included, is in the span `adapter` naming the adapter.
pub async fn run(options: RunOptions) -> Result<(), WorkerError> {
    let signals = Signals::install()?;
    let adapter = read_adapter(&options.file)?;
    let name = adapter.adapter_name();
    let span = tracing::info_span!("adapter", adapter = %name);
    run_adapter(options, signals, adapter, name)
        .instrument(span)
        .await
}

async fn run_adapter(
    options: RunOptions,
    signals: Signals,
    adapter: QueueAdapter,
    name: String,
) -> Result<(), WorkerError> {
    let cancel = CancellationToken::new();
    signals.spawn(cancel.clone());
    let secret_files = options.secrets_dir.map(SecretFiles::new);
    let spec = &adapter.spec;
    let Some(broker) = spec.source.broker() else {
        return Err(WorkerError::NoSource);
    };
    if !spec.enabled {
        tracing::warn!("adapter is disabled (spec.enabled: false); nothing to do");
        return Ok(());
    }
    tracing::info!(
        source = broker.kind(),
        mode = broker.mode(),
        guarantee = broker.guarantee().as_str(),
        "starting"
    );

    let consumer = consumer_name(options.consumer)?;
    // One connection per batch being stored, closed once idle, and one for the rest (Kafka's
    // delivery marks, raised while batches are stored; probes and reports): an idle worker
    // holds one.
    let store = Store::connect(
        &env("DATABASE_URL")?,
        transport::IN_FLIGHT as u32 + 1,
        &database_application_name(&consumer),
    )
    .await?
    .with_background_connection()
    .with_operation_timeout(options.database_timeout);
    let health = Arc::new(Health::new());
    let stop_server = CancellationToken::new();
    let probes = Arc::new(WorkerProbes {
        health: health.clone(),
        metrics: std::sync::OnceLock::new(),
    });
    let (bound, server) =
        switchboard_telemetry::serve(options.metrics_addr, probes.clone(), stop_server.clone())
            .await
            .map_err(|source| WorkerError::Serve {
                addr: options.metrics_addr,
                source,
            })?;
    tracing::info!(addr = %bound, "serving /healthz, /readyz and /metrics");

    if !wait_for_schema(&store, &health, &cancel).await? {
        return Ok(());
    }
    tracing::info!(consumer = %consumer, "consumer name");
    let deps = Deps {
        settings: pipeline_settings(spec, broker, &name, &consumer),
        adapter: name,
        store,
        health,
        cancel,
        shutdown_timeout: options.shutdown_timeout,
        secret_files,
    };
    let result = run_source(&adapter, consumer, deps, &probes).await;
    stop_server.cancel();
    let _ = server.await;
    result?;
    tracing::info!("exiting");
    Ok(())
}

/// Runs the loop over the transport of the adapter's broker, which its plugin builds
/// ([`brokers`]: the one place that knows the brokers).
async fn run_source(
    adapter: &QueueAdapter,
    consumer: String,
    deps: Deps,
    probes: &WorkerProbes,
) -> Result<(), WorkerError> {
    let context = Context {
        adapter,
        name: deps.adapter.clone(),
        consumer,
        store: deps.store.clone(),
    };
    let mut registry = Metrics::registry();
    metrics::register_adapter_info(&mut registry, adapter);
    let driver = Driver {
        deps,
        probes,
        registry,
    };
    let start = Start { context, driver };
    brokers::with_plugin(&adapter.spec.source, start)
        .await
        .unwrap_or(Err(WorkerError::NoSource))
}

/// Starting the loop: the plugin builds its transport from `context` and hands it to `driver`.
struct Start<'a> {
    context: Context<'a>,
    driver: Driver<'a>,
}

impl Use for Start<'_> {
    type Output = Result<(), WorkerError>;

    async fn with<P: Plugin>(self, plugin: &P) -> Self::Output {
        plugin.run(self.context, self.driver).await
    }
}

/// [`drive`], for the transport a plugin built.
struct Driver<'a> {
    deps: Deps,
    probes: &'a WorkerProbes,
    registry: Registry,
}

impl Loop for Driver<'_> {
    fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    async fn drive<T: Transport>(
        self,
        transport: T,
        broker: &dyn Broker,
    ) -> Result<(), WorkerError> {
        drive(transport, self.registry, broker, self.deps, self.probes).await
    }
}

#[cfg(test)]
mod tests {
    use super::database_application_name;

    #[test]
    fn long_consumer_names_keep_their_distinguishing_tail_within_63_bytes() {
        assert_eq!(database_application_name("w1"), "switchboard-worker/w1");
        let pod = format!("{}-worker-6b7f9c5d4-x2k4q", "a".repeat(50));
        let name = database_application_name(&pod);
        assert_eq!(name.len(), 63, "{name}");
        assert!(name.starts_with("switchboard-worker/~"), "{name}");
        assert!(name.ends_with("-worker-6b7f9c5d4-x2k4q"), "{name}");
    }
}
