//! Retention of the dead-letter topics: each one's `retention.ms` is read (DescribeConfigs)
//! the first time the worker meets it, at start for the dead-letter topics of named topics and
//! before the first letter to any other (a topic that does not exist yet, before the letter
//! after the one that made it, where brokers create topics on first produce). Shorter than `deadLetter.retentionDays` (`-1`,
//! infinite, is not), it is raised with AlterConfigs. rdkafka has no IncrementalAlterConfigs,
//! and AlterConfigs resets every setting it is not given: the topic's own settings
//! (`DYNAMIC_TOPIC_CONFIG`) are sent again with it. A refusal (denied, a policy, an invalid
//! value) is fatal naming `retentionDays`, unless `acceptShorterRetention`, which leaves the
//! topic as it is with a warning. A bounded `retention.bytes` is warned about: it can delete
//! letters sooner, and no number of bytes follows from a number of days.

use std::collections::HashSet;
use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, ConfigResource, ConfigSource, ResourceSpecifier,
};
use rdkafka::error::RDKafkaErrorCode;
use switchboard_api::KafkaSource;

use super::client::{LogContext, Setting, base_config, classify};
use crate::transport::retention::Retention;
use crate::transport::{SourceRetention, TransportError};

/// How long one admin request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The dead-letter topics' retention, held once per topic.
pub struct DeadLetterRetention {
    retention: Retention,
    spec: KafkaSource,
    client_id: String,
    admin: Option<AdminClient<LogContext>>,
    held: HashSet<String>,
}

impl DeadLetterRetention {
    pub fn new(retention: Retention, spec: &KafkaSource, client_id: &str) -> Self {
        Self {
            retention,
            spec: spec.clone(),
            client_id: format!("{client_id}-admin"),
            admin: None,
            held: HashSet::new(),
        }
    }

    /// Holds the retention of each of `topics` not held yet (see the module doc).
    pub async fn hold(
        &mut self,
        topics: impl IntoIterator<Item = String>,
    ) -> Result<(), TransportError> {
        for topic in topics {
            if !self.held.contains(&topic) && self.hold_one(&topic).await? {
                self.held.insert(topic);
            }
        }
        Ok(())
    }

    fn admin(&mut self) -> Result<&AdminClient<LogContext>, TransportError> {
        if self.admin.is_none() {
            let admin = base_config(&self.spec, &self.client_id)?
                .create_with_context(LogContext::current())
                .map_err(|err| {
                    classify(
                        err,
                        "could not create the admin client",
                        Setting::DeadLetterTopic,
                    )
                })?;
            self.admin = Some(admin);
        }
        Ok(self.admin.as_ref().expect("created above"))
    }

    /// Holds the retention of `topic`; `false` when the topic does not exist yet (a broker
    /// that creates topics on first produce makes it with the first letter: held before the
    /// next one).
    async fn hold_one(&mut self, topic: &str) -> Result<bool, TransportError> {
        let retention = self.retention;
        let options = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
        let context = format!("could not read the configuration of dead-letter topic {topic:?}");
        let described = self
            .admin()?
            .describe_configs([&ResourceSpecifier::Topic(topic)], &options)
            .await
            .map_err(|err| classify(err, &context, Setting::DeadLetterTopic))?;
        let config = match described.into_iter().next() {
            Some(Ok(config)) => config,
            Some(Err(
                RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic,
            )) => {
                tracing::debug!(
                    topic,
                    "the dead-letter topic does not exist yet: its retention is checked before the next letter"
                );
                return Ok(false);
            }
            Some(Err(code)) => {
                let err = described_error(code, &context);
                if err.is_fatal() && retention.accept_shorter {
                    tracing::warn!(topic, error = %switchboard_telemetry::ErrorChain(&err), "the dead-letter topic's retention.ms is not checked (accepted: deadLetter.acceptShorterRetention)");
                    return Ok(true);
                }
                return Err(err);
            }
            None => return Err(TransportError::protocol(context)),
        };
        warn_bounded_bytes(topic, &config);
        let kept = milliseconds(&config, "retention.ms");
        let Some(kept) = kept.filter(|kept| retention.too_short(Some(*kept))) else {
            return Ok(true);
        };
        if retention.accept_shorter {
            return retention
                .refused(topic, kept, "not raised: accepted as it is")
                .map(|()| true);
        }
        let wanted = retention.wanted.as_millis().to_string();
        let mut alter = AlterConfig::new(ResourceSpecifier::Topic(topic));
        for entry in &config.entries {
            if entry.source == ConfigSource::DynamicTopic
                && entry.name != "retention.ms"
                && let Some(value) = &entry.value
            {
                alter = alter.set(&entry.name, value);
            }
        }
        alter = alter.set("retention.ms", &wanted);
        let context = format!("could not raise retention.ms of dead-letter topic {topic:?}");
        let altered = self
            .admin()?
            .alter_configs([&alter], &options)
            .await
            .map_err(|err| classify(err, &context, Setting::DeadLetterTopic))?;
        match altered.into_iter().next() {
            Some(Ok(_)) => {
                tracing::info!(
                    topic,
                    from_ms = kept.as_millis(),
                    to_ms = %wanted,
                    "raised the dead-letter topic's retention.ms to deadLetter.retentionDays"
                );
                Ok(true)
            }
            Some(Err((_, code))) if passes(code) => Err(TransportError::transient(context, code)),
            Some(Err((_, code))) => retention
                .refused(topic, kept, format!("AlterConfigs retention.ms: {code}"))
                .map(|()| true),
            None => Err(TransportError::protocol(context)),
        }
    }
}

