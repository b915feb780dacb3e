//! Why a worker pod cannot start, as its kubelet says. The operator holds no permission on
//! Secrets: it learns of a missing Secret (or key) from the pods whose environment names it,
//! which wait in `CreateContainerConfigError` with a message naming it (never a value).

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::apply::{ReconcileError, kubernetes};
use crate::build::selector_labels;

/// The waiting reason of a container whose environment or mounts cannot be resolved.
const CONFIG_ERROR: &str = "CreateContainerConfigError";

/// A worker pod that cannot start: the status reason and a message naming the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CannotStart {
    pub reason: &'static str,
    pub message: String,
}

/// The first of `pods` (not being deleted) whose container cannot be created for want of its
/// configuration. `SecretNotFound` when the kubelet's message is about a Secret.
pub fn cannot_start(pods: &[Pod]) -> Option<CannotStart> {
    pods.iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .find_map(|pod| {
            let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
            let waiting = statuses
                .iter()
                .filter_map(|status| status.state.as_ref()?.waiting.as_ref())
                .find(|waiting| waiting.reason.as_deref() == Some(CONFIG_ERROR))?;
            let said = waiting.message.clone().unwrap_or_default();
            let reason = if said.to_ascii_lowercase().contains("secret") {
                "SecretNotFound"
            } else {
                CONFIG_ERROR
            };
            Some(CannotStart {
                reason,
                message: format!("worker pod {} cannot start: {said}", pod.name_any()),
            })
        })
}

/// Whether a worker pod of adapter `name` in `namespace` cannot start, and why.
pub async fn worker_cannot_start(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<CannotStart>, ReconcileError> {
    let selector = selector_labels(name)
        .into_iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(kubernetes("list worker pods"))?;
    Ok(cannot_start(&pods.items))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, reason: &str, message: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "status": {"containerStatuses": [{
                "name": "worker", "image": "w", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}},
            }]},
        }))
        .expect("pod parses")
    }

    #[test]
    fn a_pod_waiting_for_its_secret_is_reported_with_the_kubelets_words() {
        let pods = [
            pod("orders-worker-a", "ContainerCreating", ""),
            pod(
                "orders-worker-b",
                CONFIG_ERROR,
                r#"secret "redis-later" not found"#,
            ),
        ];
        assert_eq!(
            cannot_start(&pods),
            Some(CannotStart {
                reason: "SecretNotFound",
                message:
                    r#"worker pod orders-worker-b cannot start: secret "redis-later" not found"#
                        .to_owned(),
            })
        );
        let other = [pod("p", CONFIG_ERROR, r#"configmap "x" not found"#)];
        assert_eq!(cannot_start(&other).map(|c| c.reason), Some(CONFIG_ERROR));
        assert_eq!(cannot_start(&pods[..1]), None);
    }
}
