//! Every metric the operator exports, registered in one place. Labels are bounded: an outcome or
//! an error category, never an object name.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CategoryLabels {
    category: &'static str,
}

/// The operator's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciliations: Family<OutcomeLabels, Counter>,
    failures: Family<CategoryLabels, Counter>,
    pub reconcile_seconds: Histogram,
    pub leader: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("switchboard_operator");
        let reconciliations = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "reconciliations",
            "QueueAdapter reconciliations, by outcome",
            reconciliations.clone(),
        );
        let failures = Family::<CategoryLabels, Counter>::default();
        registry.register(
            "reconcile_failures",
            "Failed QueueAdapter reconciliations, by what failed",
            failures.clone(),
        );
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "reconcile_duration_seconds",
            "Time one QueueAdapter reconciliation took",
            reconcile_seconds.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this process holds the leader lease (or runs without leader election)",
            leader.clone(),
        );
        let metrics = Self {
            registry,
            reconciliations,
            failures,
            reconcile_seconds,
            leader,
        };
        for outcome in ReconcileOutcome::ALL {
            metrics.outcome_counter(outcome);
        }
        for category in ErrorCategory::ALL {
            metrics.failure_counter(category);
        }
        metrics
    }

    fn outcome_counter(&self, outcome: ReconcileOutcome) -> Counter {
        self.reconciliations
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .clone()
    }

    fn failure_counter(&self, category: ErrorCategory) -> Counter {
        self.failures
            .get_or_create(&CategoryLabels {
                category: category.as_str(),
            })
            .clone()
    }

    pub fn reconciled(&self, outcome: ReconcileOutcome) {
        self.outcome_counter(outcome).inc();
    }

    pub fn failed(&self, category: ErrorCategory) {
        self.reconciled(ReconcileOutcome::Failed);
        self.failure_counter(category).inc();
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
