//! The status a reconcile reports, and the runtime part the workers' reports give, computed
//! without I/O from what was observed. Conditions keep their `lastTransitionTime` while their
//! status stays the same, so an unchanged world yields an identical status and nothing is
//! written.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use switchboard_api::{ObservedQueue, QueueAdapter, QueueAdapterStatus};
use switchboard_store::WorkerReport;

use crate::metrics::Workers;

pub const READY: &str = "Ready";
pub const RECONCILED: &str = "Reconciled";
pub const DEGRADED: &str = "Degraded";
pub const BROKER_CONNECTED: &str = "BrokerConnected";
pub const DATABASE_REACHABLE: &str = "DatabaseReachable";
pub const BACKLOGGED: &str = "Backlogged";
pub const DEAD_LETTERING: &str = "DeadLettering";

/// The conditions the workers' reports decide (the rest are the reconcile's).
const RUNTIME_CONDITIONS: [&str; 4] = [
    BROKER_CONNECTED,
    DATABASE_REACHABLE,
    BACKLOGGED,
    DEAD_LETTERING,
];

/// What one reconcile achieved.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    /// The worker objects were applied; the Deployment as the API server returned it.
    Applied(&'a Deployment),
    /// Applied, but a worker pod cannot start (its kubelet says why: a missing Secret or key).
    PodsCannotStart {
        deployment: &'a Deployment,
        reason: &'a str,
        message: &'a str,
    },
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

/// The Deployment's worker pods: desired (`spec.replicas`) and available.
pub fn deployment_workers(deployment: &Deployment) -> Workers {
    Workers {
        desired: deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1),
        available: deployment
            .status
            .as_ref()
            .and_then(|s| s.available_replicas)
            .unwrap_or(0),
    }
}

fn deployment_ready(deployment: &Deployment, enabled: bool) -> Verdict<'static> {
    let Workers { desired, available } = deployment_workers(deployment);
    let status = deployment.status.clone().unwrap_or_default();
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

/// `Ready` when nothing was applied: as it was, else unknown.
fn ready_unchanged(
    previous: Option<&QueueAdapterStatus>,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    previous
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
        })
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
        Outcome::Applied(deployment) | Outcome::PodsCannotStart { deployment, .. } => {
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
                match outcome {
                    Outcome::PodsCannotStart {
                        reason, message, ..
                    } => Verdict::new(true, reason, message),
                    _ => deployment_degraded(deployment),
                },
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
        None => ready_unchanged(previous, generation, now),
    };
    let mut conditions = vec![
        ready,
        condition(previous, RECONCILED, reconciled, generation, now),
        condition(previous, DEGRADED, degraded, generation, now),
    ];
    // The runtime part is the workers' reports' to decide: carried over unchanged.
    conditions.extend(
        previous
            .into_iter()
            .flat_map(|s| &s.conditions)
            .filter(|c| RUNTIME_CONDITIONS.contains(&c.type_.as_str()))
            .cloned(),
    );
    QueueAdapterStatus {
        observed_generation: generation,
        conditions,
        ready_replicas,
        delivery_guarantee: broker.map(|b| b.guarantee().as_str().to_owned()),
        source: broker.map(|b| b.kind().to_owned()),
        mode: broker.map(|b| b.mode().to_owned()),
        observed: previous.and_then(|s| s.observed.clone()),
    }
}

/// What the operator knows of an adapter's workers at runtime.
#[derive(Debug, Clone, Copy)]
pub enum Runtime<'a> {
    /// The current reports of its workers (none: no worker reported recently).
    Reports(&'a [WorkerReport]),
    /// The reports cannot be read: the operator cannot reach PostgreSQL.
    DatabaseUnreachable(&'a str),
}

/// `adapter`'s status with its runtime part (`observed` and the runtime conditions) as
/// `runtime` says, at time `now`; the reconcile's part is kept.
pub fn with_runtime(
    adapter: &QueueAdapter,
    runtime: Runtime<'_>,
    now: &Time,
) -> QueueAdapterStatus {
    let previous = adapter.status.as_ref();
    let mut status = previous.cloned().unwrap_or_default();
    let generation = status.observed_generation;
    let verdicts = match runtime {
        Runtime::Reports(reports) => {
            let observed = observe(reports);
            let verdicts = runtime_verdicts(adapter, reports, &observed, now);
            status.observed = Some(observed);
            verdicts
        }
        Runtime::DatabaseUnreachable(message) => {
            let message = format!("the operator cannot read the workers' reports: {message}");
            vec![(
                DATABASE_REACHABLE,
                Verdict::new(false, "DatabaseUnreachable", message),
            )]
        }
    };
    for (type_, verdict) in verdicts {
        let updated = condition(previous, type_, verdict, generation, now);
        match status.conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(existing) => *existing = updated,
            None => status.conditions.push(updated),
        }
    }
    status
}

