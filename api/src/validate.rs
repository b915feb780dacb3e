//! The same rules the API server enforces through the CRD schema and CEL, checked in Rust for
//! manifests that never pass through an API server (`switchboard-worker run --file`).

use std::fmt;

use crate::QueueAdapterSpec;

/// One violated rule, naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

/// Every rule a spec violates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct InvalidSpec(pub Vec<FieldError>);

impl fmt::Display for InvalidSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|e| format!("{}: {}", e.field, e.message))
            .collect();
        write!(f, "invalid QueueAdapter spec: {}", parts.join("; "))
    }
}

impl QueueAdapterSpec {
    /// Replica counts and the backlog target, whatever the broker.
    fn validate_replica_bounds(
        autoscaling: &crate::Autoscaling,
        fail: &mut impl FnMut(&'static str, String),
    ) {
        if !(0..=100).contains(&autoscaling.min_replicas) {
            fail(
                "spec.workload.autoscaling.minReplicas",
                format!("must be 0 to 100, got {}", autoscaling.min_replicas),
            );
        }
        if !(1..=100).contains(&autoscaling.max_replicas) {
            fail(
                "spec.workload.autoscaling.maxReplicas",
                format!("must be 1 to 100, got {}", autoscaling.max_replicas),
            );
        }
        if autoscaling.max_replicas < autoscaling.min_replicas {
            fail(
                "spec.workload.autoscaling.maxReplicas",
                "must be at least minReplicas".into(),
            );
        }
        if autoscaling.target_backlog_per_replica < 1 {
            fail(
                "spec.workload.autoscaling.targetBacklogPerReplica",
                "must be at least 1".into(),
            );
        }
        if let Some(seconds) = autoscaling
            .polling_interval_seconds
            .filter(|seconds| !(1..=3600).contains(seconds))
        {
            fail(
                "spec.workload.autoscaling.pollingIntervalSeconds",
                format!("must be 1 to 3600, got {seconds}"),
            );
        }
        if let Some(seconds) = autoscaling
            .cooldown_seconds
            .filter(|seconds| *seconds > 86400)
        {
            fail(
                "spec.workload.autoscaling.cooldownSeconds",
                format!("must be at most 86400, got {seconds}"),
            );
        }
    }

    fn validate_autoscaling(
        &self,
        autoscaling: &crate::Autoscaling,
        fail: &mut impl FnMut(&'static str, String),
    ) {
        Self::validate_replica_bounds(autoscaling, fail);
        let field = "spec.workload.autoscaling";
        if let Some(redis) = &self.source.redis {
            if redis.mode != crate::RedisMode::Stream {
                fail(
                    field,
                    "Redis lists and pubsub cannot be autoscaled (KEDA cannot see what list \
                     consumers hold; every pubsub replica gets every message)"
                        .into(),
                );
            }
            if autoscaling.trigger_authentication_ref.is_none() {
                fail(
                    "spec.workload.autoscaling.triggerAuthenticationRef",
                    "is required for Redis: KEDA takes the address and password as separate \
                     parameters"
                        .into(),
                );
            }
        }
        if self.source.nats.is_some() && autoscaling.nats_monitoring_endpoint.is_none() {
            fail(
                "spec.workload.autoscaling.natsMonitoringEndpoint",
                "is required for NATS: KEDA reads the consumer from nats-server's monitoring \
                 endpoint"
                    .into(),
            );
        }
        if self.source.amqp.is_some() && autoscaling.trigger_authentication_ref.is_none() {
            fail(
                "spec.workload.autoscaling.triggerAuthenticationRef",
                "is required for RabbitMQ: KEDA counts held messages through the management \
                 API, whose URL it takes as host"
                    .into(),
            );
        }
        if let Some(sqs) = &self.source.sqs
            && (sqs.queue_url.is_none() || sqs.keda_region().is_none())
        {
            fail(
                field,
                "needs spec.source.sqs.queueUrl and a region (spec.source.sqs.region, or an AWS \
                 queue URL naming one): KEDA addresses the queue by URL and region"
                    .into(),
            );
        }
        if self.source.gateway.is_some() {
            fail(
                field,
                "is not available for source gateway: KEDA has no scaler for the gateway's \
                 protocol"
                    .into(),
            );
        }
    }

    /// Checks the rules of the CRD schema and its CEL validations.
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        let mut errors_of_broker = Vec::new();
        let mut errors = Vec::new();
        let mut fail = |field: &'static str, message: String| {
            errors.push(FieldError { field, message });
        };
        match self.source.broker() {
            None => fail("spec.source", crate::exactly_one_broker()),
            Some(broker) => {
                broker.validate(&self.delivery, &mut |error| errors_of_broker.push(error))
            }
        }
        let queue_len = self.target.queue.chars().count();
        if !(1..=200).contains(&queue_len) {
            fail(
                "spec.target.queue",
                format!("must be 1 to 200 characters, got {queue_len}"),
            );
        }
        let delivery = &self.delivery;
        if !(1..=10_000).contains(&delivery.batch_size) {
            fail(
                "spec.delivery.batchSize",
                format!("must be 1 to 10000, got {}", delivery.batch_size),
            );
        }
        if delivery.max_deliveries < 1 {
            fail("spec.delivery.maxDeliveries", "must be at least 1".into());
        }
        if !(1..=86_400).contains(&delivery.claim_idle_seconds) {
            fail(
                "spec.delivery.claimIdleSeconds",
                format!("must be 1 to 86400, got {}", delivery.claim_idle_seconds),
            );
        }
        if self.payload.max_bytes < 1 {
            fail("spec.payload.maxBytes", "must be at least 1".into());
        }
        if !(0..=100).contains(&self.workload.replicas) {
            fail(
                "spec.workload.replicas",
                format!("must be 0 to 100, got {}", self.workload.replicas),
            );
        }
        if !(1..=604_800).contains(&delivery.alert_oldest_seconds) {
            fail(
                "spec.delivery.alertOldestSeconds",
                format!("must be 1 to 604800, got {}", delivery.alert_oldest_seconds),
            );
        }
        if let Some(database) = &self.database
            && database.ca_config_map_ref.is_some()
            && database.ca_secret_ref.is_some()
        {
            fail(
                "spec.database",
                "at most one of caConfigMapRef and caSecretRef may be set".into(),
            );
        }
        if let Some(autoscaling) = &self.workload.autoscaling {
            self.validate_autoscaling(autoscaling, &mut fail);
        }
        errors.splice(0..0, errors_of_broker);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(InvalidSpec(errors))
        }
    }
}
