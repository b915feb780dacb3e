use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use switchboard_api::SecretKeyRef;
use switchboard_operator::build::WorkerSettings;
use switchboard_operator::database_ca::DefaultCa;
use switchboard_operator::lease::{LeaseSettings, unique_identity};
use switchboard_operator::pod_template::PodDefaults;
use switchboard_operator::storage::{DEFAULT_DEDUP_WINDOW_DAYS, EventRetention};
use switchboard_operator::worker_traces::WorkerTraces;
use switchboard_operator::{DEFAULT_WORKER_IMAGE, ErrorChain, RunOptions, crd_yaml, run};

/// Kubernetes operator for Switchboard QueueAdapters: one worker Deployment and one `adapters`
/// row per QueueAdapter.
///
/// Kubernetes access: KUBECONFIG or the in-cluster service account. Database: DATABASE_URL
/// (migrated at start).
#[derive(Debug, Parser)]
#[command(name = "switchboard-operator", version)]
struct Cli {
    /// Log JSON lines instead of text.
    #[arg(long, global = true, env = "LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the QueueAdapter CustomResourceDefinition as YAML.
    Crd,
    /// Reconcile QueueAdapters until SIGTERM.
    Run(Box<RunArgs>),
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Image of the worker pods (a QueueAdapter's spec.workload.image overrides it).
    #[arg(long, env = "SWITCHBOARD_WORKER_IMAGE", default_value = DEFAULT_WORKER_IMAGE)]
    worker_image: String,
    /// Comma-separated prefixes of the other images a QueueAdapter's spec.workload.image may
    /// name, e.g. `registry.example/switchboard,mirror.example/` [default: none, only
    /// --worker-image]. A worker pod gets the Secrets its adapter names: allow only images you
    /// trust with them.
    #[arg(
        long,
        env = "SWITCHBOARD_ALLOWED_WORKER_IMAGES",
        value_delimiter = ',',
        default_value = ""
    )]
    allowed_worker_images: Vec<String>,
    /// imagePullPolicy of the worker pods.
    #[arg(long, env = "SWITCHBOARD_WORKER_IMAGE_PULL_POLICY", default_value = "IfNotPresent",
          value_parser = ["Always", "IfNotPresent", "Never"])]
    worker_image_pull_policy: String,
    /// Secret (in the adapter's namespace) holding the database URL when a QueueAdapter has no
    /// spec.database.
    #[arg(
        long,
        env = "SWITCHBOARD_DEFAULT_DATABASE_SECRET_NAME",
        default_value = "switchboard-db"
    )]
    default_database_secret_name: String,
    /// Key of that Secret.
    #[arg(
        long,
        env = "SWITCHBOARD_DEFAULT_DATABASE_SECRET_KEY",
        default_value = "url"
    )]
    default_database_secret_key: String,
    /// The CA (PEM) worker pods trust for the database when a QueueAdapter's spec.database
    /// names none: `configMap:NAME/KEY` or `secret:NAME/KEY` in the adapter's namespace,
    /// mounted read-only as PGSSLROOTCERT (for `sslmode=verify-full`) [default: none].
    #[arg(long, env = "SWITCHBOARD_DEFAULT_DATABASE_CA", value_parser = DefaultCa::parse)]
    default_database_ca: Option<DefaultCa>,
    /// Defaults of every worker pod, as JSON: imagePullSecrets, serviceAccountName,
    /// nodeSelector, tolerations, affinity, topologySpreadConstraints, priorityClassName,
    /// resources, podAnnotations and podLabels, spelled as in a pod spec (the Helm chart renders
    /// it from `worker.*`). A QueueAdapter's spec.workload field of the same name replaces the
    /// default; podAnnotations and podLabels merge, the adapter's value winning per key.
    #[arg(long, env = "SWITCHBOARD_WORKER_POD_DEFAULTS", default_value = "{}",
          value_parser = PodDefaults::from_json)]
    worker_pod_defaults: PodDefaults,
    /// OTLP/HTTP endpoint every worker exports its traces to, e.g.
    /// `http://otel-collector.observability:4318` (their OTEL_EXPORTER_OTLP_ENDPOINT) [default:
    /// none: workers export no traces]. The operator's own traces follow its OTEL_* environment.
    #[arg(long, env = "SWITCHBOARD_WORKER_OTLP_ENDPOINT")]
    worker_otlp_endpoint: Option<String>,
    /// OTEL_TRACES_SAMPLER of the workers (e.g. `parentbased_traceidratio`) [default: the
    /// SDK's, parentbased_always_on].
    #[arg(long, env = "SWITCHBOARD_WORKER_TRACES_SAMPLER")]
    worker_traces_sampler: Option<String>,
    /// OTEL_TRACES_SAMPLER_ARG of the workers (e.g. `0.1`).
    #[arg(long, env = "SWITCHBOARD_WORKER_TRACES_SAMPLER_ARG")]
    worker_traces_sampler_arg: Option<String>,
    /// Reconcile only while holding a coordination.k8s.io Lease (run several replicas safely).
    #[arg(long, env = "SWITCHBOARD_LEADER_ELECTION")]
    leader_election: bool,
    /// Name of the leader Lease.
    #[arg(
        long,
        env = "SWITCHBOARD_LEASE_NAME",
        default_value = "switchboard-operator"
    )]
    lease_name: String,
    /// Namespace of the leader Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// How long a lease lasts without renewal before another replica takes over.
    #[arg(long, env = "SWITCHBOARD_LEASE_DURATION", default_value = "15s",
          value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// This replica's name in Events [default: the host name]; its Lease identity is this name
    /// plus `_` and a random suffix, so replicas sharing a host name never share an identity.
    #[arg(long, env = "HOSTNAME")]
    identity: Option<String>,
    /// How often every adapter is reconciled again without a change (drift repair: a
    /// hand-edited Deployment or adapters row), and the rows of deleted adapters swept.
    #[arg(long, env = "SWITCHBOARD_RESYNC_INTERVAL", default_value = "5m",
          value_parser = humantime::parse_duration)]
    resync_interval: Duration,
    /// Days a message's dedup marker is kept (an adapter's spec.delivery.dedupWindowDays may
    /// ask for longer); older events are dropped with their partition.
    #[arg(long, env = "SWITCHBOARD_DEDUP_WINDOW_DAYS", default_value_t = DEFAULT_DEDUP_WINDOW_DAYS,
          value_parser = clap::value_parser!(u32).range(1..=3650))]
    dedup_window_days: u32,
    /// How often the events table's partitions are created ahead and dropped behind.
    #[arg(long, env = "SWITCHBOARD_STORAGE_MAINTENANCE_INTERVAL", default_value = "1h",
          value_parser = humantime::parse_duration)]
    storage_maintenance_interval: Duration,
    /// Address of the /healthz, /readyz and /metrics server.
    #[arg(long, env = "SWITCHBOARD_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// PostgreSQL URL of the database holding the adapters table.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
}

