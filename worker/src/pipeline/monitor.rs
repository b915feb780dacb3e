//! One dependency's health as the loop and its store tasks see it: backoff, readiness, the
//! `dependency_up` gauge, and one log line per state change (not per retry).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use switchboard_telemetry::{Backoff, ErrorChain};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::LIVENESS_SLACK;
use crate::health::{Dependency, Health};
use crate::metrics::Metrics;

#[derive(Debug, Default)]
struct OutageState {
    backoff: Backoff,
    down_since: Option<Instant>,
    up_since: Option<Instant>,
}

/// One dependency's health: backoff, readiness, the `dependency_up` gauge, and one log line
/// per state change (not per retry). Shared by the loop and the store tasks.
#[derive(Debug)]
pub(super) struct Monitor {
    pub(super) dependency: Dependency,
    /// Where it is (`host:port`, never credentials), in the lines that say it is down.
    endpoint: String,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    state: Mutex<OutageState>,
    /// Wakes the tasks waiting out a backoff when another one finds the dependency back.
    recovered: Notify,
}

impl Monitor {
    pub(super) fn new(
        dependency: Dependency,
        endpoint: String,
        health: Arc<Health>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            dependency,
            endpoint,
            health,
            metrics,
            state: Mutex::default(),
            recovered: Notify::new(),
        }
    }

    /// Whether the last attempt failed (an outage is going on).
    pub(super) fn is_down(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .down_since
            .is_some()
    }

    pub(super) fn up(&self) {
        self.health.set_up(self.dependency, true);
        self.metrics.set_up(self.dependency, true);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.backoff.reset();
        if state.down_since.is_some() || state.up_since.is_none() {
            state.up_since = Some(Instant::now());
        }
        if let Some(since) = state.down_since.take() {
            self.recovered.notify_waiters();
            tracing::info!(
                dependency = self.dependency.as_str(),
                endpoint = %self.endpoint,
                down_for = ?since.elapsed(),
                "dependency recovered"
            );
        }
    }

    /// Records a failure of an attempt begun at `attempted` and waits out the backoff, or
    /// until another task finds the dependency back. Returns `false` if shutdown interrupted
    /// it. An attempt begun before the last recovery (a concurrent task's stale failure) does
    /// not start a new outage.
    pub(super) async fn back_off(
        &self,
        err: &(dyn std::error::Error + Sync),
        attempted: Instant,
        cancel: &CancellationToken,
    ) -> bool {
        self.metrics.dependency_error(self.dependency);
        let delay = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let stale =
                state.down_since.is_none() && state.up_since.is_some_and(|up| up > attempted);
            if !stale {
                self.health
                    .set_down(self.dependency, &ErrorChain(err).to_string());
                self.metrics.set_up(self.dependency, false);
                if state.down_since.is_none() {
                    state.down_since = Some(Instant::now());
                    tracing::warn!(
                        dependency = self.dependency.as_str(),
                        endpoint = %self.endpoint,
                        error = %ErrorChain(err),
                        "dependency unavailable; retrying with backoff"
                    );
                }
            }
            state.backoff.next_delay()
        };
        self.health.beat(delay + LIVENESS_SLACK);
        tokio::select! {
            () = cancel.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
            () = self.recovered.notified() => true,
        }
    }
}
