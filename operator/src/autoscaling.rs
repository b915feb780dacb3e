//! `spec.workload.autoscaling`: a KEDA ScaledObject for the worker Deployment, with the broker's
//! own trigger counting what is waiting *and* what the workers hold, so KEDA does not scale a
//! pod away while it has messages in hand — and, for SQS with credential Secrets or the pod
//! identity, the TriggerAuthentication KEDA connects with. Built without I/O, like the rest.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::ApiResource;
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use switchboard_api::{
    AmqpSource, Autoscaling, KafkaSource, NatsSource, RedisSource, SqsSource, StartFrom,
};

use crate::build::{ValidAdapter, labels, worker_name};

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

/// The KEDA objects for `valid`, if it is enabled and autoscaled. Both are named like the
/// worker Deployment and owned by the adapter.
pub fn autoscaling_objects(valid: &ValidAdapter<'_>, owner: &OwnerReference) -> Option<Autoscaled> {
    let spec = &valid.adapter.spec;
    let autoscaling = spec
        .workload
        .autoscaling
        .as_ref()
        .filter(|_| spec.enabled)?;
    let name = worker_name(valid.name);
    let metadata = |kind: &str| {
        json!({
            "apiVersion": "keda.sh/v1alpha1",
            "kind": kind,
            "metadata": {
                "name": name,
                "namespace": valid.namespace,
                "labels": labels(valid.name),
                "ownerReferences": [owner],
            },
        })
    };
    let source = &spec.source;
    let (triggers, trigger_authentication) = if let Some(redis) = &source.redis {
        (redis_triggers(redis, autoscaling), None)
    } else if let Some(sqs) = &source.sqs {
        let own = autoscaling
            .trigger_authentication_ref
            .is_none()
            .then(|| sqs_trigger_authentication(sqs));
        (vec![sqs_trigger(sqs, autoscaling)], own)
    } else if let Some(nats) = &source.nats {
        (vec![nats_trigger(nats, autoscaling)], None)
    } else if let Some(amqp) = &source.amqp {
        (vec![rabbitmq_trigger(amqp, autoscaling)], None)
    } else if let Some(kafka) = &source.kafka {
        let adapter = valid.adapter.adapter_name();
        (vec![kafka_trigger(kafka, &adapter, autoscaling)], None)
    } else {
        return None;
    };
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
    let mut scaled_object = metadata("ScaledObject");
    scaled_object["spec"] = json!({
        "scaleTargetRef": {"name": name},
        "minReplicaCount": autoscaling.min_replicas,
        "maxReplicaCount": autoscaling.max_replicas,
        "triggers": triggers,
    });
    let trigger_authentication = trigger_authentication.map(|spec| {
        let mut object = metadata("TriggerAuthentication");
        object["spec"] = spec;
        object
    });
    Some(Autoscaled {
        scaled_object,
        trigger_authentication,
    })
}

/// A stream's consumer-group lag (what waits; the only count KEDA can scale to zero on) and
/// its pending entries (what the workers hold): KEDA scales to the larger of the two.
fn redis_triggers(redis: &RedisSource, autoscaling: &Autoscaling) -> Vec<Value> {
    let stream = redis.stream.clone().unwrap_or_default();
    let target = autoscaling.target_backlog_per_replica.to_string();
    vec![
        json!({
            "type": "redis-streams",
            "metadata": {
                "stream": stream,
                "consumerGroup": redis.group,
                "lagCount": target,
                "activationLagCount": autoscaling.activation_backlog.to_string(),
            },
        }),
        json!({
            "type": "redis-streams",
            "metadata": {
                "stream": stream,
                "consumerGroup": redis.group,
                "pendingEntriesCount": target,
            },
        }),
    ]
}

/// Visible and in-flight messages (`scaleOnInFlight`), so held messages keep their pods.
fn sqs_trigger(sqs: &SqsSource, autoscaling: &Autoscaling) -> Value {
    let mut metadata = json!({
        "queueURL": sqs.queue_url.clone().unwrap_or_default(),
        "awsRegion": sqs.keda_region().unwrap_or_default(),
        "queueLength": autoscaling.target_backlog_per_replica.to_string(),
        "activationQueueLength": autoscaling.activation_backlog.to_string(),
        "scaleOnInFlight": "true",
    });
    if let Some(endpoint) = &sqs.endpoint {
        metadata["awsEndpoint"] = json!(endpoint);
    }
    json!({"type": "aws-sqs-queue", "metadata": metadata})
}

/// The consumer's pending plus unacknowledged messages, from nats-server's monitoring endpoint.
fn nats_trigger(nats: &NatsSource, autoscaling: &Autoscaling) -> Value {
    json!({
        "type": "nats-jetstream",
        "metadata": {
            "natsServerMonitoringEndpoint": autoscaling.nats_monitoring_endpoint.clone().unwrap_or_default(),
            "stream": nats.stream,
            "consumer": nats.consumer,
            "lagThreshold": autoscaling.target_backlog_per_replica.to_string(),
            "activationLagThreshold": autoscaling.activation_backlog.to_string(),
        },
    })
}

/// Ready plus unacknowledged messages, through the management API (`host` comes from the
/// adapter's TriggerAuthentication).
fn rabbitmq_trigger(amqp: &AmqpSource, autoscaling: &Autoscaling) -> Value {
    json!({
        "type": "rabbitmq",
        "metadata": {
            "protocol": "http",
            "queueName": amqp.queue,
            "mode": "QueueLength",
            "value": autoscaling.target_backlog_per_replica.to_string(),
            "activationValue": autoscaling.activation_backlog.to_string(),
        },
    })
}

/// The group's lag, which counts the records the workers hold: offsets are committed only
/// after they are stored.
fn kafka_trigger(kafka: &KafkaSource, adapter: &str, autoscaling: &Autoscaling) -> Value {
    let mut metadata = json!({
        "bootstrapServers": kafka.bootstrap_servers,
        "consumerGroup": kafka.group_id(adapter),
        "lagThreshold": autoscaling.target_backlog_per_replica.to_string(),
        "activationLagThreshold": autoscaling.activation_backlog.to_string(),
        "offsetResetPolicy": match kafka.start_from {
            StartFrom::Earliest => "earliest",
            StartFrom::Latest => "latest",
        },
    });
    if let Some([topic]) = kafka.topics.as_deref() {
        metadata["topic"] = json!(topic);
    }
    json!({"type": "kafka", "metadata": metadata})
}

/// The source's own credential Secrets, or the worker's pod identity (IRSA) without them.
fn sqs_trigger_authentication(sqs: &SqsSource) -> Value {
    let refs = [
        ("awsAccessKeyID", &sqs.access_key_id_secret_ref),
        ("awsSecretAccessKey", &sqs.secret_access_key_secret_ref),
        ("awsSessionToken", &sqs.session_token_secret_ref),
    ];
    let targets: Vec<Value> = refs
        .into_iter()
        .filter_map(|(parameter, reference)| {
            let reference = reference.as_ref()?;
            Some(json!({"parameter": parameter, "name": reference.name, "key": reference.key}))
        })
        .collect();
    if targets.is_empty() {
        json!({"podIdentity": {"provider": "aws", "identityOwner": "workload"}})
    } else {
        json!({"secretTargetRef": targets})
    }
}
