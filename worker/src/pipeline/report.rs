//! Reporting: the queue's health read on its own task, kept in the gauges, and written every
//! [`REPORT_INTERVAL`] as this worker's report, which the operator turns into the adapter's
//! status.

use std::sync::Arc;
use std::time::SystemTime;

use switchboard_store::{Store, WorkerReport};
use switchboard_telemetry::ErrorChain;
use tokio::task::JoinHandle;

use super::{Pipeline, REPORT_INTERVAL};
use crate::health::{Dependency, Health};
use crate::metrics::Metrics;
use crate::transport::{QueueHealth, QueueProbe, Transport};

impl<T: Transport> Pipeline<T> {
    /// Reads the queue's health on its own task, so the gauges move while the loop waits on
    /// the database (or anything else); a second task reports the latest reading to the
    /// `worker_reports` table, which the operator turns into the adapter's status.
    pub(super) fn spawn_probe(&self) -> JoinHandle<()> {
        let mut probe = self.transport.probe();
        let interval = self.transport.maintenance_interval();
        let metrics = self.metrics.clone();
        let health = self.health.clone();
        let (latest, reading) = tokio::sync::watch::channel(None);
        let reporter = crate::task::spawn(report_queue_health(
            self.context.store.clone(),
            self.settings.adapter.clone(),
            self.settings.worker.clone(),
            reading,
            health.clone(),
        ));
        crate::task::spawn(async move {
            // Aborting the probe task drops the reporter with it.
            let _reporter = AbortOnDrop(reporter);
            loop {
                let queue = match probe.queue_health().await {
                    Ok(queue) => {
                        let waiting = queue.backlog.unwrap_or(0) + queue.pending.unwrap_or(0);
                        health.set_work_waiting(waiting > 0);
                        record_queue_health(&metrics, queue);
                        Some(queue)
                    }
                    // The loop reports broker outages; the gauges keep their last value.
                    Err(err) => {
                        tracing::debug!(error = %ErrorChain(&err), "queue health unavailable");
                        None
                    }
                };
                latest.send_replace(Some(queue));
                tokio::time::sleep(interval.min(REPORT_INTERVAL)).await;
            }
        })
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every [`REPORT_INTERVAL`], writes the probe's latest reading (`Some(None)`: the broker did not
/// answer) as this worker's report. A write that fails (the database is down) is skipped: the
/// report ages out and the operator says so.
async fn report_queue_health(
    store: Store,
    adapter: String,
    worker: String,
    mut reading: tokio::sync::watch::Receiver<Option<Option<QueueHealth>>>,
    health: Arc<Health>,
) {
    loop {
        let latest = *reading.borrow_and_update();
        if let Some(queue) = latest {
            let report = worker_report(&adapter, &worker, queue, &health);
            match tokio::time::timeout(REPORT_INTERVAL, store.report_worker(&report)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    tracing::debug!(error = %ErrorChain(&err), "cannot write the worker report")
                }
                Err(_) => tracing::debug!("writing the worker report timed out"),
            }
        }
        tokio::time::sleep(REPORT_INTERVAL).await;
    }
}

/// What this worker tells the operator: the queue's figures (`None` when the broker did not
/// answer) and whether its dependencies are up.
fn worker_report(
    adapter: &str,
    worker: &str,
    queue: Option<QueueHealth>,
    health: &Health,
) -> WorkerReport {
    let now = SystemTime::now();
    let queue = queue.unwrap_or_default();
    WorkerReport {
        adapter: adapter.to_owned(),
        worker: worker.to_owned(),
        reported_at: now,
        backlog: queue.backlog,
        pending: queue.pending,
        oldest_since: queue
            .oldest_pending_age
            .filter(|age| !age.is_zero())
            .and_then(|age| now.checked_sub(age)),
        dead_letters: queue.dead_letters,
        broker_up: health.is_up(Dependency::Broker),
        database_up: health.is_up(Dependency::Database),
    }
}

fn record_queue_health(metrics: &Metrics, queue: QueueHealth) {
    let gauge = |value: Option<u64>| i64::try_from(value.unwrap_or(0)).unwrap_or(i64::MAX);
    metrics.backlog.set(gauge(queue.backlog));
    metrics.pending.set(gauge(queue.pending));
    metrics
        .oldest_pending_age_seconds
        .set(queue.oldest_pending_age.unwrap_or_default().as_secs_f64());
    if let Some(dead_letters) = queue.dead_letters {
        metrics.dead_letters.set(gauge(Some(dead_letters)));
    }
    if let Some(age) = queue.oldest_dead_letter_age {
        metrics
            .oldest_dead_letter_age_seconds
            .set(age.as_secs_f64());
    }
}
