//! Switchboard's Kubernetes operator: turns each QueueAdapter into a worker Deployment (plus the
//! ConfigMap holding its manifest) and a row in the `adapters` table.
//!
//! A reconcile is a pipeline with a pure middle: validate → dereference Secrets → [`build`] →
//! server-side apply under one field manager with owner references → status with
//! `observedGeneration` and conditions. A finalizer guards only the `adapters` row, the one thing
//! Kubernetes cannot garbage-collect.

mod apply;
mod autoscaling;
pub mod build;
pub mod controller;
pub mod database_ca;
pub mod lease;
pub mod metrics;
pub mod mirror;
pub mod mounted;
pub mod pdb;
pub mod pod_template;
mod pods;
pub mod probes;
pub mod runtime;
pub mod status;
pub mod storage;
pub mod worker_traces;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kube::{Client, CustomResourceExt};
use switchboard_api::QueueAdapter;
use switchboard_store::{Store, StoreError};
pub use switchboard_telemetry::ErrorChain;

pub use crate::apply::operator_owns_replicas;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::build::WorkerSettings;
use crate::controller::{Context, run_controller};
use crate::lease::{LeaderElector, LeaseError, LeaseSettings};
use crate::metrics::Metrics;
use crate::mirror::MigratedStore;
use crate::probes::OperatorProbes;
use crate::storage::EventRetention;

/// The worker image used when neither the flag nor the spec names one: this operator's version.
pub const DEFAULT_WORKER_IMAGE: &str = concat!(
    "ghcr.io/switchboard/switchboard:",
    env!("CARGO_PKG_VERSION")
);

/// The QueueAdapter CustomResourceDefinition as YAML (what `crds/` and the chart hold).
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&QueueAdapter::crd())
}

/// Why the operator could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot serve metrics on {addr}")]
    Serve {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot use DATABASE_URL")]
    Database(#[source] StoreError),
    #[error("cannot configure the Kubernetes client (KUBECONFIG or in-cluster)")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Lease(#[from] LeaseError),
}

/// Options of `switchboard-operator run`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub worker: WorkerSettings,
    /// `None`: run without leader election (a single replica).
    pub leader_election: Option<LeaseSettings>,
    /// This process's name in Events.
    pub identity: String,
    pub metrics_addr: SocketAddr,
    pub database_url: String,
    /// How often every adapter is reconciled again without a change, and orphan rows swept.
    pub resync: std::time::Duration,
    /// How long dedup markers are kept; how often their partitions are maintained.
    pub events: EventRetention,
}

/// First SIGTERM/SIGINT cancels `shutdown`.
fn cancel_on_signal(shutdown: CancellationToken) -> Result<(), OperatorError> {
    let mut terminate = signal(SignalKind::terminate()).map_err(OperatorError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(OperatorError::Signals)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        tracing::info!("shutdown requested; finishing running reconciles");
        shutdown.cancel();
    });
    Ok(())
}

/// `switchboard-operator run`: reconciles QueueAdapters (as the leader, with leader election)
/// until SIGTERM, migrating the database when it is first reached.
pub async fn run(options: RunOptions) -> Result<(), OperatorError> {
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone())?;
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let probes = Arc::new(OperatorProbes {
        metrics: metrics.clone(),
        ready: ready.clone(),
    });
    let (bound, server) =
        switchboard_telemetry::serve(options.metrics_addr, probes, shutdown.clone())
            .await
            .map_err(|source| OperatorError::Serve {
                addr: options.metrics_addr,
                source,
            })?;
    tracing::info!(addr = %bound, "serving /healthz, /readyz and /metrics");

    // Connects lazily and migrates on first use: the Kubernetes side is reconciled even while
    // the database is down.
    let store = Store::connect(&options.database_url, 4, "switchboard-operator")
        .await
        .map_err(OperatorError::Database)?;
    let client = Client::try_default().await.map_err(OperatorError::Client)?;
    let ctx = Arc::new(
        Context::new(
            client.clone(),
            MigratedStore::new(store),
            options.worker,
            metrics.clone(),
            &options.identity,
            options.resync,
        )
        .with_event_retention(options.events),
    );
    ready.store(true, Ordering::Relaxed);

    let result = match options.leader_election {
        None => {
            metrics.leader.set(1);
            run_controller(ctx, shutdown.clone()).await;
            Ok(())
        }
        Some(settings) => {
            let elector = LeaderElector::new(client, settings);
            lead(elector, ctx, &metrics, &shutdown).await
        }
    };
    metrics.leader.set(0);
    shutdown.cancel();
    let _ = server.await;
    tracing::info!("exiting");
    result
}

/// Waits for the lease, then runs the controller while renewing it. On shutdown the controller
/// finishes first, then the lease is released; a lost lease stops the controller and fails.
async fn lead(
    mut elector: LeaderElector,
    ctx: Arc<Context>,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<(), OperatorError> {
    if !elector.acquire(shutdown).await? {
        return Ok(());
    }
    metrics.leader.set(1);
    let stop_controller = shutdown.child_token();
    let release = CancellationToken::new();
    let mut controller = tokio::spawn(run_controller(ctx, stop_controller.clone()));
    let hold = elector.hold(&release);
    tokio::pin!(hold);
    tokio::select! {
        held = &mut hold => {
            stop_controller.cancel();
            let _ = controller.await;
            held?;
        }
        _ = &mut controller => {
            release.cancel();
            hold.await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    const COMMITTED_CRD: &str = include_str!("../../crds/queueadapters.switchboard.dev.yaml");

    #[test]
    fn committed_crd_matches_the_api_types() {
        let generated = super::crd_yaml().expect("CRD renders");
        assert!(
            generated == COMMITTED_CRD,
            "crds/queueadapters.switchboard.dev.yaml is stale; regenerate it with \
             `cargo run -p switchboard-operator -- crd > crds/queueadapters.switchboard.dev.yaml`"
        );
    }
}
