//! Topic incarnations: the ids of the topics read (described through `topic_id.rs`), a
//! record's keys set only once its topic's incarnation is certain, and a topic deleted and
//! created again read from its beginning under new epochs.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};

use super::client::{Setting, classify};
use super::offsets::TopicPartition;
use super::topic_id::{Described, describe_topics};
use super::{Kafka, REQUEST_TIMEOUT};
use crate::transport::TransportError;
use crate::transport::identity::idempotency_key;

/// What is known of a topic's incarnation.
#[derive(Debug, Clone)]
pub(super) struct Incarnation {
    /// The topic's id; `None` where the brokers keep none.
    id: Option<Arc<str>>,
    /// When the first read that returned this id completed: the topic was this incarnation
    /// then, and is until a read returns another id.
    seen: Instant,
}

impl Kafka {
    /// Sets the keys of the records in hand whose incarnation is certain, when the first `max`
    /// (the batch asked for) are not all set: one read then proves every record taken ahead
    /// too, so most receives read none. The ids
    /// of their topics are read now, after every record in hand was taken from librdkafka; a
    /// record takes its topic's id only if that id was read before its partition's epoch began,
    /// so before the record was fetched: ids are never re-used, so the topic was that
    /// incarnation from then until now. Records of a topic the brokers do not describe now
    /// (deleted) stay in hand, without keys. A topic whose id changed was re-created (see
    /// [`Kafka::recreated`]); a partition whose records were fetched before its topic's id was
    /// first read is fetched again from its first record in hand, under a new epoch.
    pub(super) async fn identify(&mut self, max: usize) -> Result<(), TransportError> {
        if self
            .fetched
            .iter()
            .take(max)
            .all(|fetched| fetched.identified)
        {
            return Ok(());
        }
        let wanted: BTreeSet<Arc<str>> = self
            .fetched
            .iter()
            .filter(|fetched| !fetched.identified)
            .map(|fetched| fetched.message.receipt.partition.topic.clone())
            .collect();
        for topic in &wanted {
            if !self.topic_ids.contains_key(topic) {
                // A topic read for the first time (a pattern picks up topics created later).
                self.refuse_own_dead_letters(topic)?;
            }
        }
        let existing = self.describe(wanted).await?;
        let unproven = self.set_keys(&existing);
        self.fetch_again(unproven);
        Ok(())
    }

    /// Sets the keys of the records in hand of the `existing` topics whose incarnation was
    /// known before their partition's epoch began; returns the partitions of those whose
    /// incarnation was read only later.
    fn set_keys(&mut self, existing: &BTreeSet<Arc<str>>) -> BTreeSet<TopicPartition> {
        let mut unproven = BTreeSet::new();
        let offsets = self.state.offsets();
        for fetched in self.fetched.iter_mut() {
            let receipt = &fetched.message.receipt;
            if fetched.identified || !existing.contains(&receipt.partition.topic) {
                continue;
            }
            let (Some(known), Some(began)) = (
                self.topic_ids.get(&receipt.partition.topic),
                offsets.began(&receipt.partition, receipt.epoch),
            ) else {
                // Revoked since it was fetched: dropped by the next receive.
                continue;
            };
            if known.seen > began {
                unproven.insert(receipt.partition.clone());
                continue;
            }
            let message = &mut fetched.message;
            message.receipt.topic_id = known.id.clone();
            message.external_id = message.receipt.external_id();
            message.idempotency_key = idempotency_key(&self.source, &message.external_id);
            fetched.identified = true;
        }
        unproven
    }

    /// Fetches `partitions` again from their first record in hand, under new epochs: their
    /// records were fetched before their topic's id was first read.
    fn fetch_again(&mut self, partitions: BTreeSet<TopicPartition>) {
        if partitions.is_empty() {
            return;
        }
        let restarts: Vec<(TopicPartition, Offset)> = partitions
            .into_iter()
            .filter_map(|partition| {
                let first = self
                    .fetched
                    .iter()
                    .map(|fetched| &fetched.message.receipt)
                    .filter(|receipt| receipt.partition == partition)
                    .map(|receipt| receipt.offset)
                    .min()?;
                Some((partition, Offset::Offset(first)))
            })
            .collect();
        tracing::info!(
            partitions = ?restarts.iter().map(|(partition, _)| partition.name()).collect::<Vec<_>>(),
            "records fetched before their topic's id was first read are fetched again"
        );
        self.restart_epochs(&restarts);
    }

