//! What the worker and the operator share about being observed: logging set-up, an error's
//! whole cause chain for log fields, the `/healthz`, `/readyz`, `/metrics` server, the
//! one [`Backoff`] of every retry, and the helpers that register [`metrics`].

mod backoff;
pub mod metrics;
pub mod traces;

pub use backoff::{Backoff, Jitter};
pub use traces::{Traces, TracesError};

use std::error::Error;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Displays an error with its whole `source()` chain, `outer: inner: …`. A cause whose text
/// the error before it already ends with (client libraries that print their source in their
/// own message) is not repeated.
pub struct ErrorChain<'a>(pub &'a dyn Error);

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut previous = self.0.to_string();
        f.write_str(&previous)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            let text = err.to_string();
            if !previous.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            previous = text;
            source = err.source();
        }
        Ok(())
    }
}

/// Sets up logging and, when the standard `OTEL_*` environment configures an exporter, traces
/// (see [`traces`]; `service` is the default `service.name`). Logging: `RUST_LOG` filters
/// (default `info`); JSON lines when `json`; colours only on a terminal. Unless `RUST_LOG`
/// names them, lapin's own lines are off (it logs every AMQP failure that it also returns, and
/// the caller logs an outage once) and async-nats' are warnings only (its `event: connected`
/// lines, on its own task, repeat the worker's). Must be called inside the Tokio runtime.
pub fn init_tracing(json: bool, service: &'static str) -> Result<Traces, TracesError> {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let rust_log = std::env::var("RUST_LOG").unwrap_or_default();
    for (library, directive) in [("lapin", "lapin=off"), ("async_nats", "async_nats=warn")] {
        if !rust_log.contains(library)
            && let Ok(directive) = directive.parse()
        {
            filter = filter.add_directive(directive);
        }
    }
    let (traces, exporting) = match traces::layer(service)? {
        Some((traces, layer)) => (traces, Some(layer)),
        None => (Traces::default(), None),
    };
    if exporting.is_some()
        && let Ok(directive) = format!("{}=info", traces::SPAN_TARGET).parse()
    {
        // The exported spans, whatever RUST_LOG says of the logs.
        filter = filter.add_directive(directive);
    }
    let log = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    let log = if json {
        log.json().boxed()
    } else {
        log.boxed()
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(log)
        .with(exporting)
        .init();
    Ok(traces)
}

/// The Prometheus text exposition (OpenMetrics) of a registry.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// What a process reports to its probes and scrapers.
pub trait Probes: Send + Sync + 'static {
    /// `/healthz`: `false` only when the process is stuck and should be restarted.
    fn is_live(&self) -> bool;
    /// `/readyz`: whether the process can do its work now.
    fn is_ready(&self) -> bool;
    /// What `/readyz` says while not ready: what is wrong (which dependency, its last error).
    fn not_ready_because(&self) -> String {
        "not ready".to_owned()
    }
    /// `/metrics`: the OpenMetrics text.
    fn metrics(&self) -> String;
}

type SharedProbes = Arc<dyn Probes>;

async fn healthz(State(probes): State<SharedProbes>) -> impl IntoResponse {
    if probes.is_live() {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "stuck\n")
    }
}

async fn readyz(State(probes): State<SharedProbes>) -> impl IntoResponse {
    if probes.is_ready() {
        (StatusCode::OK, "ready\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", probes.not_ready_because()),
        )
    }
}

async fn metrics(State(probes): State<SharedProbes>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        probes.metrics(),
    )
}

/// Binds `addr` and serves `/healthz`, `/readyz` and `/metrics` until `stop` is cancelled.
/// Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    probes: Arc<dyn Probes>,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(probes);
    let task = tokio::spawn(async move {
        let shutdown = async move { stop.cancelled().await };
        if let Err(err) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %err, "probe server failed");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_joins_every_source() {
        let outer = Wrapped(std::io::Error::other("disk full"));
        assert_eq!(ErrorChain(&outer).to_string(), "writing failed: disk full");
    }

    #[test]
    fn error_chain_does_not_repeat_a_cause_its_error_already_shows() {
        let outer = Wrapped(std::io::Error::other(Repeating(std::io::Error::other(
            "disk full",
        ))));
        assert_eq!(
            ErrorChain(&outer).to_string(),
            "writing failed: flush: disk full"
        );
    }

    /// Prints its source in its own message, as sqlx and redis errors do.
    #[derive(Debug)]
    struct Repeating(std::io::Error);

    impl fmt::Display for Repeating {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "flush: {}", self.0)
        }
    }

    impl Error for Repeating {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl fmt::Display for Wrapped {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("writing failed")
        }
    }

    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }
}
