//! The status a reconcile reports, computed without I/O from what it observed. Conditions keep
//! their `lastTransitionTime` while their status stays the same, so an unchanged world yields an
//! identical status and nothing is written.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use switchboard_api::{QueueAdapter, QueueAdapterStatus};

pub const READY: &str = "Ready";
pub const RECONCILED: &str = "Reconciled";
pub const DEGRADED: &str = "Degraded";

/// What one reconcile achieved.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    /// The worker objects were applied; the Deployment as the API server returned it.
    Applied(&'a Deployment),
    /// The adapter cannot run as it is (invalid spec, missing Secret): waits for a change.
    Blocked { reason: &'a str, message: &'a str },
    /// A transient failure, retried with backoff.
    Failed { reason: &'a str, message: &'a str },
}

struct Verdict<'a> {
    status: &'static str,
    reason: &'a str,
    message: String,
}

impl<'a> Verdict<'a> {
    fn new(status: bool, reason: &'a str, message: impl Into<String>) -> Self {
        Self {
            status: if status { "True" } else { "False" },
            reason,
            message: message.into(),
        }
    }
}

fn deployment_ready(deployment: &Deployment, enabled: bool) -> Verdict<'static> {
    let desired = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let status = deployment.status.clone().unwrap_or_default();
    let available = status.available_replicas.unwrap_or(0);
    if !enabled {
        return Verdict::new(
            false,
            "Disabled",
            "spec.enabled is false: the worker is scaled to zero",
        );
    }
    if desired == 0 {
        return Verdict::new(false, "ScaledToZero", "spec.workload.replicas is 0");
    }
    let current =
        status.observed_generation.unwrap_or(0) >= deployment.metadata.generation.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0) >= desired;
    let message = format!("{available}/{desired} worker pods available");
    if current && updated && available >= desired {
        Verdict::new(true, "Available", message)
    } else {
        Verdict::new(false, "Progressing", message)
    }
}

fn deployment_degraded(deployment: &Deployment) -> Verdict<'_> {
    let conditions = deployment
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let failing = conditions.iter().find(|c| {
        (c.type_ == "ReplicaFailure" && c.status == "True")
            || (c.type_ == "Progressing" && c.status == "False")
    });
    match failing {
        Some(c) => Verdict::new(
            true,
            c.reason.as_deref().unwrap_or(c.type_.as_str()),
            c.message.clone().unwrap_or_default(),
        ),
        None => Verdict::new(
            false,
            "AsExpected",
            "the worker Deployment reports no failure",
        ),
    }
}

