//! `spec.source.amqp`: a RabbitMQ (AMQP 0-9-1) queue, quorum or classic.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Broker, Messaging, MissingSecret, SecretEnv, Triggers};
use crate::{Autoscaling, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// How the worker reads from RabbitMQ.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.queue == oldSelf.queue").message("spec.source.amqp.queue is immutable (message ids of another queue would be taken for redeliveries); create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct AmqpSource {
    /// The queue to consume from. By default it must exist (a missing queue stops the worker
    /// with an error naming it); set `declare` to have the worker create it. Cannot be changed
    /// after creation.
    #[schemars(length(min = 1, max = 255))]
    pub queue: String,
    /// Create the queue (durable) and its bindings if they do not exist. Without it, the queue
    /// must exist already.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declare: Option<AmqpDeclare>,
    /// The Secret key holding the AMQP URL (`amqp://user:password@host:5672/vhost`, or
    /// `amqps://` for TLS, which verifies the server certificate). Passed to the worker as the
    /// `AMQP_URL` environment variable; never copied into the spec, status or database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
}

/// The queue the worker declares, and how it is bound.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct AmqpDeclare {
    /// `quorum` (replicated; RabbitMQ counts deliveries itself, recommended) or `classic`.
    #[serde(default, rename = "type")]
    pub queue_type: AmqpQueueType,
    /// Bindings of the queue to exchanges, created with it. Each exchange must exist.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub bindings: Vec<AmqpBinding>,
}

/// A binding of the queue to an exchange.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AmqpBinding {
    /// The exchange messages are published to.
    #[schemars(length(min = 1, max = 255))]
    pub exchange: String,
    /// The routing key (a pattern for topic exchanges). Default: empty.
    #[serde(default)]
    #[schemars(length(max = 255))]
    pub routing_key: String,
}

/// The type of a queue the worker declares.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum AmqpQueueType {
    #[default]
    Quorum,
    Classic,
}

impl AmqpQueueType {
    /// The `x-queue-type` argument.
    pub fn as_str(self) -> &'static str {
        match self {
            AmqpQueueType::Quorum => "quorum",
            AmqpQueueType::Classic => "classic",
        }
    }
}

impl Broker for AmqpSource {
    fn kind(&self) -> &'static str {
        "amqp"
    }

    fn mode(&self) -> &'static str {
        match &self.declare {
            Some(declare) => declare.queue_type.as_str(),
            None => "queue",
        }
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        DeliveryGuarantee::AtLeastOnce
    }

    fn messaging(&self, _adapter: &str) -> Messaging {
        Messaging {
            system: "rabbitmq",
            destination: self.queue.clone(),
            consumer_group: None,
        }
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        let secret = self.url_secret_ref.as_ref().ok_or(MissingSecret {
            field: "spec.source.amqp.urlSecretRef",
            env: "AMQP_URL",
        })?;
        Ok(vec![SecretEnv {
            env: "AMQP_URL",
            secret,
        }])
    }

    fn strip_secrets(&mut self) {
        self.url_secret_ref = None;
    }

    /// Ready plus unacknowledged messages, through the management API (`host` comes from the
    /// adapter's TriggerAuthentication).
    fn autoscaling(&self, _adapter: &str, autoscaling: &Autoscaling) -> Option<Triggers> {
        let trigger = json!({
            "type": "rabbitmq",
            "metadata": {
                "protocol": "http",
                "queueName": self.queue,
                "mode": "QueueLength",
                "value": autoscaling.target_backlog_per_replica.to_string(),
                "activationValue": autoscaling.activation_backlog.to_string(),
            },
        });
        Some(Triggers {
            triggers: vec![trigger],
            authentication: None,
        })
    }

    fn validate(&self, delivery: &Delivery, fail: &mut dyn FnMut(FieldError)) {
        let mut error = |field: &'static str, message: &str| {
            fail(FieldError {
                field,
                message: message.to_owned(),
            });
        };
        if self.queue.is_empty() {
            error("spec.source.amqp.queue", "must not be empty");
        }
        let bindings = self.declare.iter().flat_map(|d| &d.bindings);
        if bindings.clone().any(|binding| binding.exchange.is_empty()) {
            error(
                "spec.source.amqp.declare.bindings",
                "every binding needs an exchange",
            );
        }
        let dead_letter = &delivery.dead_letter;
        if dead_letter.routing_key.is_some() && dead_letter.exchange.is_none() {
            error(
                "spec.delivery.deadLetter.routingKey",
                "needs deadLetter.exchange",
            );
        }
        for field in delivery.dead_letter.set_fields().filter(|field| {
            ![
                "spec.delivery.deadLetter.exchange",
                "spec.delivery.deadLetter.routingKey",
            ]
            .contains(field)
        }) {
            error(
                field,
                "is not for source amqp; AMQP dead letters go to deadLetter.exchange (or the queue <queue>.dlq)",
            );
        }
    }
}
