//! Every metric the operator exports, registered in one place. Labels are bounded: an outcome,
//! an error category, or a QueueAdapter that exists (its series are removed with it), never
//! another object's name.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use switchboard_telemetry::metrics::{create_series, register};

/// How a reconcile ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconcileOutcome {
    /// The worker objects were applied and the status written (or found current).
    Applied,
    /// The adapter cannot run as it is; waiting for a change.
    Blocked,
    /// The adapter was deleted and its row removed.
    CleanedUp,
    /// A transient failure, retried with backoff.
    Failed,
}

impl ReconcileOutcome {
    const ALL: [Self; 4] = [Self::Applied, Self::Blocked, Self::CleanedUp, Self::Failed];

    fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Blocked => "blocked",
            Self::CleanedUp => "cleaned_up",
            Self::Failed => "failed",
        }
    }
}

/// What a failed reconcile failed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCategory {
    Kubernetes,
    Database,
    Build,
}

impl ErrorCategory {
    const ALL: [Self; 3] = [Self::Kubernetes, Self::Database, Self::Build];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kubernetes => "kubernetes",
            Self::Database => "database",
            Self::Build => "build",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

impl OutcomeLabels {
    fn of(outcome: ReconcileOutcome) -> Self {
        Self {
            outcome: outcome.as_str(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdapterLabels {
    adapter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkersLabels {
    adapter: String,
    state: &'static str,
}

/// What the operator last saw of an adapter's worker Deployment: pods wanted and pods available.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workers {
    pub desired: i32,
    pub available: i32,
}

impl Workers {
    const STATES: [&'static str; 2] = ["desired", "available"];

    fn labels(adapter: &str) -> [WorkersLabels; 2] {
        Self::STATES.map(|state| WorkersLabels {
            adapter: adapter.to_owned(),
            state,
        })
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CategoryLabels {
    category: &'static str,
}

impl CategoryLabels {
    fn of(category: ErrorCategory) -> Self {
        Self {
            category: category.as_str(),
        }
    }
}

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciliations: Family<OutcomeLabels, Counter>,
    failures: Family<CategoryLabels, Counter>,
    pub reconcile_seconds: Histogram,
    pub leader: Gauge,
    workers: Family<WorkersLabels, Gauge>,
    ready: Family<AdapterLabels, Gauge>,
    event_partitions: Gauge,
    events_maintained: Gauge,
    events_maintenance_failures: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchboard_operator");
        let r = &mut registry;
        let reconciliations = register(
            r,
            "reconciliations",
            "QueueAdapter reconciliations, by outcome",
            Family::default(),
        );
        create_series(
            &reconciliations,
            ReconcileOutcome::ALL.map(OutcomeLabels::of),
        );
        let failures = register(
            r,
            "reconcile_failures",
            "Failed QueueAdapter reconciliations, by what failed",
            Family::default(),
        );
        create_series(&failures, ErrorCategory::ALL.map(CategoryLabels::of));
        let reconcile_seconds = register(
            r,
            "reconcile_duration_seconds",
            "Time one QueueAdapter reconciliation took",
            Histogram::new(exponential_buckets(0.001, 2.0, 16)),
        );
        let leader = register(
            r,
            "leader",
            "1 while this process holds the leader lease (or runs without leader election)",
            Gauge::default(),
        );
        let workers = register(
            r,
            "adapter_workers",
            "Worker pods of a QueueAdapter, as its Deployment says: desired (spec.replicas) and \
             available (status.availableReplicas); absent while the operator cannot apply it",
            Family::default(),
        );
        let ready = register(
            r,
            "adapter_ready",
            "1 while the QueueAdapter's Ready condition is True, else 0",
            Family::default(),
        );
        let event_partitions = register(
            r,
            "event_partitions",
            "Partitions of the events table after the last maintenance run",
            Gauge::default(),
        );
        let events_maintained = register(
            r,
            "events_maintained_timestamp_seconds",
            "When the events partitions were last maintained (Unix time); 0 before the first run",
            Gauge::default(),
        );
        let events_maintenance_failures = register(
            r,
            "events_maintenance_failures",
            "Runs of the events partitions' maintenance that failed",
            Counter::default(),
        );
        Self {
            registry,
            reconciliations,
            failures,
            reconcile_seconds,
            leader,
            workers,
            ready,
            event_partitions,
            events_maintained,
            events_maintenance_failures,
        }
    }

    /// Records a successful maintenance run of the events partitions.
    pub fn events_maintained(&self, partitions: usize) {
        self.event_partitions
            .set(i64::try_from(partitions).unwrap_or(i64::MAX));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        self.events_maintained
            .set(i64::try_from(now).unwrap_or(i64::MAX));
    }

    /// Records a failed maintenance run of the events partitions.
    pub fn events_maintenance_failed(&self) {
        self.events_maintenance_failures.inc();
    }

    /// Records whether `adapter`'s Ready condition is True.
    pub fn adapter_ready(&self, adapter: &str, ready: bool) {
        self.ready
            .get_or_create(&AdapterLabels {
                adapter: adapter.to_owned(),
            })
            .set(i64::from(ready));
    }

    /// Records `adapter`'s workers; `None` (unknown: the adapter is blocked, its Deployment not
    /// applied) removes their series.
    pub fn adapter_workers(&self, adapter: &str, workers: Option<Workers>) {
        let [desired, available] = Workers::labels(adapter);
        match workers {
            Some(workers) => {
                self.workers
                    .get_or_create(&desired)
                    .set(i64::from(workers.desired));
                self.workers
                    .get_or_create(&available)
                    .set(i64::from(workers.available));
            }
            None => {
                self.workers.remove(&desired);
                self.workers.remove(&available);
            }
        }
    }

    /// Removes the series of a deleted adapter.
    pub fn adapter_deleted(&self, adapter: &str) {
        self.ready.remove(&AdapterLabels {
            adapter: adapter.to_owned(),
        });
        for labels in Workers::labels(adapter) {
            self.workers.remove(&labels);
        }
    }

    pub fn reconciled(&self, outcome: ReconcileOutcome) {
        self.reconciliations
            .get_or_create(&OutcomeLabels::of(outcome))
            .inc();
    }

    pub fn failed(&self, category: ErrorCategory) {
        self.reconciled(ReconcileOutcome::Failed);
        self.failures
            .get_or_create(&CategoryLabels::of(category))
            .inc();
    }

    /// The Prometheus text exposition (OpenMetrics).
    pub fn encode(&self) -> String {
        switchboard_telemetry::encode(&self.registry)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_series_follow_the_adapter_and_go_with_it() {
        let metrics = Metrics::new();
        let workers = Workers {
            desired: 2,
            available: 1,
        };
        metrics.adapter_ready("shop/orders", false);
        metrics.adapter_workers("shop/orders", Some(workers));
        let text = metrics.encode();
        for line in [
            r#"switchboard_operator_adapter_ready{adapter="shop/orders"} 0"#,
            r#"switchboard_operator_adapter_workers{adapter="shop/orders",state="desired"} 2"#,
            r#"switchboard_operator_adapter_workers{adapter="shop/orders",state="available"} 1"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        metrics.adapter_workers("shop/orders", None);
        let text = metrics.encode();
        assert!(!text.contains("adapter_workers{"), "{text}");
        metrics.adapter_ready("shop/orders", true);
        assert!(
            metrics
                .encode()
                .contains(r#"switchboard_operator_adapter_ready{adapter="shop/orders"} 1"#)
        );
        metrics.adapter_deleted("shop/orders");
        let text = metrics.encode();
        assert!(!text.contains("shop/orders"), "{text}");
    }
}
