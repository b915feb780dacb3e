use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use switchboard_telemetry::{ErrorChain, Traces, init_tracing};
use switchboard_worker::send::{SendOptions, send};
use switchboard_worker::{RunOptions, WorkerError, dlq, lint, migrate, run};

/// Every message allocates and frees a few small buffers on its way from the broker to the
/// database; mimalloc does that at a fraction of glibc's cost (docs/PERFORMANCE.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Pulls broker messages into durable PostgreSQL todos (store-then-ack).
///
/// Secrets come from the environment only: DATABASE_URL, REDIS_URL, AWS_ACCESS_KEY_ID,
/// AWS_SECRET_ACCESS_KEY (or the default AWS credential chain).
#[derive(Debug, Parser)]
#[command(name = "switchboard-worker", version)]
struct Cli {
    /// Log JSON lines instead of text.
    #[arg(long, global = true, env = "LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the database migrations (idempotent; safe to run concurrently).
    Migrate,
    /// Send the body on standard input as one message to the manifest's source; prints its id.
    Send {
        /// The QueueAdapter manifest.
        #[arg(long)]
        file: PathBuf,
        /// A message attribute, `name=value` (repeatable).
        #[arg(long = "attr", value_parser = attribute)]
        attributes: Vec<(String, String)>,
    },
    /// Run the store-then-ack loop for one QueueAdapter manifest.
    Run {
        /// The QueueAdapter manifest (the YAML you would `kubectl apply`).
        #[arg(long)]
        file: PathBuf,
        /// Consumer name within the group [default: $HOSTNAME, the pod name in Kubernetes].
        #[arg(long)]
        consumer: Option<String>,
        /// Address of the /healthz, /readyz and /metrics server.
        #[arg(long, default_value = "0.0.0.0:9090")]
        metrics_addr: SocketAddr,
        /// After SIGTERM, how long to finish the batch in hand before exiting anyway.
        #[arg(long, default_value = "25s", value_parser = humantime::parse_duration)]
        shutdown_timeout: Duration,
        /// How long one batch (or probe) may wait on PostgreSQL before the connection is given
        /// up, the database counted as down and the batch retried (it stays un-acknowledged).
        #[arg(long, env = "SWITCHBOARD_DATABASE_TIMEOUT", default_value = "30s",
              value_parser = positive_duration)]
        database_timeout: Duration,
        /// Where the Secrets of the worker's environment are mounted as `<secret>/<VARIABLE>`
        /// files (set by the operator): when one differs from its variable, the worker finishes
        /// the batch in hand and exits 0 so that it is restarted with the new values.
        #[arg(long, env = "SWITCHBOARD_SECRETS_DIR")]
        secrets_dir: Option<PathBuf>,
    },
    /// Check manifests as `run` would before connecting (and as the API server would), with no
    /// environment and no server: one line per file; exits 1 if any is invalid.
    Lint {
        /// A QueueAdapter manifest (repeatable).
        #[arg(long = "file", required = true)]
        files: Vec<PathBuf>,
    },
    /// Inspect, redrive and purge the adapter's dead letters (same manifest and environment).
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
}

/// `name=value`.
fn attribute(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_owned(), value.to_owned())),
        _ => Err("expected name=value".to_owned()),
    }
}

/// A duration above zero, e.g. `30s`.
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(duration) if duration.is_zero() => Err("must be more than 0s".to_owned()),
        Ok(duration) => Ok(duration),
        Err(err) => Err(err.to_string()),
    }
}

/// `send` with the body read from standard input; prints the message id.
async fn send_stdin(options: SendOptions) -> Result<(), WorkerError> {
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut body).map_err(WorkerError::Stdin)?;
    let id = send(options, body).await?;
    println!("{id}");
    Ok(())
}

/// `lint`: each file's verdict on its own line (valid on stdout, invalid on stderr).
fn lint_files(files: &[PathBuf]) -> ExitCode {
    let mut invalid = false;
    for file in files {
        match lint(file) {
            Ok(summary) => println!("{}: valid: {summary}", file.display()),
            Err(err) => {
                invalid = true;
                eprintln!("{}: {}", file.display(), ErrorChain(&err));
            }
        }
    }
    if invalid {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

// One thread: the worker waits on I/O; the CPU is better left to PostgreSQL and Redis.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // No transparent huge pages: the kernel backs a touched 2 MiB range of a huge-page region
    // with a whole huge page, so an idle worker held 6 MiB of heap (Kafka's 13) for under 1 of
    // data (docs/PERFORMANCE.md, idle cost). mimalloc is built without asking for them
    // (`no_thp`); this keeps them off where the node gives them to every region (`always`).
    // An error (a kernel without the option) changes nothing else.
    let _ = nix::sys::prctl::set_thp_disable(true);
    let cli = Cli::parse();
    // Two rustls providers are linked (see Cargo.toml); an error only means one is installed.
    // Before anything builds a TLS client (the trace exporter's too).
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The dlq, send and lint commands print for people and scripts on stdout, where the log would go.
    let traces = if matches!(
        cli.command,
        Command::Dlq(_) | Command::Send { .. } | Command::Lint { .. }
    ) {
        Traces::default()
    } else {
        match init_tracing(cli.log_json, "switchboard-worker") {
            Ok(traces) => traces,
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::FAILURE;
            }
        }
    };
    let result = match cli.command {
        Command::Lint { files } => return lint_files(&files),
        Command::Migrate => migrate().await,
        Command::Dlq(command) => dlq::run(command).await,
        Command::Send { file, attributes } => send_stdin(SendOptions { file, attributes }).await,
        Command::Run {
            file,
            consumer,
            metrics_addr,
            shutdown_timeout,
            database_timeout,
            secrets_dir,
        } => {
            run(RunOptions {
                file,
                consumer,
                metrics_addr,
                shutdown_timeout,
                database_timeout,
                secrets_dir,
            })
            .await
        }
    };
    traces.shutdown().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %ErrorChain(&err), "fatal");
            eprintln!("error: {}", ErrorChain(&err));
            ExitCode::from(err.exit_code())
        }
    }
}
