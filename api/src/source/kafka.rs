//! `spec.source.kafka`: topics of an Apache Kafka cluster, read by a consumer group.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::redis::StartFrom;
use super::{Broker, Messaging, MissingSecret, SecretEnv, Triggers};
use crate::{Autoscaling, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// How the worker reads from Kafka.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("[has(self.topics), has(self.topicPattern)].filter(x, x).size() == 1").message("spec.source.kafka: exactly one of topics and topicPattern must be set"),
    validation = Rule::new("!has(self.topicPattern) || self.topicPattern.startsWith('^')").message("spec.source.kafka.topicPattern must start with ^ (a regular expression over topic names)"),
    validation = Rule::new("!has(oldSelf.groupId) || (has(self.groupId) && self.groupId == oldSelf.groupId)").message("spec.source.kafka.groupId is immutable (another group starts from its own offsets); create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSource {
    /// Comma-separated `host:port` pairs of brokers to bootstrap from (`kafka-0.kafka:9092`).
    #[schemars(length(min = 1, max = 4096))]
    pub bootstrap_servers: String,
    /// The topics to read. They must exist, and must not include the dead-letter topic. Each
    /// record's idempotency key is `kafka:{namespace}/{name}:{topic}:{topic-id}:{partition}:{offset}`
    /// (the topic id tells a topic deleted and created again from the old one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 100))]
    pub topics: Option<Vec<String>>,
    /// A regular expression over topic names, starting with `^` (`^orders-[a-z]+$`), instead of
    /// `topics`: matching topics created later are picked up. It must not match the dead-letter
    /// topic (`deadLetter.topic`, default `<topic>.dlq`): the worker refuses to start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 1024))]
    pub topic_pattern: Option<String>,
    /// The consumer group. Default: `switchboard-{namespace}-{name}`. Cannot be changed after
    /// creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255))]
    pub group_id: Option<String>,
    /// Where a group with no committed offset for a partition starts: `earliest` takes every
    /// record still in the partition, `latest` only records produced afterwards.
    #[serde(default)]
    pub start_from: StartFrom,
    /// How long the group coordinator waits for a worker's heartbeat before it gives the
    /// worker's partitions to others (the broker's `group.min.session.timeout.ms` to
    /// `group.max.session.timeout.ms`).
    #[serde(default = "default_session_timeout_seconds")]
    #[schemars(range(min = 1, max = 3600))]
    pub session_timeout_seconds: u32,
    /// TLS to the brokers (the server certificate and host name are verified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<KafkaTls>,
    /// SASL authentication (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512). Use it with `tls`: PLAIN
    /// sends the password as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sasl: Option<KafkaSasl>,
}

/// TLS to the brokers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KafkaTls {
    /// The Secret key holding the PEM CA bundle that signed the brokers' certificates
    /// (`KAFKA_TLS_CA_PEM` in the pod). Default: the system's trusted roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

/// SASL authentication.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KafkaSasl {
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    pub mechanism: SaslMechanism,
    /// The Secret key holding the user name (`KAFKA_SASL_USERNAME` in the pod).
    pub username_secret_ref: SecretKeyRef,
    /// The Secret key holding the password (`KAFKA_SASL_PASSWORD` in the pod).
    pub password_secret_ref: SecretKeyRef,
}

/// A SASL mechanism librdkafka provides without Cyrus SASL.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    /// librdkafka's `sasl.mechanism` value.
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

impl KafkaSource {
    /// The consumer group of adapter `namespace/name`: `groupId`, else
    /// `switchboard-{namespace}-{name}`.
    pub fn group_id(&self, adapter: &str) -> String {
        self.group_id
            .clone()
            .unwrap_or_else(|| format!("switchboard-{}", adapter.replace('/', "-")))
    }
}

