//! The worker's PodDisruptionBudget: while an adapter can run more than one worker (`replicas`
//! or autoscaling `maxReplicas` above 1), a drain evicts its workers one at a time
//! (`maxUnavailable: 1`), so the adapter keeps consuming. With one worker (or none) there is
//! no budget: `maxUnavailable: 1` would protect nothing and `minAvailable: 1` would block
//! every drain. Owned by the QueueAdapter, so Kubernetes deletes it with the adapter.

use std::collections::BTreeMap;

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use switchboard_api::QueueAdapterSpec;

/// The most worker pods `spec` can run at once.
fn most_replicas(spec: &QueueAdapterSpec) -> i32 {
    match (&spec.enabled, &spec.workload.autoscaling) {
        (false, _) => 0,
        (true, Some(autoscaling)) => autoscaling.max_replicas,
        (true, None) => spec.workload.replicas,
    }
}

/// The budget of the worker pods `selector` selects, named and owned as `metadata` says, when
/// `spec` can run more than one.
pub fn disruption_budget(
    spec: &QueueAdapterSpec,
    selector: BTreeMap<String, String>,
    metadata: ObjectMeta,
) -> Option<PodDisruptionBudget> {
    (most_replicas(spec) > 1).then(|| PodDisruptionBudget {
        metadata,
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    })
}
