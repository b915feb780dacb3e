//! `spec.source.sqs`: an Amazon SQS queue (standard or FIFO), or a queue of an SQS-compatible
//! server.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Broker, Messaging, MissingSecret, SecretEnv, Triggers};
use crate::{Autoscaling, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// How the worker reads from SQS.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("[has(self.queueUrl), has(self.queueName)].filter(x, x).size() == 1").message("spec.source.sqs: exactly one of queueUrl and queueName must be set"),
    validation = Rule::new("!has(self.queueName) || has(self.region)").message("spec.source.sqs.region is required with queueName"),
    validation = Rule::new("has(self.accessKeyIdSecretRef) == has(self.secretAccessKeySecretRef)").message("spec.source.sqs: accessKeyIdSecretRef and secretAccessKeySecretRef go together"),
    validation = Rule::new("!has(self.sessionTokenSecretRef) || has(self.accessKeyIdSecretRef)").message("spec.source.sqs.sessionTokenSecretRef needs accessKeyIdSecretRef and secretAccessKeySecretRef"),
    validation = Rule::new("!has(oldSelf.queueUrl) || (has(self.queueUrl) && self.queueUrl == oldSelf.queueUrl)").message("spec.source.sqs.queueUrl is immutable (message ids of another queue would be taken for redeliveries); create a new QueueAdapter instead"),
    validation = Rule::new("!has(oldSelf.queueName) || (has(self.queueName) && self.queueName == oldSelf.queueName)").message("spec.source.sqs.queueName is immutable; create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct SqsSource {
    /// The queue's URL (`https://sqs.eu-west-1.amazonaws.com/123456789012/orders`). A name
    /// ending in `.fifo` is a FIFO queue. Cannot be changed after creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub queue_url: Option<String>,
    /// The queue's name, looked up in `region` (instead of `queueUrl`). Cannot be changed after
    /// creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 80))]
    pub queue_name: Option<String>,
    /// The AWS region (`eu-west-1`). Default: the `AWS_REGION` environment variable, else the
    /// region in `queueUrl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub region: Option<String>,
    /// The endpoint of an SQS-compatible server (`http://elasticmq:9324`), instead of AWS's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub endpoint: Option<String>,
    /// How long a received message stays hidden from other consumers. Default: the queue's
    /// visibility timeout. While a batch is still being stored past half of it, the worker
    /// extends it, so a slow commit does not cause a redelivery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 43200))]
    pub visibility_timeout_seconds: Option<u32>,
    /// How long one receive waits for messages when the queue is empty (long polling).
    #[serde(default = "default_wait_time_seconds")]
    #[schemars(range(min = 1, max = 20))]
    pub wait_time_seconds: u32,
    /// The Secret key holding the AWS access key id (`AWS_ACCESS_KEY_ID` in the pod). Without
    /// it the worker uses the default AWS credential chain: IRSA web identity, ECS/EC2
    /// instance roles, or `AWS_*` variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_key_id_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding the AWS secret access key (`AWS_SECRET_ACCESS_KEY` in the pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_access_key_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding a session token for temporary credentials (`AWS_SESSION_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_token_secret_ref: Option<SecretKeyRef>,
}

impl SqsSource {
    /// Whether the queue is a FIFO queue (its name ends with `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.queue_url
            .as_deref()
            .or(self.queue_name.as_deref())
            .is_some_and(|queue| queue.ends_with(".fifo"))
    }
}

impl SqsSource {
    /// The region KEDA is told: `region`, else the one an AWS queue URL
    /// (`https://sqs.<region>.amazonaws.com/…`) names.
    pub fn keda_region(&self) -> Option<&str> {
        self.region.as_deref().or_else(|| {
            let host = self.queue_url.as_deref()?.strip_prefix("https://sqs.")?;
            let (region, rest) = host.split_once('.')?;
            (rest.starts_with("amazonaws.com/") && !region.is_empty()).then_some(region)
        })
    }
}

