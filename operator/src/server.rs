//! `/healthz`, `/readyz` and `/metrics` of the operator.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// What the probes report.
#[derive(Debug, Clone)]
pub struct Probes {
    pub metrics: Arc<Metrics>,
    /// Set once the schema is migrated and the Kubernetes client is configured; standby replicas
    /// are ready too (they take over without a restart).
    pub ready: Arc<AtomicBool>,
}

async fn readyz(State(probes): State<Probes>) -> impl IntoResponse {
    if probes.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

async fn metrics(State(probes): State<Probes>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        probes.metrics.encode(),
    )
}

/// Binds `addr` and serves until `stop` fires. Returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    probes: Probes,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(probes);
    let task = tokio::spawn(async move {
        let shutdown = async move { stop.cancelled().await };
        if let Err(err) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %err, "metrics server failed");
        }
    });
    Ok((bound, task))
}
