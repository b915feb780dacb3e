//! Commits: each partition's contiguous settled prefix (asynchronously; a commit that fails is
//! sent again with the next one), the consumer's position once nothing of a partition is in
//! flight or in hand, and the fetch of a partition that stalled with a backlog restarted.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};

use super::async_commit;
use super::client::{Setting, classify};
use super::offsets::TopicPartition;
use super::probe::PartitionLabels;
use super::{Kafka, REQUEST_TIMEOUT, Receipt};
use crate::transport::{Acked, Message, TransportError};

/// How long an owned partition with a backlog may deliver nothing, with nothing of it in flight,
/// before its fetch is restarted: librdkafka can leave a partition assigned after a cooperative
/// rebalance without ever fetching it (its lag then grows until the worker restarts).
const STALLED_AFTER: Duration = Duration::from_secs(30);

/// An owned partition that delivered nothing, and where to fetch it from (the offset after its
/// settled prefix; `None`: its committed offset).
type Stalled = (TopicPartition, Option<i64>);

impl Kafka {
    /// Marks `messages` settled and commits what became committable. A message of a partition
    /// no longer owned under its epoch is stale.
    pub(super) fn settle(&self, messages: &[&Message<Receipt>]) -> Result<Acked, TransportError> {
        let mut acked = Acked::all();
        let commits = {
            let mut offsets = self.state.offsets();
            for (index, message) in messages.iter().enumerate() {
                let receipt = &message.receipt;
                if !offsets.settle(&receipt.partition, receipt.epoch, receipt.offset) {
                    acked.stale.push(index);
                }
            }
            offsets.committable()
        };
        self.commit(commits, CommitMode::Async)?;
        Ok(acked)
    }

    /// Moves each owned partition with nothing in flight and nothing in hand to the consumer's
    /// position (past transaction markers and aborted records, which are never delivered), so
    /// that it is committed and the group's lag counts only records still to be read.
    pub(super) fn advance_to_positions(&mut self) {
        let positions = match self.consumer.position() {
            Ok(positions) => positions,
            Err(err) => {
                tracing::debug!(error = %err, "could not read the consumer's positions");
                return;
            }
        };
        let in_hand: BTreeSet<&TopicPartition> = self
            .fetched
            .iter()
            .map(|fetched| &fetched.message.receipt.partition)
            .collect();
        let mut offsets = self.state.offsets();
        for element in positions.elements() {
            let Offset::Offset(position) = element.offset() else {
                continue;
            };
            let partition = TopicPartition {
                topic: Arc::from(element.topic()),
                partition: element.partition(),
            };
            if !in_hand.contains(&partition) {
                offsets.advance_to(&partition, position);
            }
        }
    }

    /// Restarts the fetch of owned partitions that hold a backlog (the probe's lag) but delivered
    /// nothing for [`STALLED_AFTER`] with nothing in flight: from the offset after their settled
    /// prefix, else from the group's committed offset (read by the probe's client). A partition
    /// with no committed offset is left to `auto.offset.reset`; a restart that fails is tried
    /// again at the next maintenance.
    pub(super) async fn restart_stalled_fetches(&mut self) {
        let stalled = self.stalled_partitions();
        if stalled.is_empty() {
            return;
        }
        let Some(committed) = self.committed_offsets(&stalled).await else {
            return;
        };
        let restart = restart_list(&stalled, &committed);
        if restart.count() == 0 {
            return;
        }
        let restarted = self
            .consumer
            .incremental_unassign(&restart)
            .and_then(|()| self.consumer.incremental_assign(&restart));
        match restarted {
            Ok(()) => {
                let mut offsets = self.state.offsets();
                for (partition, _) in &stalled {
                    offsets.restarted(partition);
                }
                self.state.fetch_restarts.inc_by(restart.count() as u64);
            }
            Err(err) => {
                tracing::warn!(error = %switchboard_telemetry::ErrorChain(&err), "could not restart the fetch of stalled partitions; tried again later")
            }
        }
    }

    /// The owned partitions idle for [`STALLED_AFTER`] that hold a backlog.
    fn stalled_partitions(&self) -> Vec<Stalled> {
        let idle = self.state.offsets().idle(STALLED_AFTER);
        idle.into_iter()
            .filter(|(partition, _)| {
                let labels = PartitionLabels {
                    adapter: self.adapter.clone(),
                    topic: partition.topic.to_string(),
                    partition: partition.partition.to_string(),
                };
                self.lag.get_or_create(&labels).get() > 0
            })
            .collect()
    }

    /// The group's committed offsets of the `stalled` partitions with no settled prefix, read
    /// by the probe's client; `None` when they could not be read.
    async fn committed_offsets(&self, stalled: &[Stalled]) -> Option<TopicPartitionList> {
        let mut unknown = TopicPartitionList::new();
        for (partition, _) in stalled.iter().filter(|(_, from)| from.is_none()) {
            unknown.add_partition(&partition.topic, partition.partition);
        }
        let probe = self.probe.clone();
        match crate::task::spawn_blocking(move || match unknown.count() {
            0 => Ok(unknown),
            _ => probe.committed_offsets(unknown, REQUEST_TIMEOUT),
        })
        .await
        {
            Ok(Ok(committed)) => Some(committed),
            Ok(Err(err)) => {
                tracing::debug!(error = %switchboard_telemetry::ErrorChain(&err), "could not read the committed offsets of stalled partitions");
                None
            }
            Err(err) => {
                tracing::debug!(error = %err, "the committed-offsets task failed");
                None
            }
        }
    }

    /// Commits `commits` (each partition's settled prefix). A commit that cannot be sent, or
    /// (asynchronous) that the broker refuses, marks its partitions for the next one.
    pub(super) fn commit(
        &self,
        commits: Vec<(TopicPartition, i64)>,
        mode: CommitMode,
    ) -> Result<(), TransportError> {
        if commits.is_empty() {
            return Ok(());
        }
        let mut list = TopicPartitionList::new();
        for (partition, up_to) in &commits {
            let _ = list.add_partition_offset(
                &partition.topic,
                partition.partition,
                Offset::Offset(*up_to),
            );
        }
        let sent = match mode {
            CommitMode::Async => async_commit::commit(&self.consumer, &list),
            CommitMode::Sync => self.consumer.commit(&list, mode),
        };
        sent.map_err(|err| {
            self.state.commit_failures.inc();
            let mut offsets = self.state.offsets();
            for (partition, _) in &commits {
                offsets.recommit(partition);
            }
            classify(err, "could not commit offsets", Setting::Topics)
        })
    }
}

/// Where each of the `stalled` partitions is fetched again from; one without a settled prefix
/// or a `committed` offset is left out.
fn restart_list(stalled: &[Stalled], committed: &TopicPartitionList) -> TopicPartitionList {
    let mut restart = TopicPartitionList::new();
    for (partition, from) in stalled {
        let offset = match from {
            Some(from) => Offset::Offset(*from),
            None => committed
                .find_partition(&partition.topic, partition.partition)
                .map_or(Offset::Invalid, |element| element.offset()),
        };
        if let Offset::Offset(offset) = offset {
            tracing::warn!(
                partition = %partition.name(),
                offset,
                idle_seconds = STALLED_AFTER.as_secs(),
                "a partition with a backlog delivered nothing: restarting its fetch"
            );
            let _ = restart.add_partition_offset(
                &partition.topic,
                partition.partition,
                Offset::Offset(offset),
            );
        }
    }
    restart
}
