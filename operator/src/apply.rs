//! Applying (or deleting) the worker's optional objects, and how a Kubernetes call that fails
//! becomes a reconcile error: below the controller, which drives them, and above `build`,
//! which makes them.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::{Api, Client};
use switchboard_store::StoreError;

use crate::autoscaling::{Autoscaled, scaled_object_resource, trigger_authentication_resource};
use crate::build::{BuildError, FIELD_MANAGER};
use crate::metrics::ErrorCategory;

/// Why a reconcile failed (transient: retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("Kubernetes API call failed: {action}")]
    Kubernetes {
        action: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("cannot mirror the adapter into the adapters table")]
    Store(#[source] StoreError),
    #[error("cannot build the worker objects")]
    Build(#[source] BuildError),
}

impl ReconcileError {
    pub(crate) fn category(&self) -> ErrorCategory {
        match self {
            ReconcileError::Kubernetes { .. } => ErrorCategory::Kubernetes,
            ReconcileError::Store(_) => ErrorCategory::Database,
            ReconcileError::Build(_) => ErrorCategory::Build,
        }
    }

    /// The condition reason reported for this failure.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            ReconcileError::Kubernetes { .. } => "KubernetesApiError",
            ReconcileError::Store(_) => "DatabaseUnavailable",
            ReconcileError::Build(_) => "BuildFailed",
        }
    }
}

pub(crate) fn kubernetes(action: &'static str) -> impl FnOnce(kube::Error) -> ReconcileError {
    move |source| ReconcileError::Kubernetes { action, source }
}

/// The field manager that holds an autoscaled Deployment's `replicas` while the operator lets go
/// of it: without an owner, the API server would reset it to 1 before KEDA's HPA takes over.
const HAND_OVER_MANAGER: &str = "switchboard-operator-handover";

/// Whether the operator's field manager owns `deployment`'s `spec.replicas`.
pub fn operator_owns_replicas(deployment: &Deployment) -> bool {
    deployment
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| entry.manager.as_deref() == Some(FIELD_MANAGER))
        .filter_map(|entry| entry.fields_v1.as_ref())
        .any(|fields| fields.0.pointer("/f:spec/f:replicas").is_some())
}

/// Before the operator applies an autoscaled Deployment (without `replicas`): if it still owns
/// `replicas` (autoscaling just switched on) or they are below `min_replicas`, a separate field
/// manager pins them at max(current, `min_replicas`), so capacity never drops during the
/// hand-over to KEDA, nor for good when KEDA is missing.
pub(crate) async fn hand_over_replicas(
    deployments: &Api<Deployment>,
    live: &Deployment,
    min_replicas: i32,
) -> Result<(), ReconcileError> {
    let current = live.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    if !operator_owns_replicas(live) && current >= min_replicas {
        return Ok(());
    }
    let pin = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "spec": {"replicas": current.max(min_replicas)},
    });
    let name = live.metadata.name.as_deref().unwrap_or_default();
    deployments
        .patch(
            name,
            &PatchParams::apply(HAND_OVER_MANAGER).force(),
            &Patch::Apply(&pin),
        )
        .await
        .map_err(kubernetes(
            "keep the worker replicas while handing them to KEDA",
        ))?;
    Ok(())
}

/// Applies KEDA's objects of an autoscaled adapter, or deletes the ones an earlier spec had
/// (nothing to delete, or no KEDA installed, is fine).
pub(crate) async fn apply_autoscaling(
    client: &Client,
    namespace: &str,
    name: &str,
    autoscaled: Option<&Autoscaled>,
) -> Result<(), ReconcileError> {
    let api = |resource: &ApiResource| {
        Api::<DynamicObject>::namespaced_with(client.clone(), namespace, resource)
    };
    let (scaled_objects, authentications) = (
        api(&scaled_object_resource()),
        api(&trigger_authentication_resource()),
    );
    let Some(autoscaled) = autoscaled else {
        delete_if_present(&scaled_objects, name, "delete the KEDA ScaledObject").await?;
        return delete_if_present(
            &authentications,
            name,
            "delete the KEDA TriggerAuthentication",
        )
        .await;
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    match &autoscaled.trigger_authentication {
        Some(authentication) => {
            authentications
                .patch(name, &apply, &Patch::Apply(authentication))
                .await
                .map_err(kubernetes(
                    "apply the KEDA TriggerAuthentication (is KEDA installed?)",
                ))?;
        }
        None => {
            delete_if_present(
                &authentications,
                name,
                "delete the KEDA TriggerAuthentication",
            )
            .await?
        }
    }
    scaled_objects
        .patch(name, &apply, &Patch::Apply(&autoscaled.scaled_object))
        .await
        .map_err(kubernetes(
            "apply the KEDA ScaledObject (is KEDA installed?)",
        ))?;
    Ok(())
}

/// Deletes object `name` of `api`; one that is not there (or a kind the cluster does not have)
/// is fine.
pub(crate) async fn delete_if_present(
    api: &Api<DynamicObject>,
    name: &str,
    action: &'static str,
) -> Result<(), ReconcileError> {
    match api.delete(name, &Default::default()).await {
        Ok(_) => Ok(()),
        // Without KEDA's CRD the API server answers a bare 404, not a NotFound Status.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(err) => Err(kubernetes(action)(err)),
    }
}

/// Applies the worker's budget, or deletes the one an earlier spec had.
pub(crate) async fn apply_disruption_budget(
    client: &Client,
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