/// The queue as the freshest report says (its figures are queue-wide), with the oldest
/// message any worker holds.
fn observe(reports: &[WorkerReport]) -> ObservedQueue {
    let latest = reports.iter().max_by_key(|r| r.reported_at);
    ObservedQueue {
        workers: u32::try_from(reports.len()).unwrap_or(u32::MAX),
        backlog: latest.and_then(|r| r.backlog),
        pending: latest.and_then(|r| r.pending),
        oldest_since: reports
            .iter()
            .filter_map(|r| r.oldest_since)
            .min()
            .map(whole_seconds),
        dead_letters: latest.and_then(|r| r.dead_letters),
    }
}

/// `time` to the second below: the status changes only when the oldest message does.
fn whole_seconds(time: SystemTime) -> Time {
    let seconds = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Time(Timestamp::from_second(i64::try_from(seconds).unwrap_or(0)).unwrap_or_default())
}

fn runtime_verdicts(
    adapter: &QueueAdapter,
    reports: &[WorkerReport],
    observed: &ObservedQueue,
    now: &Time,
) -> Vec<(&'static str, Verdict<'static>)> {
    if reports.is_empty() {
        let unknown = || Verdict {
            status: "Unknown",
            reason: "NoReports",
            message: "no worker has reported recently".to_owned(),
        };
        return RUNTIME_CONDITIONS
            .into_iter()
            .map(|type_| (type_, unknown()))
            .collect();
    }
    let total = reports.len();
    let up = |dependency: &str, is_up: fn(&WorkerReport) -> bool| {
        let down = reports.iter().filter(|r| !is_up(r)).count();
        match down {
            0 => Verdict::new(
                true,
                "Reachable",
                format!("{total} of {total} workers reach the {dependency}"),
            ),
            _ => Verdict::new(
                false,
                "Unreachable",
                format!("{down} of {total} workers cannot reach the {dependency}"),
            ),
        }
    };
    let backlogged = backlogged_verdict(adapter, observed, now);
    let dead_lettering = dead_lettering_verdict(observed);
    vec![
        (BROKER_CONNECTED, up("broker", |r| r.broker_up)),
        (DATABASE_REACHABLE, up("database", |r| r.database_up)),
        (BACKLOGGED, backlogged),
        (DEAD_LETTERING, dead_lettering),
    ]
}

/// Whether the oldest unacknowledged message has waited longer than
/// `delivery.alertOldestSeconds`.
fn backlogged_verdict(
    adapter: &QueueAdapter,
    observed: &ObservedQueue,
    now: &Time,
) -> Verdict<'static> {
    let limit = Duration::from_secs(u64::from(adapter.spec.delivery.alert_oldest_seconds));
    let waited = observed.oldest_since.as_ref().map(|since| {
        let seconds = now.0.as_second() - since.0.as_second();
        Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
    });
    // Messages name the arrival time, not the waiting time: the status stays the same
    // between reports while the same message is the oldest.
    let since = observed
        .oldest_since
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    match waited {
        Some(waited) if waited > limit => Verdict::new(
            true,
            "OldestMessageTooOld",
            format!(
                "the oldest unacknowledged message arrived at {since}, longer ago than \
                 delivery.alertOldestSeconds ({} s)",
                limit.as_secs()
            ),
        ),
        Some(_) => Verdict::new(
            false,
            "WithinLimit",
            format!(
                "the oldest unacknowledged message arrived at {since}, within \
                 delivery.alertOldestSeconds ({} s)",
                limit.as_secs()
            ),
        ),
        None => Verdict::new(
            false,
            "NothingPending",
            "no message is waiting to be acknowledged",
        ),
    }
}

