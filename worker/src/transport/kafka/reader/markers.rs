//! Removal from the dead-letter topic: Kafka deletes only a partition's prefix
//! (`DeleteRecords`); a letter further in is marked removed first (see the reader's doc).

use std::collections::{BTreeMap, BTreeSet};

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};

use super::{KafkaReader, PRODUCE_TIMEOUT, REQUEST_TIMEOUT};
use crate::transport::TransportError;
use crate::transport::kafka::client::{Setting, classify};

/// The removal markers read and written: what they mark, and where each one is.
#[derive(Debug, Default)]
pub(super) struct Markers {
    pub(super) topic: String,
    /// Whether the marker topic exists.
    pub(super) exists: bool,
    /// The marker topic's low watermark (markers before it are deleted).
    pub(super) low: i64,
    /// Offsets marked removed, per partition of the dead-letter topic.
    pub(super) removed: BTreeMap<i32, BTreeSet<i64>>,
    /// Each marker's offset in the marker topic and the letter it marks, in offset order.
    pub(super) written: Vec<(i64, i32, i64)>,
}

impl Markers {
    pub(super) fn contains(&self, partition: i32, offset: i64) -> bool {
        self.removed
            .get(&partition)
            .is_some_and(|offsets| offsets.contains(&offset))
    }

    pub(super) fn insert(&mut self, at: i64, partition: i32, offset: i64) {
        self.removed.entry(partition).or_default().insert(offset);
        self.written.push((at, partition, offset));
    }
}

impl KafkaReader {
    /// Removes `offsets` of `partition`: the prefix they complete is deleted, the others are
    /// marked first.
    pub(super) async fn remove_from(
        &mut self,
        partition: i32,
        offsets: BTreeSet<i64>,
    ) -> Result<(), TransportError> {
        let (low, _) = self.watermarks(&self.topic, partition)?;
        let mut start = low;
        while offsets.contains(&start) || self.markers.contains(partition, start) {
            start += 1;
        }
        let marked: Vec<i64> = offsets.range(start..).copied().collect();
        if !marked.is_empty() {
            self.mark(partition, &marked).await?;
        }
        if start > low {
            let topic = self.topic.clone();
            self.delete_records(&topic, partition, start).await?;
        }
        Ok(())
    }

    /// Writes a removal marker for each of `offsets` of `partition` and waits until all
    /// replicas hold them.
    async fn mark(&mut self, partition: i32, offsets: &[i64]) -> Result<(), TransportError> {
        self.create_marker_topic().await?;
        let keys: Vec<String> = offsets
            .iter()
            .map(|offset| format!("{partition}:{offset}"))
            .collect();
        let sends = keys.iter().map(|key| {
            let record = FutureRecord::<str, [u8]>::to(&self.markers.topic)
                .partition(0)
                .key(key.as_str());
            self.producer.send(record, PRODUCE_TIMEOUT)
        });
        let results = futures::future::join_all(sends).await;
        let context = format!(
            "could not write a removal marker to {:?}",
            self.markers.topic
        );
        for (result, &offset) in results.into_iter().zip(offsets) {
            let at =
                result.map_err(|(err, _)| classify(err, &context, Setting::DeadLetterTopic))?;
            self.markers.insert(at.offset, partition, offset);
        }
        Ok(())
    }

    /// Creates the marker topic (one partition, markers kept until deleted) unless it exists.
    async fn create_marker_topic(&mut self) -> Result<(), TransportError> {
        use RDKafkaErrorCode as Code;
        if self.markers.exists {
            return Ok(());
        }
        let topic = NewTopic::new(&self.markers.topic, 1, TopicReplication::Fixed(-1))
            .set("retention.ms", "-1");
        let results = self
            .admin
            .create_topics([&topic], &admin_options())
            .await
            .map_err(|err| {
                classify(
                    err,
                    "could not create the removal-marker topic",
                    Setting::DeadLetterTopic,
                )
            })?;
        for result in results {
            match result {
                Ok(_) | Err((_, Code::TopicAlreadyExists)) => {}
                Err((
                    name,
                    code @ (Code::TopicAuthorizationFailed
                    | Code::ClusterAuthorizationFailed
                    | Code::PolicyViolation
                    | Code::InvalidConfig
                    | Code::InvalidReplicationFactor),
                )) => {
                    return Err(TransportError::fatal(
                        "spec.delivery.deadLetter.topic",
                        format!(
                            "the brokers refused to create the removal-marker topic {name:?} (remove letters in partition order, or create it): {code}"
                        ),
                        None,
                    ));
                }
                Err((name, code)) => {
                    return Err(TransportError::protocol(format!(
                        "could not create the removal-marker topic {name:?}: {code}"
                    )));
                }
            }
        }
        self.markers.exists = true;
        Ok(())
    }

    /// `DeleteRecords`: removes the records of `partition` of `topic` before `before`.
    async fn delete_records(
        &self,
        topic: &str,
        partition: i32,
        before: i64,
    ) -> Result<(), TransportError> {
        let context = format!(
            "could not delete the records of {topic} partition {partition} before offset {before}"
        );
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(topic, partition, Offset::Offset(before))
            .map_err(|err| TransportError::transient(context.clone(), err))?;
        let deleted = self
            .admin
            .delete_records(&list, &admin_options())
            .await
            .map_err(|err| classify(err, &context, Setting::DeadLetterTopic))?;
        for element in deleted.elements() {
            element
                .error()
                .map_err(|err| classify(err, &context, Setting::DeadLetterTopic))?;
        }
        Ok(())
    }

    /// Deletes the markers of letters Kafka no longer holds (removed with their prefix or
    /// expired), from the start of the marker topic up to the first one still needed.
    pub(super) async fn drop_stale_markers(&mut self) -> Result<(), TransportError> {
        let Some(&(last, _, _)) = self.markers.written.last() else {
            return Ok(());
        };
        let mut lows = BTreeMap::new();
        for &partition in self.markers.removed.keys() {
            lows.insert(partition, self.watermarks(&self.topic, partition)?.0);
        }
        let stale =
            |partition: i32, offset: i64| lows.get(&partition).is_some_and(|low| offset < *low);
        let up_to = self
            .markers
            .written
            .iter()
            .find(|(_, partition, offset)| !stale(*partition, *offset))
            .map_or(last + 1, |(at, _, _)| *at);
        if up_to > self.markers.low {
            let topic = self.markers.topic.clone();
            self.delete_records(&topic, 0, up_to).await?;
            self.markers.low = up_to;
        }
        self.markers.written.retain(|(at, _, _)| *at >= up_to);
        for (partition, offsets) in &mut self.markers.removed {
            offsets.retain(|offset| !stale(*partition, *offset));
        }
        Ok(())
    }
}

fn admin_options() -> AdminOptions {
    AdminOptions::new()
        .request_timeout(Some(REQUEST_TIMEOUT))
        .operation_timeout(Some(REQUEST_TIMEOUT))
}
