//! The worker's PodDisruptionBudget: while an adapter can run more than one worker (`replicas`
//! or autoscaling `maxReplicas` above 1), a drain evicts its workers one at a time
//! (`maxUnavailable: 1`), so the adapter keeps consuming. With one worker (or none) there is
//! no budget: `maxUnavailable: 1` would protect nothing and `minAvailable: 1` would block
//! every drain. Owned by the QueueAdapter, so Kubernetes deletes it with the adapter.

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use switchboard_api::QueueAdapterSpec;

use crate::build::{FIELD_MANAGER, selector_labels};
use crate::controller::{ReconcileError, delete_if_present, kubernetes};

/// The most worker pods `spec` can run at once.
fn most_replicas(spec: &QueueAdapterSpec) -> i32 {
    match (&spec.enabled, &spec.workload.autoscaling) {
        (false, _) => 0,
        (true, Some(autoscaling)) => autoscaling.max_replicas,
        (true, None) => spec.workload.replicas,
    }
}

/// The budget of the worker of adapter `name`, named and owned as `metadata` says, when it can
/// run more than one pod.
pub fn disruption_budget(
    spec: &QueueAdapterSpec,
    name: &str,
    metadata: ObjectMeta,
) -> Option<PodDisruptionBudget> {
    (most_replicas(spec) > 1).then(|| PodDisruptionBudget {
        metadata,
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(selector_labels(name)),
                ..LabelSelector::default()
            }),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    })
}

/// Applies the worker's budget, or deletes the one an earlier spec had.
pub async fn apply_disruption_budget(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    budget: Option<&PodDisruptionBudget>,
) -> Result<(), ReconcileError> {
    let Some(budget) = budget else {
        let resource = ApiResource::erase::<PodDisruptionBudget>(&());
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource);
        return delete_if_present(&api, name, "delete the worker PodDisruptionBudget").await;
    };
    Api::<PodDisruptionBudget>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(budget),
        )
        .await
        .map_err(kubernetes("apply the worker PodDisruptionBudget"))?;
    Ok(())
}
