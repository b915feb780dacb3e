//! `spec.source.nats`: a NATS JetStream stream, read by a durable pull consumer.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Broker, Messaging, MissingSecret, SecretEnv, Triggers};
use crate::{Autoscaling, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// How the worker reads from NATS JetStream.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("has(self.userSecretRef) == has(self.passwordSecretRef)").message("spec.source.nats: userSecretRef and passwordSecretRef go together"),
    validation = Rule::new("[has(self.credentialsSecretRef), has(self.nkeySecretRef), has(self.userSecretRef), has(self.tokenSecretRef)].filter(x, x).size() <= 1").message("spec.source.nats: at most one of credentialsSecretRef, nkeySecretRef, userSecretRef/passwordSecretRef and tokenSecretRef"),
    validation = Rule::new("self.stream == oldSelf.stream").message("spec.source.nats.stream is immutable (sequence numbers of another stream would be taken for redeliveries); create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct NatsSource {
    /// The stream to read (it must exist). Cannot be changed after creation.
    #[schemars(length(min = 1, max = 255), regex(pattern = r"^[^.*>\s]+$"))]
    pub stream: String,
    /// The durable pull consumer the workers share. Created if missing (explicit
    /// acknowledgement, `ackWaitSeconds`, no delivery limit of its own (the worker counts them), the
    /// filter subject and deliver policy below); an existing consumer whose settings differ is
    /// refused (the worker exits naming the setting) rather than changed.
    #[serde(default = "default_consumer")]
    #[schemars(length(min = 1, max = 255), regex(pattern = r"^[^.*>\s]+$"))]
    pub consumer: String,
    /// How long the server waits for an acknowledgement before it redelivers a message. While a
    /// batch is still being stored past half of it, the worker reports progress, so a slow
    /// commit does not cause a redelivery.
    #[serde(default = "default_ack_wait_seconds")]
    #[schemars(range(min = 1, max = 3600))]
    pub ack_wait_seconds: u32,
    /// Only messages whose subject matches (`orders.eu.>`). Default: every subject of the
    /// stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub filter_subject: Option<String>,
    /// Where a newly created consumer starts: `all` (every message the stream holds) or `new`
    /// (messages published after it was created).
    #[serde(default)]
    pub deliver_policy: NatsDeliverPolicy,
    /// The Secret key holding the server URL (`NATS_URL` in the pod), such as
    /// `tls://nats.example:4222`; several servers separated by commas. TLS certificates are
    /// verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding a credentials file (JWT and NKey seed, `NATS_CREDENTIALS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding an NKey seed (`NATS_NKEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nkey_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding a user name (`NATS_USER`), with `passwordSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding the user's password (`NATS_PASSWORD`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// The Secret key holding an authentication token (`NATS_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
}

/// Where a newly created consumer starts.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum NatsDeliverPolicy {
    /// Every message the stream holds.
    #[default]
    All,
    /// Messages published after the consumer was created.
    New,
}

