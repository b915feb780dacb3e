//! Rows whose QueueAdapter is gone: an adapter deleted while the operator was down, or whose
//! finalizer was removed by hand, leaves its `adapters` row behind, and no reconcile will ever
//! run for it. Swept when the controller starts and then every resync interval.

use std::collections::HashSet;
use std::time::Duration;

use kube::api::ListParams;
use kube::{Api, Client};
use switchboard_api::QueueAdapter;
use switchboard_store::Store;
use tokio_util::sync::CancellationToken;

use crate::ErrorChain;

/// Deletes orphan rows now and every `every` until `stop` fires.
pub async fn remove_orphan_rows(
    client: Client,
    store: Store,
    every: Duration,
    stop: CancellationToken,
) {
    loop {
        match sweep(&client, &store).await {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(
                    deleted,
                    "deleted the adapters rows of QueueAdapters that are gone"
                )
            }
            Err(err) => {
                tracing::warn!(error = %ErrorChain(err.as_ref()), "cannot remove orphan adapters rows; retrying at the next resync")
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

/// Deletes the rows whose QueueAdapter is not listed. The rows are read before the list, and
/// a row is deleted only while it still has the uid read: an adapter created meanwhile is
/// either listed or has rewritten its row.
async fn sweep(client: &Client, store: &Store) -> anyhow::Result<u64> {
    let rows = store.queue_adapter_uids().await?;
    let names: HashSet<String> = Api::<QueueAdapter>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(QueueAdapter::adapter_name)
        .collect();
    let mut deleted = 0;
    for (name, uid) in rows.iter().filter(|(name, _)| !names.contains(name)) {
        if store.delete_adapter_of(name, uid.as_deref()).await? {
            deleted += 1;
        }
    }
    Ok(deleted)
}
