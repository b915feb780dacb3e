//! The subscription: the topics read (named, or a pattern), checked at start (a named topic
//! must exist; no topic read may be a dead-letter topic of the adapter), their ids read before
//! any partition is assigned.

use std::collections::BTreeSet;
use std::sync::Arc;

use rdkafka::consumer::Consumer;
use rdkafka::metadata::Metadata;

use super::client::{Setting, classify};
use super::probe::Topics;
use super::{Kafka, REQUEST_TIMEOUT};
use crate::transport::TransportError;

impl Kafka {
    pub(super) fn topics(&self) -> Result<Topics, TransportError> {
        match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(topics), _) => Ok(Topics::Named(topics.clone())),
            (None, Some(pattern)) => {
                regex::Regex::new(pattern)
                    .map(Topics::Pattern)
                    .map_err(|err| {
                        TransportError::fatal(
                            "spec.source.kafka.topicPattern",
                            format!("is not a regular expression: {err}"),
                            None,
                        )
                    })
            }
            (None, None) => Err(TransportError::fatal(
                "spec.source.kafka",
                "one of topics and topicPattern must be set",
                None,
            )),
        }
    }

    /// Checks the topics and the dead-letter topic, reads the ids of the topics read now, and
    /// subscribes (a `topicPattern` is librdkafka's `^` regex).
    pub(super) async fn subscribe(&mut self) -> Result<(), TransportError> {
        let topics = self.topics()?;
        if let Some(dead_letter) = &self.dead_letter_topic {
            self.refuse_own_dead_letters(dead_letter)?;
        }
        // The topics read now: their ids are read before any partition is assigned, so their
        // first records need not be fetched again (see `identify`).
        let read_now = match &topics {
            Topics::Named(names) => self.check_named_topics(names).await?,
            Topics::Pattern(_) => self.topics_matching_now().await?,
        };
        if !read_now.is_empty() {
            self.describe(read_now).await?;
        }
        let subscription: Vec<&str> = match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(names), _) => names.iter().map(String::as_str).collect(),
            (None, Some(pattern)) => vec![pattern.as_str()],
            (None, None) => Vec::new(),
        };
        self.consumer
            .subscribe(&subscription)
            .map_err(|err| classify(err, "could not subscribe", Setting::Topics))
    }

    /// Fails (fatal) when a named topic is a dead-letter topic of the adapter or does not exist;
    /// returns them.
    async fn check_named_topics(
        &self,
        names: &[String],
    ) -> Result<BTreeSet<Arc<str>>, TransportError> {
        for name in names {
            self.refuse_own_dead_letters(name)?;
        }
        for name in names {
            let metadata = self
                .metadata(Some(name), "could not read the topic's metadata")
                .await?;
            let missing = metadata
                .topics()
                .iter()
                .find(|topic| topic.name() == name)
                .is_none_or(|topic| topic.error().is_some() || topic.partitions().is_empty());
            if missing {
                return Err(TransportError::fatal(
                    "spec.source.kafka.topics",
                    format!("the topic {name:?} does not exist"),
                    None,
                ));
            }
        }
        Ok(names.iter().map(|name| Arc::from(name.as_str())).collect())
    }

    /// The topics the pattern matches now, each checked with its default dead-letter topic
    /// (created or not); a topic created later is checked when its first record comes.
    async fn topics_matching_now(&self) -> Result<BTreeSet<Arc<str>>, TransportError> {
        let metadata = self
            .metadata(None, "could not read the topics' metadata")
            .await?;
        let mut matching = BTreeSet::new();
        for topic in metadata.topics() {
            if self.reads(topic.name()) {
                self.refuse_own_dead_letters(topic.name())?;
                self.refuse_own_dead_letters(&self.dead_letter_topic(topic.name()))?;
                matching.insert(Arc::from(topic.name()));
            }
        }
        Ok(matching)
    }

    /// The brokers' metadata of `topic` (of every topic with `None`).
    async fn metadata(
        &self,
        topic: Option<&str>,
        failed: &str,
    ) -> Result<Metadata, TransportError> {
        let consumer = self.consumer.clone();
        let topic = topic.map(str::to_owned);
        crate::task::spawn_blocking(move || {
            consumer.fetch_metadata(topic.as_deref(), REQUEST_TIMEOUT)
        })
        .await
        .map_err(|err| TransportError::protocol(format!("the metadata task failed: {err}")))?
        .map_err(|err| classify(err, failed, Setting::Topics))
    }

    /// Fails (fatal, naming both settings) when the subscription reads `topic` and it is a
    /// dead-letter topic of the adapter: the worker would read its own dead letters, and
    /// dead-letter them again.
    pub(super) fn refuse_own_dead_letters(&self, topic: &str) -> Result<(), TransportError> {
        let dead_letters = match &self.dead_letter_topic {
            Some(dead_letter) => dead_letter == topic,
            None => topic
                .strip_suffix(".dlq")
                .is_some_and(|origin| self.reads(origin)),
        };
        if !dead_letters || !self.reads(topic) {
            return Ok(());
        }
        let (setting, value) = match (&self.spec.topics, &self.spec.topic_pattern) {
            (Some(topics), _) => ("spec.source.kafka.topics", topics.join(",")),
            (None, pattern) => (
                "spec.source.kafka.topicPattern",
                pattern.clone().unwrap_or_default(),
            ),
        };
        Err(TransportError::fatal(
            setting,
            format!(
                "{setting} ({value}) includes the dead-letter topic {topic:?} \
                 (spec.delivery.deadLetter.topic, default <topic>.dlq): the worker would read its \
                 own dead letters; set spec.delivery.deadLetter.topic to a topic the \
                 subscription does not include, or narrow the subscription"
            ),
            None,
        ))
    }

    /// Whether the subscription reads `topic`.
    fn reads(&self, topic: &str) -> bool {
        self.topics().is_ok_and(|topics| topics.matches(topic))
    }
}