impl Broker for KafkaSource {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn mode(&self) -> &'static str {
        "group"
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        DeliveryGuarantee::AtLeastOnce
    }

    fn messaging(&self, adapter: &str) -> Messaging {
        let destination = match (&self.topics, &self.topic_pattern) {
            (Some(topics), _) => topics.join(","),
            (None, pattern) => pattern.clone().unwrap_or_default(),
        };
        Messaging {
            system: "kafka",
            destination,
            consumer_group: Some(self.group_id(adapter)),
        }
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        let mut env = Vec::new();
        if let Some(sasl) = &self.sasl {
            env.push(SecretEnv {
                env: "KAFKA_SASL_USERNAME",
                secret: &sasl.username_secret_ref,
            });
            env.push(SecretEnv {
                env: "KAFKA_SASL_PASSWORD",
                secret: &sasl.password_secret_ref,
            });
        }
        if let Some(ca) = self.tls.as_ref().and_then(|tls| tls.ca_secret_ref.as_ref()) {
            env.push(SecretEnv {
                env: "KAFKA_TLS_CA_PEM",
                secret: ca,
            });
        }
        Ok(env)
    }

    fn strip_secrets(&mut self) {
        if let Some(sasl) = &mut self.sasl {
            let removed = SecretKeyRef {
                name: String::new(),
                key: String::new(),
            };
            sasl.username_secret_ref = removed.clone();
            sasl.password_secret_ref = removed;
        }
        if let Some(tls) = &mut self.tls {
            tls.ca_secret_ref = None;
        }
    }

    /// The group's lag, which counts the records the workers hold: offsets are committed only
    /// after they are stored.
    fn autoscaling(&self, adapter: &str, autoscaling: &Autoscaling) -> Option<Triggers> {
        let mut metadata = json!({
            "bootstrapServers": self.bootstrap_servers,
            "consumerGroup": self.group_id(adapter),
            "lagThreshold": autoscaling.target_backlog_per_replica.to_string(),
            "activationLagThreshold": autoscaling.activation_backlog.to_string(),
            "offsetResetPolicy": match self.start_from {
                StartFrom::Earliest => "earliest",
                StartFrom::Latest => "latest",
            },
        });
        if let Some([topic]) = self.topics.as_deref() {
            metadata["topic"] = json!(topic);
        }
        Some(Triggers {
            triggers: vec![json!({"type": "kafka", "metadata": metadata})],
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
        if self.bootstrap_servers.trim().is_empty() {
            error("spec.source.kafka.bootstrapServers", "must not be empty");
        }
        match (&self.topics, &self.topic_pattern) {
            (Some(topics), None) => {
                if topics.is_empty() || topics.iter().any(|topic| topic.is_empty()) {
                    error(
                        "spec.source.kafka.topics",
                        "must name at least one topic, none empty",
                    );
                }
                if topics.iter().any(|topic| topic.starts_with('^')) {
                    error(
                        "spec.source.kafka.topics",
                        "a name starting with ^ is a pattern: use topicPattern",
                    );
                }
            }
            (None, Some(pattern)) => {
                if !pattern.starts_with('^') || pattern.len() < 2 {
                    error(
                        "spec.source.kafka.topicPattern",
                        "must start with ^ (a regular expression over topic names)",
                    );
                }
            }
            _ => error(
                "spec.source.kafka",
                "exactly one of topics and topicPattern must be set",
            ),
        }
        if let Some(topics) = &self.topics {
            let dead_letters = match &delivery.dead_letter.topic {
                Some(dead_letter) => topics.contains(dead_letter),
                None => topics
                    .iter()
                    .any(|topic| topics.contains(&format!("{topic}.dlq"))),
            };
            if dead_letters {
                error(
                    "spec.source.kafka.topics",
                    "includes the dead-letter topic (spec.delivery.deadLetter.topic, default \
                     <topic>.dlq): the worker would read its own dead letters",
                );
            }
        }
        if self.group_id.as_deref().is_some_and(str::is_empty) {
            error("spec.source.kafka.groupId", "must not be empty");
        }
        if !(1..=3600).contains(&self.session_timeout_seconds) {
            error(
                "spec.source.kafka.sessionTimeoutSeconds",
                "must be 1 to 3600",
            );
        }
        for field in delivery
            .dead_letter
            .set_fields()
            .filter(|field| !["spec.delivery.deadLetter.topic"].contains(field))
        {
            error(
                field,
                "is not for source kafka; Kafka dead letters go to deadLetter.topic",
            );
        }
    }
}

fn default_session_timeout_seconds() -> u32 {
    45
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(yaml: &str) -> KafkaSource {
        serde_yaml_ng::from_str(yaml).expect("a kafka source")
    }

    fn errors(source: &KafkaSource, delivery: &Delivery) -> Vec<&'static str> {
        let mut fields = Vec::new();
        source.validate(delivery, &mut |error| fields.push(error.field));
        fields
    }

    #[test]
    fn defaults_and_the_default_group_follow_the_adapter_name() {
        let kafka = source("{bootstrapServers: 'k:9092', topics: [orders]}");
        assert_eq!(kafka.group_id("shop/orders"), "switchboard-shop-orders");
        assert_eq!(kafka.session_timeout_seconds, 45);
        assert_eq!(kafka.start_from, StartFrom::Earliest);
        assert!(errors(&kafka, &Delivery::default()).is_empty());
        assert!(kafka.secret_env().expect("no secrets needed").is_empty());
    }

    #[test]
    fn exactly_one_of_topics_and_pattern_and_no_other_brokers_dead_letter_target() {
        let both = source("{bootstrapServers: k, topics: [a], topicPattern: '^a'}");
        assert_eq!(errors(&both, &Delivery::default()), ["spec.source.kafka"]);
        let pattern = source("{bootstrapServers: k, topicPattern: 'a.*'}");
        assert_eq!(
            errors(&pattern, &Delivery::default()),
            ["spec.source.kafka.topicPattern"]
        );
        let mut delivery = Delivery::default();
        delivery.dead_letter.queue_url = Some("http://q".into());
        let kafka = source("{bootstrapServers: k, topics: [a]}");
        assert_eq!(
            errors(&kafka, &delivery),
            ["spec.delivery.deadLetter.queueUrl"]
        );
    }

    #[test]
    fn topics_that_include_their_own_dead_letter_topic_are_refused() {
        let kafka = source("{bootstrapServers: k, topics: [orders, orders.dlq]}");
        assert_eq!(
            errors(&kafka, &Delivery::default()),
            ["spec.source.kafka.topics"]
        );
        let mut delivery = Delivery::default();
        delivery.dead_letter.topic = Some("orders.dead".into());
        assert!(errors(&kafka, &delivery).is_empty());
        let kafka = source("{bootstrapServers: k, topics: [orders, orders.dead]}");
        assert_eq!(errors(&kafka, &delivery), ["spec.source.kafka.topics"]);
    }

    #[test]
    fn sasl_and_tls_secrets_become_env_and_are_stripped() {
        let mut kafka = source(
            "{bootstrapServers: k, topics: [a], tls: {caSecretRef: {name: ca, key: pem}}, \
             sasl: {mechanism: SCRAM-SHA-512, usernameSecretRef: {name: u, key: user}, \
             passwordSecretRef: {name: p, key: pass}}}",
        );
        let env: Vec<&str> = kafka
            .secret_env()
            .expect("refs")
            .iter()
            .map(|secret| secret.env)
            .collect();
        assert_eq!(
            env,
            [
                "KAFKA_SASL_USERNAME",
                "KAFKA_SASL_PASSWORD",
                "KAFKA_TLS_CA_PEM"
            ]
        );
        kafka.strip_secrets();
        let text = serde_json::to_string(&kafka).expect("json");
        assert!(
            !text.contains("\"key\":\"user\"")
                && !text.contains("\"key\":\"pass\"")
                && !text.contains("caSecretRef"),
            "{text}"
        );
    }
}