/// Whether dead letters wait in the broker's dead-letter destination.
fn dead_lettering_verdict(observed: &ObservedQueue) -> Verdict<'static> {
    match observed.dead_letters {
        Some(0) => Verdict::new(
            false,
            "NoDeadLetters",
            "the dead-letter destination is empty",
        ),
        Some(count) => Verdict::new(
            true,
            "DeadLettersWaiting",
            format!("{count} dead letters wait to be inspected"),
        ),
        None => Verdict {
            status: "Unknown",
            reason: "NotReported",
            message: "the broker does not report its dead letters".to_owned(),
        },
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
            reason: "InvalidSpec",
            message: "spec.source.redis.urlSecretRef is required",
        };
        let status = desired_status(&adapter(), blocked, &time(10));
        for type_ in [READY, RECONCILED] {
            assert_eq!(get(&status, type_).status, "False");
            assert_eq!(get(&status, type_).reason, "InvalidSpec");
        }
        assert_eq!(get(&status, DEGRADED).status, "True");
    }

    #[test]
    fn a_worker_pod_that_cannot_start_degrades_an_applied_adapter_until_it_starts() {
        let deployment = deployment(1, 1, 0);
        let waiting = Outcome::PodsCannotStart {
            deployment: &deployment,
            reason: "SecretNotFound",
            message: r#"worker pod orders-worker-x cannot start: secret "redis" not found"#,
        };
        let mut adapter = adapter();
        let status = desired_status(&adapter, waiting, &time(10));
        assert_eq!(get(&status, RECONCILED).status, "True");
        assert_eq!(get(&status, READY).status, "False");
        let degraded = get(&status, DEGRADED);
        assert_eq!(
            (degraded.status.as_str(), degraded.reason.as_str()),
            ("True", "SecretNotFound")
        );
        assert!(degraded.message.contains(r#"secret "redis""#));
        adapter.status = Some(status);
        let started = desired_status(&adapter, Outcome::Applied(&deployment), &time(20));
        assert_eq!(get(&started, DEGRADED).status, "False");
    }

    fn report(worker: &str, reported: u64, oldest: Option<u64>, dead: Option<u64>) -> WorkerReport {
        let at = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        WorkerReport {
            adapter: "shop/orders".to_owned(),
            worker: worker.to_owned(),
            reported_at: at(reported),
            backlog: Some(reported),
            pending: Some(2),
            oldest_since: oldest.map(at),
            dead_letters: dead,
            broker_up: true,
            database_up: true,
        }
    }

    #[test]
    fn fresh_reports_give_the_latest_figures_and_the_oldest_message_of_any_worker() {
        let reports = [
            report("a", 100, Some(90), Some(0)),
            report("b", 101, Some(50), Some(0)),
        ];
        let status = with_runtime(&adapter(), Runtime::Reports(&reports), &time(102));
        let observed = status.observed.clone().expect("observed");
        assert_eq!(observed.workers, 2);
        assert_eq!(observed.backlog, Some(101));
        assert_eq!(observed.oldest_since, Some(time(50)));
        assert_eq!(get(&status, BROKER_CONNECTED).status, "True");
        assert_eq!(get(&status, DATABASE_REACHABLE).status, "True");
        assert_eq!(get(&status, DEAD_LETTERING).status, "False");
        // 52 s waited, under the default limit of 300 s.
        assert_eq!(get(&status, BACKLOGGED).status, "False");
        let late = with_runtime(&adapter(), Runtime::Reports(&reports), &time(351));
        assert_eq!(get(&late, BACKLOGGED).status, "True");
        assert_eq!(get(&late, BACKLOGGED).reason, "OldestMessageTooOld");
    }

    #[test]
    fn a_worker_that_cannot_reach_a_dependency_turns_its_condition_false() {
        let mut down = report("b", 101, None, Some(3));
        down.broker_up = false;
        let reports = [report("a", 100, None, Some(3)), down];
        let status = with_runtime(&adapter(), Runtime::Reports(&reports), &time(102));
        let broker = get(&status, BROKER_CONNECTED);
        assert_eq!(
            (broker.status.as_str(), broker.message.as_str()),
            ("False", "1 of 2 workers cannot reach the broker")
        );
        assert_eq!(get(&status, DEAD_LETTERING).status, "True");
    }

    #[test]
    fn no_fresh_report_makes_the_runtime_conditions_unknown() {
        let status = with_runtime(&adapter(), Runtime::Reports(&[]), &time(10));
        assert_eq!(status.observed.as_ref().map(|o| o.workers), Some(0));
        for type_ in RUNTIME_CONDITIONS {
            assert_eq!(get(&status, type_).status, "Unknown");
        }
    }

    #[test]
    fn unchanged_reports_give_an_identical_status_and_a_reconcile_keeps_the_runtime_part() {
        let reports = [report("a", 100, Some(90), Some(0))];
        let mut adapter = adapter();
        adapter.status = Some(desired_status(
            &adapter,
            Outcome::Applied(&deployment(1, 1, 2)),
            &time(10),
        ));
        let first = with_runtime(&adapter, Runtime::Reports(&reports), &time(100));
        adapter.status = Some(first.clone());
        assert_eq!(
            with_runtime(&adapter, Runtime::Reports(&reports), &time(105)),
            first
        );
        let reconciled =
            desired_status(&adapter, Outcome::Applied(&deployment(1, 1, 2)), &time(110));
        assert_eq!(reconciled, first);
    }

    #[test]
    fn unreadable_reports_say_the_database_is_unreachable_and_keep_the_figures() {
        let reports = [report("a", 100, None, Some(0))];
        let mut adapter = adapter();
        adapter.status = Some(with_runtime(
            &adapter,
            Runtime::Reports(&reports),
            &time(100),
        ));
        let status = with_runtime(
            &adapter,
            Runtime::DatabaseUnreachable("connection refused"),
            &time(105),
        );
        assert_eq!(get(&status, DATABASE_REACHABLE).status, "False");
        assert!(
            get(&status, DATABASE_REACHABLE)
                .message
                .contains("connection refused")
        );
        assert_eq!(status.observed, adapter.status.and_then(|s| s.observed));
    }
}
