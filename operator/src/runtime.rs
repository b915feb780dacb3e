//! The runtime part of every adapter's status: every few seconds, the workers' fresh reports
//! (the `worker_reports` table) become `status.observed` and the `BrokerConnected`,
//! `DatabaseReachable`, `Backlogged` and `DeadLettering` conditions. A status is written only
//! when it changed, and only over the version it was computed from. Reports of workers gone for
//! long are deleted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store as Cache;
use kube::{Api, Client, Resource, ResourceExt};
use switchboard_api::QueueAdapter;
use switchboard_store::{Store, WorkerReport};
use tokio_util::sync::CancellationToken;

use crate::ErrorChain;
use crate::build::FIELD_MANAGER;
use crate::status::{Runtime, with_runtime};

/// How often the statuses are refreshed: the workers' report interval.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(5);
/// A report older than this is a worker that stopped (three missed reports).
pub const FRESH_FOR: Duration = Duration::from_secs(15);
/// Reports older than this are deleted.
const DELETE_AFTER: Duration = Duration::from_secs(600);

/// Refreshes the runtime status of every adapter in `cache` until `stop` fires.
pub async fn refresh_runtime_status(
    client: Client,
    store: Store,
    cache: Cache<QueueAdapter>,
    stop: CancellationToken,
) {
    let mut last_cleanup: Option<Instant> = None;
    let mut unreachable_logged = false;
    loop {
        let reports = store.fresh_worker_reports(FRESH_FOR).await;
        match &reports {
            Err(err) if !unreachable_logged => {
                tracing::warn!(error = %ErrorChain(err), "cannot read the workers' reports; statuses say DatabaseReachable=False");
                unreachable_logged = true;
            }
            Ok(_) if unreachable_logged => {
                tracing::info!("the workers' reports can be read again");
                unreachable_logged = false;
            }
            _ => {}
        }
        let by_adapter = reports.as_ref().map(|reports| group(reports));
        let error = reports
            .as_ref()
            .err()
            .map(|err| ErrorChain(err).to_string());
        for adapter in cache.state() {
            if adapter.meta().deletion_timestamp.is_some() {
                continue;
            }
            let runtime = match (&by_adapter, &error) {
                (Ok(groups), _) => Runtime::Reports(
                    groups
                        .get(adapter.adapter_name().as_str())
                        .map_or(&[][..], Vec::as_slice),
                ),
                (Err(_), message) => {
                    Runtime::DatabaseUnreachable(message.as_deref().unwrap_or_default())
                }
            };
            write_if_changed(&client, &adapter, runtime).await;
        }
        if by_adapter.is_ok() && last_cleanup.is_none_or(|at| at.elapsed() >= DELETE_AFTER) {
            match store.delete_stale_worker_reports(DELETE_AFTER).await {
                Ok(deleted) if deleted > 0 => {
                    tracing::info!(deleted, "deleted the reports of workers gone for 10 min")
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(error = %ErrorChain(&err), "cannot delete stale reports")
                }
            }
            last_cleanup = Some(Instant::now());
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REFRESH_INTERVAL) => {}
        }
    }
}

/// The reports by adapter (`namespace/name`).
fn group(reports: &[WorkerReport]) -> HashMap<&str, Vec<WorkerReport>> {
    let mut groups: HashMap<&str, Vec<WorkerReport>> = HashMap::new();
    for report in reports {
        groups
            .entry(report.adapter.as_str())
            .or_default()
            .push(report.clone());
    }
    groups
}

/// Writes `adapter`'s status with `runtime`, unless it already says that. The write carries the
/// resource version the status was computed from: if a reconcile wrote in between, it is
/// refused and the next refresh starts from the newer status.
async fn write_if_changed(client: &Client, adapter: &QueueAdapter, runtime: Runtime<'_>) {
    let status = with_runtime(adapter, runtime, &Time(Timestamp::now()));
    if adapter.status.as_ref() == Some(&status) {
        return;
    }
    let patch = serde_json::json!({
        "apiVersion": QueueAdapter::api_version(&()),
        "kind": QueueAdapter::kind(&()),
        "metadata": {"resourceVersion": adapter.resource_version()},
        "status": status,
    });
    let namespace = adapter.namespace().unwrap_or_else(|| "default".to_owned());
    let result = Api::<QueueAdapter>::namespaced(client.clone(), &namespace)
        .patch_status(
            &adapter.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await;
    match result {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 || status.is_not_found() => {}
        Err(err) => {
            tracing::debug!(adapter = %adapter.adapter_name(), error = %ErrorChain(&err), "cannot write the runtime status")
        }
    }
}
