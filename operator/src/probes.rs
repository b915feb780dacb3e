//! What the operator reports on `/healthz`, `/readyz` and `/metrics`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::metrics::Metrics;

/// The operator's probes.
#[derive(Debug, Clone)]
pub struct OperatorProbes {
    pub metrics: Arc<Metrics>,
    /// Set once the schema is migrated and the Kubernetes client is configured; standby replicas
    /// are ready too (they take over without a restart).
    pub ready: Arc<AtomicBool>,
}

impl switchboard_telemetry::Probes for OperatorProbes {
    fn is_live(&self) -> bool {
        true
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    fn metrics(&self) -> String {
        self.metrics.encode()
    }
}
