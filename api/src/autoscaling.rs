//! `spec.workload.autoscaling`: KEDA scales the worker on the broker's own backlog.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Scale the worker Deployment with KEDA (which must be installed) on the broker's backlog,
/// counting messages delivered and not yet acknowledged, so pods are not scaled down while they
/// hold messages. While set, `spec.workload.replicas` is not used: the ScaledObject owns the
/// replica count.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("self.maxReplicas >= self.minReplicas").message("spec.workload.autoscaling.maxReplicas must be at least minReplicas")
)]
pub struct Autoscaling {
    /// The fewest worker pods. 0 lets KEDA scale the worker to zero while nothing waits.
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0, max = 100))]
    pub min_replicas: i32,
    /// The most worker pods.
    #[schemars(range(min = 1, max = 100))]
    pub max_replicas: i32,
    /// Messages waiting or held per worker pod that KEDA aims for.
    #[serde(default = "default_target_backlog")]
    #[schemars(range(min = 1))]
    pub target_backlog_per_replica: u32,
    /// Messages waiting above which a worker scaled to zero is started.
    #[serde(default)]
    pub activation_backlog: u32,
    /// Seconds between KEDA's reads of the backlog (the ScaledObject's `pollingInterval`; unset,
    /// KEDA's default of 30). A worker scaled to zero starts at most this long after messages
    /// arrive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub polling_interval_seconds: Option<u32>,
    /// Seconds KEDA waits, once nothing is waiting or held, before it scales the worker to zero
    /// (the ScaledObject's `cooldownPeriod`; unset, KEDA's default of 300). Only with
    /// `minReplicas: 0`; scaling down between one and more pods follows the HPA's own window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 86400))]
    pub cooldown_seconds: Option<u32>,
    /// A KEDA TriggerAuthentication in the adapter's namespace giving KEDA its own connection to
    /// the broker. Required for Redis (KEDA takes the address and password as separate
    /// parameters, not the URL the worker uses) and RabbitMQ (`host`: the management API's URL,
    /// which counts unacknowledged messages too). For SQS the default is a TriggerAuthentication
    /// the operator writes from the source's credential Secret references, or the pod identity;
    /// for Kafka, one for SASL or TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub trigger_authentication_ref: Option<String>,
    /// `host:port` of nats-server's HTTP monitoring endpoint, which KEDA reads the consumer's
    /// pending and unacknowledged counts from. Required for NATS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub nats_monitoring_endpoint: Option<String>,
    /// The NATS account the stream is in, as nats-server's monitoring endpoint names it (KEDA's
    /// `account`). Default `$G`, the account of a server without accounts configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub nats_account: Option<String>,
}

fn default_min_replicas() -> i32 {
    1
}

fn default_target_backlog() -> u32 {
    100
}
