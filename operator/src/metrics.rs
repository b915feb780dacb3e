//! Every metric the operator exports, registered in one place. Labels are bounded: an outcome or
//! an error category, never an object name.

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
        Self {
            registry,
            reconciliations,
            failures,
            reconcile_seconds,
            leader,
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