impl Broker for SqsSource {
    fn kind(&self) -> &'static str {
        "sqs"
    }

    fn mode(&self) -> &'static str {
        if self.is_fifo() { "fifo" } else { "standard" }
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        DeliveryGuarantee::AtLeastOnce
    }

    fn messaging(&self, _adapter: &str) -> Messaging {
        let url_name = self
            .queue_url
            .as_deref()
            .and_then(|url| url.rsplit('/').next());
        Messaging {
            system: "aws_sqs",
            destination: self
                .queue_name
                .as_deref()
                .or(url_name)
                .unwrap_or_default()
                .to_owned(),
            consumer_group: None,
        }
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        Ok([
            ("AWS_ACCESS_KEY_ID", &self.access_key_id_secret_ref),
            ("AWS_SECRET_ACCESS_KEY", &self.secret_access_key_secret_ref),
            ("AWS_SESSION_TOKEN", &self.session_token_secret_ref),
        ]
        .into_iter()
        .filter_map(|(env, secret)| {
            Some(SecretEnv {
                env,
                secret: secret.as_ref()?,
            })
        })
        .collect())
    }

    fn strip_secrets(&mut self) {
        self.access_key_id_secret_ref = None;
        self.secret_access_key_secret_ref = None;
        self.session_token_secret_ref = None;
    }

    /// Visible and in-flight messages (`scaleOnInFlight`), so held messages keep their pods;
    /// KEDA connects with the source's own credential Secrets, or the worker's pod identity
    /// (IRSA) without them.
    fn autoscaling(&self, _adapter: &str, autoscaling: &Autoscaling) -> Option<Triggers> {
        let mut metadata = json!({
            "queueURL": self.queue_url.clone().unwrap_or_default(),
            "awsRegion": self.keda_region().unwrap_or_default(),
            "queueLength": autoscaling.target_backlog_per_replica.to_string(),
            "activationQueueLength": autoscaling.activation_backlog.to_string(),
            "scaleOnInFlight": "true",
        });
        if let Some(endpoint) = &self.endpoint {
            metadata["awsEndpoint"] = json!(endpoint);
        }
        let refs = [
            ("awsAccessKeyID", &self.access_key_id_secret_ref),
            ("awsSecretAccessKey", &self.secret_access_key_secret_ref),
            ("awsSessionToken", &self.session_token_secret_ref),
        ];
        let targets: Vec<Value> = refs
            .into_iter()
            .filter_map(|(parameter, reference)| {
                let reference = reference.as_ref()?;
                Some(json!({"parameter": parameter, "name": reference.name, "key": reference.key}))
            })
            .collect();
        let authentication = if targets.is_empty() {
            json!({"podIdentity": {"provider": "aws", "identityOwner": "workload"}})
        } else {
            json!({"secretTargetRef": targets})
        };
        Some(Triggers {
            triggers: vec![json!({"type": "aws-sqs-queue", "metadata": metadata})],
            authentication: Some(authentication),
        })
    }

    fn validate(&self, delivery: &Delivery, fail: &mut dyn FnMut(FieldError)) {
        let mut error = |field: &'static str, message: &str| {
            fail(FieldError {
                field,
                message: message.to_owned(),
            });
        };
        let set = |value: &Option<String>| value.as_deref().is_some_and(|v| !v.is_empty());
        if set(&self.queue_url) == set(&self.queue_name) {
            error(
                "spec.source.sqs",
                "exactly one of queueUrl and queueName must be set",
            );
        }
        if set(&self.queue_name) && !set(&self.region) {
            error("spec.source.sqs.region", "required with queueName");
        }
        if self.access_key_id_secret_ref.is_some() != self.secret_access_key_secret_ref.is_some() {
            error(
                "spec.source.sqs",
                "accessKeyIdSecretRef and secretAccessKeySecretRef go together",
            );
        }
        if self.session_token_secret_ref.is_some() && self.access_key_id_secret_ref.is_none() {
            error(
                "spec.source.sqs.sessionTokenSecretRef",
                "needs accessKeyIdSecretRef and secretAccessKeySecretRef",
            );
        }
        if !(1..=20).contains(&self.wait_time_seconds) {
            error("spec.source.sqs.waitTimeSeconds", "must be 1 to 20");
        }
        if self
            .visibility_timeout_seconds
            .is_some_and(|seconds| !(1..=43_200).contains(&seconds))
        {
            error(
                "spec.source.sqs.visibilityTimeoutSeconds",
                "must be 1 to 43200",
            );
        }
        if delivery
            .dead_letter
            .retention_days
            .is_some_and(|days| days > SQS_MAX_RETENTION_DAYS)
        {
            error(
                "spec.delivery.deadLetter.retentionDays",
                "SQS keeps messages at most 14 days",
            );
        }
        for field in delivery
            .dead_letter
            .set_fields()
            .filter(|field| !["spec.delivery.deadLetter.queueUrl"].contains(field))
        {
            error(
                field,
                "is not for source sqs; SQS dead letters go to deadLetter.queueUrl",
            );
        }
    }
}

/// The longest `MessageRetentionPeriod` SQS allows, in days.
const SQS_MAX_RETENTION_DAYS: u32 = 14;

fn default_wait_time_seconds() -> u32 {
    20
}
