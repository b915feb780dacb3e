//! `spec.source.redis`: a Redis stream (consumer group), reliable list, or pub/sub channel.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Broker, Messaging, MissingSecret, SecretEnv, Triggers};
use crate::{Autoscaling, DeadLetter, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// How the worker reads from Redis.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(
    validation = Rule::new("self.mode != 'stream' || has(self.stream)").message("spec.source.redis.stream is required when mode is stream"),
    validation = Rule::new("self.mode != 'list' || has(self.list)").message("spec.source.redis.list is required when mode is list"),
    validation = Rule::new("self.mode != 'pubsub' || has(self.channel)").message("spec.source.redis.channel is required when mode is pubsub"),
    validation = Rule::new("self.mode == oldSelf.mode").message("spec.source.redis.mode is immutable; create a new QueueAdapter instead"),
    validation = Rule::new("!has(oldSelf.stream) || (has(self.stream) && self.stream == oldSelf.stream)").message("spec.source.redis.stream is immutable (entry ids of another stream would be taken for redeliveries); create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct RedisSource {
    /// `stream` (consumer group, at-least-once, recommended), `list` (reliable list,
    /// at-least-once) or `pubsub` (at-most-once: messages published while no worker is
    /// subscribed are lost). Cannot be changed after creation.
    #[serde(default)]
    pub mode: RedisMode,
    /// The stream key to read (mode `stream`). Created if missing. Cannot be changed after
    /// creation: create a new QueueAdapter for another stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub stream: Option<String>,
    /// The consumer group (mode `stream`). Created if missing.
    #[serde(default = "default_group")]
    #[schemars(length(min = 1, max = 256))]
    pub group: String,
    /// Where a newly created consumer group starts (mode `stream`): `earliest` takes every entry
    /// already in the stream, `latest` only entries added afterwards.
    #[serde(default)]
    pub start_from: StartFrom,
    /// The list key producers LPUSH to (mode `list`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub list: Option<String>,
    /// The channel to subscribe to (mode `pubsub`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub channel: Option<String>,
    /// Treat `channel` as a glob pattern (PSUBSCRIBE) (mode `pubsub`).
    #[serde(default)]
    pub pattern: bool,
    /// The stream entry field that holds the message body (mode `stream`). The entry's other
    /// fields become the event's headers; an entry without this field is stored whole, as a JSON
    /// object of all its fields.
    #[serde(default = "default_body_field")]
    #[schemars(length(min = 1, max = 256))]
    pub body_field: String,
    /// The Secret key holding the Redis URL (`redis://user:password@host:6379/0`, or
    /// `rediss://` for TLS, which verifies the server certificate). Passed to the worker as the
    /// `REDIS_URL` environment variable; never copied into the spec, status or database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,
}

/// Redis consumption mode.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    #[default]
    Stream,
    List,
    Pubsub,
}

/// Where a newly created consumer group starts reading.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum StartFrom {
    #[default]
    Earliest,
    Latest,
}

impl RedisMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RedisMode::Stream => "stream",
            RedisMode::List => "list",
            RedisMode::Pubsub => "pubsub",
        }
    }
}

impl RedisSource {
    /// The key dead letters go to in this mode: `spec.delivery.deadLetter.stream` (mode
    /// `stream`) or `.list` (modes `list` and `pubsub`), by default the source's key with
    /// `.dlq` appended.
    pub fn dead_letter_key(&self, dead_letter: &DeadLetter) -> String {
        let (set, source) = match self.mode {
            RedisMode::Stream => (&dead_letter.stream, &self.stream),
            RedisMode::List => (&dead_letter.list, &self.list),
            RedisMode::Pubsub => (&dead_letter.list, &self.channel),
        };
        set.clone().unwrap_or_else(|| {
            let source = source.as_deref().unwrap_or_default();
            format!("{source}.dlq")
        })
    }
}

