//! The `adapters` mirror's database: migrated on first use, so that the operator starts, and
//! reconciles the Kubernetes side, while PostgreSQL is down; the rows catch up once it is back.
//!
//! Rows whose QueueAdapter is gone: an adapter deleted while the operator was down, or whose
//! finalizer was removed by hand, leaves its `adapters` row behind, and no reconcile will ever
//! run for it. Swept when the controller starts and then every resync interval.

use std::collections::HashSet;
use std::time::Duration;

use kube::api::ListParams;
use kube::{Api, Client};
use std::sync::Arc;
use switchboard_api::QueueAdapter;

use switchboard_store::{Store, StoreError};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::ErrorChain;

/// The store, migrated the first time the mirror needs it (one attempt per use until one
/// succeeds).
#[derive(Clone)]
pub struct MigratedStore {
    store: Store,
    migrated: Arc<OnceCell<()>>,
}

impl MigratedStore {
    pub fn new(store: Store) -> Self {
        Self {
            store,
            migrated: Arc::default(),
        }
    }

    /// The store once migrations are applied; an error while the database cannot be reached.
    pub async fn migrated(&self) -> Result<&Store, StoreError> {
        let store = self.store.clone();
        self.migrated.get_or_try_init(|| migrate(store)).await?;
        Ok(&self.store)
    }

    /// The store whether or not it is migrated yet (the workers' reports, which workers write
    /// only into a migrated database).
    pub fn unmigrated(&self) -> &Store {
        &self.store
    }
}

/// Applies the migrations. sqlx's migration future is not `Send` for every lifetime, which a
/// reconcile must be: it runs on a blocking thread of its own.
async fn migrate(store: Store) -> Result<(), StoreError> {
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || runtime.block_on(store.migrate()))
        .await
        .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked.into_panic()))?;
    tracing::info!("database migrations applied");
    Ok(())
}

/// Deletes orphan rows now and every `every` until `stop` fires.
pub async fn remove_orphan_rows(
    client: Client,
    store: MigratedStore,
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
async fn sweep(client: &Client, store: &MigratedStore) -> anyhow::Result<u64> {
    let store = store.migrated().await?;
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
