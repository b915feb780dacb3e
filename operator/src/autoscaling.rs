//! `spec.workload.autoscaling`: a KEDA ScaledObject for the worker Deployment, with the broker's
//! own trigger counting what is waiting *and* what the workers hold, so KEDA does not scale a
//! pod away while it has messages in hand — and, for SQS with credential Secrets or the pod
//! identity, the TriggerAuthentication KEDA connects with. Each broker's trigger is pure data of
//! its spec ([`Broker::autoscaling`], `api/src/source/<broker>.rs`); this file knows no broker.
//! Built without I/O, like the rest.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::ApiResource;
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use switchboard_api::{Broker, QueueAdapter, Triggers};

/// KEDA's ScaledObject and TriggerAuthentication (`keda.sh/v1alpha1`).
pub fn scaled_object_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "keda.sh",
        "v1alpha1",
        "ScaledObject",
    ))
}

pub fn trigger_authentication_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "keda.sh",
        "v1alpha1",
        "TriggerAuthentication",
    ))
}

/// The KEDA objects of an autoscaled adapter, ready for server-side apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Autoscaled {
    pub scaled_object: Value,
    /// Written by the operator when the adapter names none of its own.
    pub trigger_authentication: Option<Value>,
}

/// The KEDA objects for `adapter`, if it is enabled, autoscaled and its broker has a trigger
/// (`broker.autoscaling`, pure data of the broker's spec). Both carry `metadata`: named like
/// the worker Deployment and owned by the adapter.
pub fn autoscaling_objects(
    adapter: &QueueAdapter,
    broker: &dyn Broker,
    metadata: &ObjectMeta,
) -> Option<Autoscaled> {
    let spec = &adapter.spec;
    let autoscaling = spec
        .workload
        .autoscaling
        .as_ref()
        .filter(|_| spec.enabled)?;
    let name = metadata.name.clone().unwrap_or_default();
    let object = |kind: &str| {
        json!({
            "apiVersion": "keda.sh/v1alpha1",
            "kind": kind,
            "metadata": metadata,
        })
    };
    let Triggers {
        triggers,
        authentication: own,
    } = broker.autoscaling(&adapter.adapter_name(), autoscaling)?;
    let trigger_authentication = own.filter(|_| autoscaling.trigger_authentication_ref.is_none());
    let authentication = autoscaling
        .trigger_authentication_ref
        .clone()
        .or(trigger_authentication.as_ref().map(|_| name.clone()));
    let triggers: Vec<Value> = triggers
        .into_iter()
        .map(|mut trigger| {
            if let Some(authentication) = &authentication {
                trigger["authenticationRef"] = json!({"name": authentication});
            }
            trigger
        })
        .collect();
    let mut scaled_object = object("ScaledObject");
    scaled_object["spec"] = json!({
        "scaleTargetRef": {"name": name},
        "minReplicaCount": autoscaling.min_replicas,
        "maxReplicaCount": autoscaling.max_replicas,
        "triggers": triggers,
    });
    if let Some(seconds) = autoscaling.polling_interval_seconds {
        scaled_object["spec"]["pollingInterval"] = json!(seconds);
    }
    if let Some(seconds) = autoscaling.cooldown_seconds {
        scaled_object["spec"]["cooldownPeriod"] = json!(seconds);
    }
    let trigger_authentication = trigger_authentication.map(|spec| {
        let mut object = object("TriggerAuthentication");
        object["spec"] = spec;
        object
    });
    Some(Autoscaled {
        scaled_object,
        trigger_authentication,
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde_json::json;
    use switchboard_api::QueueAdapter;

    use super::autoscaling_objects;

    fn adapter(autoscaling: &str) -> QueueAdapter {
        let yaml = include_str!("../fixtures/orders-stream.yaml").replace(
            "    replicas: 2\n",
            &format!("    autoscaling: {autoscaling}\n"),
        );
        serde_yaml_ng::from_str(&yaml).expect("an adapter")
    }

    /// The generic part (metadata, replica bounds, `authenticationRef`) around the broker's own
    /// triggers, here a Redis stream's lag and pending entries.
    #[test]
    fn a_redis_stream_is_scaled_on_its_lag_and_pending_entries_with_the_named_authentication() {
        let adapter = adapter(
            "{minReplicas: 0, maxReplicas: 5, targetBacklogPerReplica: 50, activationBacklog: 3, triggerAuthenticationRef: redis-keda}",
        );
        let broker = adapter.spec.source.broker().expect("one broker");
        let metadata = ObjectMeta {
            name: Some("orders-worker".to_owned()),
            namespace: Some("shop".to_owned()),
            ..ObjectMeta::default()
        };
        let objects = autoscaling_objects(&adapter, broker, &metadata).expect("autoscaled");
        assert_eq!(objects.trigger_authentication, None);
        let auth = json!({"name": "redis-keda"});
        assert_eq!(
            objects.scaled_object,
            json!({
                "apiVersion": "keda.sh/v1alpha1",
                "kind": "ScaledObject",
                "metadata": {"name": "orders-worker", "namespace": "shop"},
                "spec": {
                    "scaleTargetRef": {"name": "orders-worker"},
                    "minReplicaCount": 0,
                    "maxReplicaCount": 5,
                    "triggers": [
                        {"type": "redis-streams", "authenticationRef": auth, "metadata": {
                            "stream": "orders", "consumerGroup": "switchboard",
                            "lagCount": "50", "activationLagCount": "3"}},
                        {"type": "redis-streams", "authenticationRef": auth, "metadata": {
                            "stream": "orders", "consumerGroup": "switchboard",
                            "pendingEntriesCount": "50"}},
                    ],
                },
            })
        );
    }

    /// KEDA's own defaults (30 s, 300 s) stand unless the adapter sets its polling interval and
    /// cooldown.
    #[test]
    fn polling_interval_and_cooldown_are_written_only_when_set() {
        let metadata = ObjectMeta {
            name: Some("orders-worker".to_owned()),
            ..ObjectMeta::default()
        };
        let spec = |autoscaling: &str| {
            let adapter = adapter(autoscaling);
            let broker = adapter.spec.source.broker().expect("one broker");
            autoscaling_objects(&adapter, broker, &metadata)
                .expect("autoscaled")
                .scaled_object["spec"]
                .clone()
        };
        let set = spec(
            "{minReplicas: 0, maxReplicas: 2, pollingIntervalSeconds: 2, cooldownSeconds: 0, triggerAuthenticationRef: k}",
        );
        assert_eq!(
            (
                set["pollingInterval"].clone(),
                set["cooldownPeriod"].clone()
            ),
            (json!(2), json!(0))
        );
        let unset = spec("{maxReplicas: 2, triggerAuthenticationRef: k}");
        assert_eq!(
            (unset.get("pollingInterval"), unset.get("cooldownPeriod")),
            (None, None)
        );
    }
}