impl RunArgs {
    fn into_options(self) -> RunOptions {
        let identity = self
            .identity
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
            .map(|name| name.trim().to_owned())
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| format!("switchboard-operator-{}", std::process::id()));
        RunOptions {
            worker: WorkerSettings {
                image: self.worker_image,
                image_pull_policy: self.worker_image_pull_policy,
                allowed_images: self
                    .allowed_worker_images
                    .into_iter()
                    .map(|prefix| prefix.trim().to_owned())
                    .filter(|prefix| !prefix.is_empty())
                    .collect(),
                default_database_secret: SecretKeyRef {
                    name: self.default_database_secret_name,
                    key: self.default_database_secret_key,
                },
                default_database_ca: self.default_database_ca,
                pod: self.worker_pod_defaults,
                traces: WorkerTraces {
                    endpoint: self.worker_otlp_endpoint.filter(|e| !e.is_empty()),
                    sampler: self.worker_traces_sampler.filter(|s| !s.is_empty()),
                    sampler_arg: self.worker_traces_sampler_arg.filter(|a| !a.is_empty()),
                },
            },
            leader_election: self.leader_election.then(|| LeaseSettings {
                name: self.lease_name,
                namespace: self.lease_namespace,
                identity: unique_identity(&identity),
                duration: self.lease_duration,
            }),
            identity,
            metrics_addr: self.metrics_addr,
            database_url: self.database_url,
            resync: self.resync_interval,
            events: EventRetention {
                window_days: self.dedup_window_days,
                every: self.storage_maintenance_interval,
            },
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // An error only means a provider is installed already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Crd => crd_yaml()
            .map(|yaml| print!("{yaml}"))
            .map_err(anyhow::Error::from),
        Command::Run(args) => {
            let traces =
                match switchboard_telemetry::init_tracing(cli.log_json, "switchboard-operator") {
                    Ok(traces) => traces,
                    Err(err) => {
                        eprintln!("error: {err}");
                        return ExitCode::FAILURE;
                    }
                };
            let result = run(args.into_options()).await.map_err(anyhow::Error::from);
            traces.shutdown().await;
            result
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %ErrorChain(err.as_ref()), "fatal");
            eprintln!("error: {}", ErrorChain(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}