impl Broker for RedisSource {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn mode(&self) -> &'static str {
        self.mode.as_str()
    }

    fn guarantee(&self) -> DeliveryGuarantee {
        match self.mode {
            RedisMode::Stream | RedisMode::List => DeliveryGuarantee::AtLeastOnce,
            RedisMode::Pubsub => DeliveryGuarantee::AtMostOnce,
        }
    }

    fn messaging(&self, _adapter: &str) -> Messaging {
        let destination = match self.mode {
            RedisMode::Stream => &self.stream,
            RedisMode::List => &self.list,
            RedisMode::Pubsub => &self.channel,
        };
        Messaging {
            system: "redis",
            destination: destination.clone().unwrap_or_default(),
            consumer_group: (self.mode == RedisMode::Stream).then(|| self.group.clone()),
        }
    }

    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret> {
        let secret = self.url_secret_ref.as_ref().ok_or(MissingSecret {
            field: "spec.source.redis.urlSecretRef",
            env: "REDIS_URL",
        })?;
        Ok(vec![SecretEnv {
            env: "REDIS_URL",
            secret,
        }])
    }

    fn strip_secrets(&mut self) {
        self.url_secret_ref = None;
    }

    /// A stream's consumer-group lag (what waits; the only count KEDA can scale to zero on) and
    /// its pending entries (what the workers hold): KEDA scales to the larger of the two.
    fn autoscaling(&self, _adapter: &str, autoscaling: &Autoscaling) -> Option<Triggers> {
        let stream = self.stream.clone().unwrap_or_default();
        let target = autoscaling.target_backlog_per_replica.to_string();
        let triggers = vec![
            json!({
                "type": "redis-streams",
                "metadata": {
                    "stream": stream,
                    "consumerGroup": self.group,
                    "lagCount": target,
                    "activationLagCount": autoscaling.activation_backlog.to_string(),
                },
            }),
            json!({
                "type": "redis-streams",
                "metadata": {
                    "stream": stream,
                    "consumerGroup": self.group,
                    "pendingEntriesCount": target,
                },
            }),
        ];
        Some(Triggers {
            triggers,
            authentication: None,
        })
    }

    fn validate(&self, delivery: &Delivery, fail: &mut dyn FnMut(FieldError)) {
        let mut error = |field: &'static str, message: String| fail(FieldError { field, message });
        let required = match self.mode {
            RedisMode::Stream => ("spec.source.redis.stream", &self.stream),
            RedisMode::List => ("spec.source.redis.list", &self.list),
            RedisMode::Pubsub => ("spec.source.redis.channel", &self.channel),
        };
        if required.1.as_deref().is_none_or(str::is_empty) {
            error(
                required.0,
                format!("required when mode is {}", self.mode.as_str()),
            );
        }
        if self.group.is_empty() {
            error("spec.source.redis.group", "must not be empty".into());
        }
        if self.body_field.is_empty() {
            error("spec.source.redis.bodyField", "must not be empty".into());
        }
        for field in delivery.dead_letter.set_fields().filter(|field| {
            ![
                "spec.delivery.deadLetter.stream",
                "spec.delivery.deadLetter.list",
            ]
            .contains(field)
        }) {
            error(
                field,
                "is not for source redis; Redis dead letters go to deadLetter.stream or deadLetter.list".into(),
            );
        }
    }
}

fn default_group() -> String {
    "switchboard".into()
}
fn default_body_field() -> String {
    "body".into()
}

#[cfg(test)]
mod tests {
    use crate::{DeadLetter, RedisSource};

    fn redis(mode: &str) -> RedisSource {
        serde_json::from_value(serde_json::json!({
            "mode": mode, "stream": "orders", "list": "jobs", "channel": "news",
        }))
        .expect("a Redis source")
    }

    #[test]
    fn dead_letters_go_to_the_set_key_else_the_source_key_with_dlq() {
        let unset = DeadLetter::default();
        assert_eq!(redis("stream").dead_letter_key(&unset), "orders.dlq");
        assert_eq!(redis("list").dead_letter_key(&unset), "jobs.dlq");
        assert_eq!(redis("pubsub").dead_letter_key(&unset), "news.dlq");
        let set = DeadLetter {
            stream: Some("dead-orders".into()),
            list: Some("dead-jobs".into()),
            ..DeadLetter::default()
        };
        assert_eq!(redis("stream").dead_letter_key(&set), "dead-orders");
        assert_eq!(redis("list").dead_letter_key(&set), "dead-jobs");
        assert_eq!(redis("pubsub").dead_letter_key(&set), "dead-jobs");
    }
}