    /// Reads the ids of `topics` and records them; a topic whose id changed was re-created.
    /// Returns the topics the brokers described (they exist now); a topic they do not describe
    /// keeps the id last read.
    pub(super) async fn describe(
        &mut self,
        topics: BTreeSet<Arc<str>>,
    ) -> Result<BTreeSet<Arc<str>>, TransportError> {
        // Through the probe's client, never the consumer's: a request on the consumer's
        // connection waits behind its fetch, which the broker may hold for up to
        // `fetch.wait.max.ms` (500 ms) when a partition has nothing new.
        let probe = self.probe.clone();
        let names: Vec<String> = topics.iter().map(|topic| topic.to_string()).collect();
        let described = crate::task::spawn_blocking(move || {
            describe_topics(probe.client(), &names, REQUEST_TIMEOUT)
        })
        .await
        .map_err(|err| TransportError::protocol(format!("the describe task failed: {err}")))?
        .map_err(|err| classify(err, "could not describe the topics", Setting::Topics))?;
        let seen = Instant::now();
        let mut existing = BTreeSet::new();
        for (name, described) in described {
            let Described::Exists(id) = described else {
                continue;
            };
            let topic: Arc<str> = Arc::from(name);
            existing.insert(topic.clone());
            let id = id.map(Arc::<str>::from);
            let previous = match self.topic_ids.get(&topic) {
                Some(known) if known.id == id => continue,
                previous => previous.map(|known| known.id.clone()),
            };
            self.topic_ids.insert(
                topic.clone(),
                Incarnation {
                    id: id.clone(),
                    seen,
                },
            );
            if let Some(previous) = previous {
                self.recreated(&topic, previous.as_deref(), id.as_deref());
            }
        }
        Ok(existing)
    }

    /// `topic` was deleted and created again (its id changed): its owned partitions are read
    /// again from their beginning under new epochs (every record of the new incarnation is new;
    /// the old one's acknowledgements are stale and commit nothing), and what is in hand of it
    /// is dropped.
    fn recreated(&mut self, topic: &Arc<str>, old: Option<&str>, new: Option<&str>) {
        let partitions = self.state.offsets().owned_of(topic);
        tracing::warn!(
            topic = %topic,
            old_topic_id = old.unwrap_or("none"),
            new_topic_id = new.unwrap_or("none"),
            partitions = partitions.len(),
            "the topic was deleted and created again: its records are new messages, read from its beginning"
        );
        self.fetched
            .retain(|fetched| fetched.message.receipt.partition.topic != *topic);
        let restarts: Vec<(TopicPartition, Offset)> = partitions
            .iter()
            .map(|partition| (partition.clone(), Offset::Beginning))
            .collect();
        self.restart_epochs(&restarts);
        // Committed offsets are kept by topic name: a commit of the old incarnation still in
        // flight could land on the new topic, and a worker that died then would leave the group
        // past the new topic's first records. The new incarnation's beginning is committed
        // after it (same coordinator, in order), synchronously.
        let beginnings = partitions
            .into_iter()
            .map(|partition| (partition, 0))
            .collect();
        if let Err(err) = self.commit(beginnings, CommitMode::Sync) {
            tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), topic = %topic, "could not commit the re-created topic's beginning");
        }
    }

    /// Fetches each owned partition again from its offset, under a new epoch: its records in
    /// hand are dropped, and those librdkafka fetched before are discarded by it.
    fn restart_epochs(&mut self, restarts: &[(TopicPartition, Offset)]) {
        if restarts.is_empty() {
            return;
        }
        self.fetched.retain(|fetched| {
            restarts
                .iter()
                .all(|(partition, _)| *partition != fetched.message.receipt.partition)
        });
        let mut list = TopicPartitionList::new();
        {
            let mut offsets = self.state.offsets();
            for (partition, offset) in restarts {
                offsets.restart_epoch(partition);
                let _ = list.add_partition_offset(&partition.topic, partition.partition, *offset);
            }
        }
        if let Err(err) = self
            .consumer
            .incremental_unassign(&list)
            .and_then(|()| self.consumer.incremental_assign(&list))
        {
            tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not restart the partitions' fetch");
        }
    }
}
