//! The events table's time partitions, maintained by the leader: created ahead of time,
//! dropped once the dedup window has passed them ([`Store::maintain_events`]). A failed run
//! never stops ingestion (a worker creates the partition it needs); it is retried at the next.

use std::sync::Arc;
use std::time::Duration;

use switchboard_store::{Maintained, StoreError};
use tokio_util::sync::CancellationToken;

use crate::ErrorChain;
use crate::metrics::Metrics;
use crate::mirror::MigratedStore;

/// How long dedup markers are kept, and how often the partitions are maintained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRetention {
    /// The dedup window in days, unless an adapter's `spec.delivery.dedupWindowDays` asks for
    /// longer (the events table is shared: the longest window is kept).
    pub window_days: u32,
    pub every: Duration,
}

impl Default for EventRetention {
    fn default() -> Self {
        Self {
            window_days: DEFAULT_DEDUP_WINDOW_DAYS,
            every: Duration::from_secs(3600),
        }
    }
}

/// The dedup window unless configured otherwise: longer than SQS's longest retention (14
/// days), within the 7–30 days the delivery contract asks for.
pub const DEFAULT_DEDUP_WINDOW_DAYS: u32 = 30;

/// Partitions created ahead of the current one: maintenance may fail this long (days, with the
/// default interval) before an ingest has to create its partition itself.
const AHEAD: u32 = 3;

/// Maintains the partitions now and every `retention.every` until `stop` fires.
pub async fn maintain_event_partitions(
    store: MigratedStore,
    retention: EventRetention,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    loop {
        // sqlx's futures are not `Send` for every lifetime, which a spawned task's must be:
        // each run goes on a blocking thread of its own (as the migration does).
        let runtime = tokio::runtime::Handle::current();
        let run = {
            let store = store.clone();
            tokio::task::spawn_blocking(move || runtime.block_on(maintain(&store, retention)))
        };
        let run = run
            .await
            .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked.into_panic()));
        match run {
            Ok((window_days, done, partitions)) => {
                metrics.events_maintained(partitions);
                if done != Maintained::default() {
                    tracing::info!(
                        window_days,
                        created = ?done.created,
                        dropped = ?done.dropped,
                        emptied_unpartitioned = done.emptied_unpartitioned,
                        rotated_keys = done.rotated_keys,
                        "maintained the events partitions"
                    );
                }
            }
            Err(err) => {
                metrics.events_maintenance_failed();
                tracing::warn!(error = %ErrorChain(&err), every = ?retention.every, "cannot maintain the events partitions; ingestion goes on, retrying at the next run");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(retention.every) => {}
        }
    }
}

/// One run: the window in days, what was done, how many partitions there are now.
async fn maintain(
    store: &MigratedStore,
    retention: EventRetention,
) -> Result<(u32, Maintained, usize), StoreError> {
    let store = store.migrated().await?;
    let days = store
        .longest_dedup_window_days()
        .await?
        .map_or(retention.window_days, |days| {
            days.max(retention.window_days)
        });
    let window = Duration::from_secs(u64::from(days) * 86_400);
    let done = store.maintain_events(window, AHEAD).await?;
    let partitions = store.event_partitions().await?.len();
    Ok((days, done, partitions))
}
