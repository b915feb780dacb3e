//! The worker pod template's placement and identity: `spec.workload`'s imagePullSecrets,
//! serviceAccountName, nodeSelector, tolerations, affinity, topologySpreadConstraints,
//! priorityClassName, resources, podAnnotations and podLabels, over the operator's defaults
//! (`--worker-pod-defaults`, Helm values `worker.*`). A field the adapter sets replaces the
//! default as a whole, except podAnnotations and podLabels, merged key by key (the adapter's
//! value wins); nothing here touches the pod's security context, which stays restricted.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, PodSpec, ResourceRequirements, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use switchboard_api::Workload;

/// The operator's defaults of every worker pod: `--worker-pod-defaults` (JSON, the Helm chart
/// renders it from its `worker.*` values). Empty strings, lists and maps mean "no default".
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PodDefaults {
    pub image_pull_secrets: Vec<LocalObjectReference>,
    pub service_account_name: String,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    pub affinity: Affinity,
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    pub priority_class_name: String,
    pub resources: ResourceRequirements,
    /// Annotations and labels of every worker pod, merged under the adapter's own.
    pub pod_annotations: BTreeMap<String, String>,
    pub pod_labels: BTreeMap<String, String>,
}

impl PodDefaults {
    /// Parses `--worker-pod-defaults`; the error names an unknown field or where the JSON does
    /// not fit.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// The adapter's value if it set one, else the default (`None` when that is empty).
fn chosen<T: Clone + Default + PartialEq>(own: Option<&T>, default: &T) -> Option<T> {
    own.cloned()
        .or_else(|| (*default != T::default()).then(|| default.clone()))
}

/// A pod spec holding only the placement fields, for `PodSpec { .., ..placement(..) }`.
pub fn placement(workload: &Workload, defaults: &PodDefaults) -> PodSpec {
    macro_rules! chosen {
        ($field:ident) => {
            chosen(workload.$field.as_ref(), &defaults.$field)
        };
    }
    PodSpec {
        image_pull_secrets: chosen!(image_pull_secrets),
        service_account_name: chosen!(service_account_name),
        node_selector: chosen!(node_selector),
        tolerations: chosen!(tolerations),
        affinity: chosen!(affinity),
        topology_spread_constraints: chosen!(topology_spread_constraints),
        priority_class_name: chosen!(priority_class_name),
        ..PodSpec::default()
    }
}

/// The worker container's resources: the adapter's, else the operator's default.
pub fn resources(workload: &Workload, defaults: &PodDefaults) -> Option<ResourceRequirements> {
    chosen(workload.resources.as_ref(), &defaults.resources)
}

/// The pod template's metadata, merged key by key: the defaults' podLabels, the adapter's over
/// them, the operator's `labels` (which select the pods) over both; the same for podAnnotations
/// with the config hash annotation on top.
pub fn metadata(
    workload: &Workload,
    defaults: &PodDefaults,
    labels: BTreeMap<String, String>,
    annotation: (String, String),
) -> ObjectMeta {
    let merged = |default: &BTreeMap<String, String>, own: &BTreeMap<String, String>| {
        let mut map = default.clone();
        map.extend(own.clone());
        map
    };
    let mut pod_labels = merged(&defaults.pod_labels, &workload.pod_labels);
    pod_labels.extend(labels);
    let mut annotations = merged(&defaults.pod_annotations, &workload.pod_annotations);
    annotations.extend([annotation]);
    ObjectMeta {
        labels: Some(pod_labels),
        annotations: Some(annotations),
        ..ObjectMeta::default()
    }
}