fn condition(
    previous: Option<&QueueAdapterStatus>,
    type_: &str,
    verdict: Verdict<'_>,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    let last = previous.and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    let last_transition_time = match last {
        Some(c) if c.status == verdict.status => c.last_transition_time.clone(),
        _ => now.clone(),
    };
    Condition {
        type_: type_.to_owned(),
        status: verdict.status.to_owned(),
        reason: verdict.reason.to_owned(),
        message: verdict.message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// The status `adapter` should have after `outcome`, at time `now`.
pub fn desired_status(
    adapter: &QueueAdapter,
    outcome: Outcome<'_>,
    now: &Time,
) -> QueueAdapterStatus {
    let previous = adapter.status.as_ref();
    let generation = adapter.metadata.generation;
    let broker = adapter.spec.source.broker();
    let mut ready_replicas = previous.and_then(|s| s.ready_replicas);
    let (ready, reconciled, degraded) = match outcome {
        Outcome::Applied(deployment) => {
            ready_replicas = Some(
                deployment
                    .status
                    .as_ref()
                    .and_then(|s| s.ready_replicas)
                    .unwrap_or(0),
            );
            (
                Some(deployment_ready(deployment, adapter.spec.enabled)),
                Verdict::new(true, "Applied", "the worker Deployment matches the spec"),
                deployment_degraded(deployment),
            )
        }
        Outcome::Blocked { reason, message } => (
            Some(Verdict::new(false, reason, message)),
            Verdict::new(false, reason, message),
            Verdict::new(true, reason, message),
        ),
        Outcome::Failed { reason, message } => (
            None,
            Verdict::new(false, reason, message),
            Verdict::new(true, reason, message),
        ),
    };
    let ready = match ready {
        Some(verdict) => condition(previous, READY, verdict, generation, now),
        None => previous
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == READY).cloned())
            .unwrap_or_else(|| {
                condition(
                    previous,
                    READY,
                    Verdict {
                        status: "Unknown",
                        reason: "Reconciling",
                        message: "the worker has not been applied yet".to_owned(),
                    },
                    generation,
                    now,
                )
            }),
    };
    QueueAdapterStatus {
        observed_generation: generation,
        conditions: vec![
            ready,
            condition(previous, RECONCILED, reconciled, generation, now),
            condition(previous, DEGRADED, degraded, generation, now),
        ],
        ready_replicas,
        delivery_guarantee: broker.map(|b| b.guarantee().as_str().to_owned()),
        source: broker.map(|b| b.kind().to_owned()),
        mode: broker.map(|b| b.mode().to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStatus};
    use k8s_openapi::jiff::Timestamp;

    const ORDERS: &str = include_str!("../fixtures/orders-stream.yaml");

    fn adapter() -> QueueAdapter {
        serde_yaml_ng::from_str(ORDERS).expect("fixture parses")
    }

    fn deployment(generation: i64, observed: i64, available: i32) -> Deployment {
        Deployment {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                generation: Some(generation),
                ..Default::default()
            },
            spec: Some(DeploymentSpec {
                replicas: Some(2),
                ..Default::default()
            }),
            status: Some(DeploymentStatus {
                observed_generation: Some(observed),
                updated_replicas: Some(2),
                available_replicas: Some(available),
                ready_replicas: Some(available),
                ..Default::default()
            }),
        }
    }

    fn time(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).expect("valid time"))
    }

    fn get<'a>(status: &'a QueueAdapterStatus, type_: &str) -> &'a Condition {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("condition")
    }

    #[test]
    fn available_deployment_makes_the_adapter_ready_at_its_generation() {
        let status = desired_status(
            &adapter(),
            Outcome::Applied(&deployment(3, 3, 2)),
            &time(10),
        );
        assert_eq!(status.observed_generation, Some(1));
        assert_eq!(get(&status, READY).status, "True");
        assert_eq!(get(&status, RECONCILED).status, "True");
        assert_eq!(get(&status, DEGRADED).status, "False");
        assert_eq!(status.ready_replicas, Some(2));
        assert_eq!(status.delivery_guarantee.as_deref(), Some("at-least-once"));
        assert_eq!(
            (status.source.as_deref(), status.mode.as_deref()),
            (Some("redis"), Some("stream"))
        );
    }

    #[test]
    fn deployment_not_yet_observed_is_not_ready() {
        let status = desired_status(
            &adapter(),
            Outcome::Applied(&deployment(3, 2, 2)),
            &time(10),
        );
        assert_eq!(get(&status, READY).status, "False");
        assert_eq!(get(&status, READY).reason, "Progressing");
    }

    #[test]
    fn recomputing_an_unchanged_world_gives_an_identical_status() {
        let mut adapter = adapter();
        let first = desired_status(&adapter, Outcome::Applied(&deployment(1, 1, 2)), &time(10));
        adapter.status = Some(first.clone());
        let second = desired_status(&adapter, Outcome::Applied(&deployment(1, 1, 2)), &time(99));
        assert_eq!(first, second);
    }

    #[test]
    fn transient_failure_keeps_ready_and_marks_degraded() {
        let mut adapter = adapter();
        adapter.status = Some(desired_status(
            &adapter,
            Outcome::Applied(&deployment(1, 1, 2)),
            &time(10),
        ));
        let failed = Outcome::Failed {
            reason: "DatabaseUnavailable",
            message: "connection refused",
        };
        let status = desired_status(&adapter, failed, &time(20));
        assert_eq!(get(&status, READY).status, "True");
        assert_eq!(get(&status, READY).last_transition_time, time(10));
        assert_eq!(get(&status, RECONCILED).status, "False");
        let degraded = get(&status, DEGRADED);
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "DatabaseUnavailable")
        );
        assert_eq!(degraded.last_transition_time, time(20));
    }

    #[test]
    fn blocked_adapter_is_not_ready_and_says_why() {
        let blocked = Outcome::Blocked {
            reason: "SecretNotFound",
            message: "Secret shop/redis not found",
        };
        let status = desired_status(&adapter(), blocked, &time(10));
        for type_ in [READY, RECONCILED] {
            assert_eq!(get(&status, type_).status, "False");
            assert_eq!(get(&status, type_).reason, "SecretNotFound");
        }
        assert_eq!(get(&status, DEGRADED).status, "True");
    }
}