impl DeadLetterRetention {
    /// The longest `retention.ms` of the source's `topics`, read once at start with the same
    /// admin client. Best effort: a topic that cannot be described leaves it unknown.
    pub async fn of_sources(&mut self, topics: &[String]) -> SourceRetention {
        if topics.is_empty() {
            return SourceRetention::Unknown;
        }
        let options = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
        let specifiers: Vec<ResourceSpecifier<'_>> = topics
            .iter()
            .map(|topic| ResourceSpecifier::Topic(topic.as_str()))
            .collect();
        let described = match self.admin() {
            Ok(admin) => admin.describe_configs(&specifiers, &options).await,
            Err(err) => {
                tracing::debug!(error = %switchboard_telemetry::ErrorChain(&err), "the source topics' retention.ms is not read");
                return SourceRetention::Unknown;
            }
        };
        let Ok(described) = described else {
            return SourceRetention::Unknown;
        };
        let mut longest = SourceRetention::Unknown;
        for (topic, config) in topics.iter().zip(described) {
            let Ok(config) = config else {
                return SourceRetention::Unknown;
            };
            let setting = format!("retention.ms of topic {topic}");
            match milliseconds(&config, "retention.ms") {
                None if config.get("retention.ms").is_some() => {
                    return SourceRetention::Unbounded { setting };
                }
                None => return SourceRetention::Unknown,
                Some(kept) => {
                    if !matches!(&longest, SourceRetention::Bounded { kept: longer, .. } if *longer >= kept)
                    {
                        longest = SourceRetention::Bounded { kept, setting };
                    }
                }
            }
        }
        longest
    }
}

/// A duration setting in milliseconds; `None` when unset or negative (infinite).
fn milliseconds(config: &ConfigResource, name: &str) -> Option<Duration> {
    let value: i64 = config.get(name)?.value.as_deref()?.parse().ok()?;
    u64::try_from(value).ok().map(Duration::from_millis)
}

/// Warns when `retention.bytes` bounds the topic: letters may go before `retentionDays`.
fn warn_bounded_bytes(topic: &str, config: &ConfigResource) {
    let bytes = config
        .get("retention.bytes")
        .and_then(|entry| entry.value.as_deref())
        .and_then(|value| value.parse::<i64>().ok());
    if let Some(bytes) = bytes.filter(|bytes| *bytes >= 0) {
        tracing::warn!(
            topic,
            retention_bytes = bytes,
            "the dead-letter topic's retention.bytes can delete letters before deadLetter.retentionDays: set it to -1"
        );
    }
}

/// Whether an AlterConfigs error code may pass with time.
fn passes(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as Code;
    matches!(
        code,
        Code::RequestTimedOut
            | Code::OperationTimedOut
            | Code::NotController
            | Code::BrokerNotAvailable
            | Code::LeaderNotAvailable
            | Code::NetworkException
            | Code::BrokerTransportFailure
            | Code::AllBrokersDown
            | Code::CoordinatorNotAvailable
    )
}

/// The error of a DescribeConfigs answered `code`: a denied read is fatal naming
/// `deadLetter.topic`; anything else may pass.
fn described_error(code: RDKafkaErrorCode, context: &str) -> TransportError {
    use RDKafkaErrorCode as Code;
    match code {
        Code::TopicAuthorizationFailed | Code::ClusterAuthorizationFailed => TransportError::fatal(
            "spec.delivery.deadLetter.topic",
            format!(
                "{context}: DescribeConfigs is denied (needed to hold deadLetter.retentionDays)"
            ),
            None,
        ),
        code => TransportError::transient(context.to_owned(), code),
    }
}