impl Broker for NatsSource {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn mode(&self) -> &'static str {
        "jetstream"
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        DeliveryGuarantee::AtLeastOnce
    }

    fn messaging(&self, _adapter: &str) -> Messaging {
        Messaging {
            system: "nats",
            destination: self.stream.clone(),
            consumer_group: Some(self.consumer.clone()),
        }
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        let url = self.url_secret_ref.as_ref().ok_or(MissingSecret {
            field: "spec.source.nats.urlSecretRef",
            env: "NATS_URL",
        })?;
        let mut env = vec![SecretEnv {
            env: "NATS_URL",
            secret: url,
        }];
        env.extend(
            [
                ("NATS_CREDENTIALS", &self.credentials_secret_ref),
                ("NATS_NKEY", &self.nkey_secret_ref),
                ("NATS_USER", &self.user_secret_ref),
                ("NATS_PASSWORD", &self.password_secret_ref),
                ("NATS_TOKEN", &self.token_secret_ref),
            ]
            .into_iter()
            .filter_map(|(env, secret)| {
                Some(SecretEnv {
                    env,
                    secret: secret.as_ref()?,
                })
            }),
        );
        Ok(env)
    }

    fn strip_secrets(&mut self) {
        self.url_secret_ref = None;
        self.credentials_secret_ref = None;
        self.nkey_secret_ref = None;
        self.user_secret_ref = None;
        self.password_secret_ref = None;
        self.token_secret_ref = None;
    }

    /// The consumer's pending plus unacknowledged messages, from nats-server's monitoring
    /// endpoint.
    fn autoscaling(&self, _adapter: &str, autoscaling: &Autoscaling) -> Option<Triggers> {
        let trigger = json!({
            "type": "nats-jetstream",
            "metadata": {
                "natsServerMonitoringEndpoint": autoscaling.nats_monitoring_endpoint.clone().unwrap_or_default(),
                "account": autoscaling.nats_account.as_deref().unwrap_or("$G"),
                "stream": self.stream,
                "consumer": self.consumer,
                "lagThreshold": autoscaling.target_backlog_per_replica.to_string(),
                "activationLagThreshold": autoscaling.activation_backlog.to_string(),
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
        self.validate_consumer(&mut error);
        self.validate_dead_letter(delivery, &mut error);
    }
}

impl NatsSource {
    /// The stream, consumer, filter and credentials settings.
    fn validate_consumer(&self, error: &mut dyn FnMut(&'static str, &str)) {
        let name_ok = |name: &str| {
            !name.is_empty()
                && !name
                    .chars()
                    .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace())
        };
        if !name_ok(&self.stream) {
            error(
                "spec.source.nats.stream",
                "must be a non-empty name without '.', '*', '>' or whitespace",
            );
        }
        if !name_ok(&self.consumer) {
            error(
                "spec.source.nats.consumer",
                "must be a non-empty name without '.', '*', '>' or whitespace",
            );
        }
        if !(1..=3600).contains(&self.ack_wait_seconds) {
            error("spec.source.nats.ackWaitSeconds", "must be 1 to 3600");
        }
        if self.filter_subject.as_deref().is_some_and(str::is_empty) {
            error("spec.source.nats.filterSubject", "must not be empty");
        }
        if self.user_secret_ref.is_some() != self.password_secret_ref.is_some() {
            error(
                "spec.source.nats",
                "userSecretRef and passwordSecretRef go together",
            );
        }
        let methods = [
            self.credentials_secret_ref.is_some(),
            self.nkey_secret_ref.is_some(),
            self.user_secret_ref.is_some(),
            self.token_secret_ref.is_some(),
        ];
        if methods.into_iter().filter(|set| *set).count() > 1 {
            error(
                "spec.source.nats",
                "at most one of credentialsSecretRef, nkeySecretRef, userSecretRef/passwordSecretRef and tokenSecretRef",
            );
        }
    }

    /// The dead-letter subject: valid, not read back by the filter, and no other broker's
    /// dead-letter settings.
    fn validate_dead_letter(&self, delivery: &Delivery, error: &mut dyn FnMut(&'static str, &str)) {
        if delivery.dead_letter.subject.as_deref().is_some_and(|s| {
            s.is_empty()
                || s.split('.')
                    .any(|token| token.is_empty() || token == "*" || token == ">")
        }) {
            error(
                "spec.delivery.deadLetter.subject",
                "must be a subject without wildcards or empty tokens",
            );
        }
        if let Some(filter) = &self.filter_subject {
            // The default dead-letter subjects are `<stream>.dlq.<subject>`.
            let dead_letters = delivery
                .dead_letter
                .subject
                .clone()
                .unwrap_or_else(|| format!("{}.dlq.>", self.stream));
            if subjects_overlap(filter, &dead_letters) {
                error(
                    "spec.source.nats.filterSubject",
                    &format!(
                        "{filter} matches the dead-letter subject {dead_letters} (spec.delivery.deadLetter.subject): the worker would read its own dead letters; choose a filter or a dead-letter subject that do not overlap"
                    ),
                );
            }
        }
        for field in delivery
            .dead_letter
            .set_fields()
            .filter(|field| !["spec.delivery.deadLetter.subject"].contains(field))
        {
            error(
                field,
                "is not for source nats; NATS dead letters go to deadLetter.subject",
            );
        }
    }
}

/// Whether some subject matches both `a` and `b` (NATS wildcards: `*` one token, `>` one or
/// more trailing tokens).
fn subjects_overlap(a: &str, b: &str) -> bool {
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split('.').collect(), b.split('.').collect());
    let mut index = 0;
    loop {
        match (a.get(index), b.get(index)) {
            (None, None) => return true,
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (Some(x), Some(y)) if x == y || *x == "*" || *y == "*" => index += 1,
            _ => return false,
        }
    }
}

fn default_consumer() -> String {
    "switchboard".into()
}

fn default_ack_wait_seconds() -> u32 {
    30
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(value: serde_json::Value) -> NatsSource {
        serde_json::from_value(value).expect("spec")
    }

    fn errors(source: &NatsSource, delivery: &Delivery) -> Vec<&'static str> {
        let mut fields = Vec::new();
        source.validate(delivery, &mut |error| fields.push(error.field));
        fields
    }

    #[test]
    fn defaults_and_secret_refs_become_the_workers_environment() {
        let source = spec(serde_json::json!({
            "stream": "ORDERS",
            "urlSecretRef": {"name": "nats", "key": "url"},
            "tokenSecretRef": {"name": "nats", "key": "token"},
        }));
        assert_eq!(source.consumer, "switchboard");
        assert_eq!(source.ack_wait_seconds, 30);
        assert_eq!(source.deliver_policy, NatsDeliverPolicy::All);
        let env: Vec<&str> = source
            .secret_env()
            .expect("refs")
            .iter()
            .map(|e| e.env)
            .collect();
        assert_eq!(env, ["NATS_URL", "NATS_TOKEN"]);
        let mut stripped = source.clone();
        stripped.strip_secrets();
        assert_eq!(
            stripped.secret_env(),
            Err(MissingSecret {
                field: "spec.source.nats.urlSecretRef",
                env: "NATS_URL"
            })
        );
        assert!(errors(&source, &Delivery::default()).is_empty());
    }

    #[test]
    fn a_filter_subject_matching_the_dead_letters_is_refused_naming_both_settings() {
        let overlapping = [
            ("ORDERS.>", None),
            (">", None),
            ("*.dlq.orders", None),
            ("dead.*", Some("dead.orders")),
            ("dead.orders", Some("dead.orders")),
        ];
        for (filter, subject) in overlapping {
            let source = spec(serde_json::json!({"stream": "ORDERS", "filterSubject": filter}));
            let mut delivery = Delivery::default();
            delivery.dead_letter.subject = subject.map(str::to_owned);
            let mut messages = Vec::new();
            source.validate(&delivery, &mut |error| {
                messages.push((error.field, error.message))
            });
            assert_eq!(messages.len(), 1, "{filter} / {subject:?}: {messages:?}");
            assert_eq!(messages[0].0, "spec.source.nats.filterSubject");
            assert!(
                messages[0].1.contains("spec.delivery.deadLetter.subject"),
                "{messages:?}"
            );
        }
        for (filter, subject) in [
            ("orders.>", None),
            ("orders.*", Some("dead.orders")),
            ("dead.orders.eu", Some("dead.orders")),
        ] {
            let source = spec(serde_json::json!({"stream": "ORDERS", "filterSubject": filter}));
            let mut delivery = Delivery::default();
            delivery.dead_letter.subject = subject.map(str::to_owned);
            assert!(
                errors(&source, &delivery).is_empty(),
                "{filter} / {subject:?}"
            );
        }
    }

    #[test]
    fn bad_names_two_auth_methods_and_other_brokers_dead_letters_are_refused() {
        let source = spec(serde_json::json!({
            "stream": "orders.eu",
            "consumer": "a b",
            "ackWaitSeconds": 0,
            "tokenSecretRef": {"name": "nats", "key": "token"},
            "nkeySecretRef": {"name": "nats", "key": "seed"},
        }));
        let mut delivery = Delivery::default();
        delivery.dead_letter.queue_url = Some("https://sqs.example/dlq".into());
        delivery.dead_letter.subject = Some("dead.>".into());
        assert_eq!(
            errors(&source, &delivery),
            [
                "spec.source.nats.stream",
                "spec.source.nats.consumer",
                "spec.source.nats.ackWaitSeconds",
                "spec.source.nats",
                "spec.delivery.deadLetter.subject",
                "spec.delivery.deadLetter.queueUrl",
            ]
        );
    }
}
