//! Which records of each owned partition are settled, and how far each partition may be
//! committed: only the **contiguous prefix** of settled records, whatever the offsets between
//! them (transaction markers and compaction leave gaps, so offsets are never counted, only the
//! records delivered, in order).
//!
//! Each assignment of a partition gets a new *epoch*, carried by every receipt of the records
//! delivered under it: an acknowledgement of an earlier epoch (the partition was revoked while
//! its batch was being stored, and perhaps assigned back since) is stale and commits nothing.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One partition of a topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicPartition {
    pub topic: Arc<str>,
    pub partition: i32,
}

impl TopicPartition {
    /// `topic:partition`, the partition's name in the store.
    pub fn name(&self) -> String {
        format!("{}:{}", self.topic, self.partition)
    }
}

#[derive(Debug)]
struct Owned {
    epoch: u64,
    /// Offsets delivered and not yet part of the committable prefix, in delivery order, each
    /// with whether it is settled.
    delivered: VecDeque<(i64, bool)>,
    /// The offset after the settled prefix (what may be committed), once anything settled.
    settled_up_to: Option<i64>,
    /// The offset last sent as a commit.
    committed: Option<i64>,
    /// When the partition last delivered a record (or was assigned, or its fetch restarted).
    last_delivery: Instant,
    /// When the epoch began, before its first fetch: a record of the epoch was fetched after it.
    began: Instant,
}

/// The owned partitions and their settled records.
#[derive(Debug, Default)]
pub struct Offsets {
    owned: BTreeMap<TopicPartition, Owned>,
    next_epoch: u64,
}

impl Offsets {
    /// `partition` is assigned to this worker: a new epoch (an owned partition keeps its own).
    pub fn assign(&mut self, partition: TopicPartition) -> u64 {
        let next_epoch = &mut self.next_epoch;
        self.owned
            .entry(partition)
            .or_insert_with(|| {
                *next_epoch += 1;
                Owned {
                    epoch: *next_epoch,
                    delivered: VecDeque::new(),
                    settled_up_to: None,
                    committed: None,
                    last_delivery: Instant::now(),
                    began: Instant::now(),
                }
            })
            .epoch
    }

    /// `partition` is taken away: returns the offset to commit for it before it goes (the
    /// settled prefix, if not committed yet) and how many delivered records were not settled
    /// (abandoned: their acknowledgements will be stale).
    pub fn revoke(&mut self, partition: &TopicPartition) -> (Option<i64>, usize) {
        match self.owned.remove(partition) {
            None => (None, 0),
            Some(owned) => {
                let commit = owned
                    .settled_up_to
                    .filter(|&up_to| owned.committed < Some(up_to));
                let abandoned = owned
                    .delivered
                    .iter()
                    .filter(|(_, settled)| !settled)
                    .count();
                (commit, abandoned)
            }
        }
    }

    /// The owned partitions of `topic`.
    pub fn owned_of(&self, topic: &str) -> Vec<TopicPartition> {
        self.owned
            .keys()
            .filter(|partition| &*partition.topic == topic)
            .cloned()
            .collect()
    }

    /// `partition`'s fetch starts over under a new epoch, with nothing delivered, settled or
    /// committed: it reads another incarnation of its topic (deleted and created again: the old
    /// one's offsets mean nothing in the new one, its acknowledgements are stale), or its records
    /// in hand were fetched before its topic's id was known.
    pub fn restart_epoch(&mut self, partition: &TopicPartition) {
        if self.owned.remove(partition).is_some() {
            self.assign(partition.clone());
        }
    }

    /// Where the consumer stands in `partition` (the offset after the last record or
    /// transaction marker it read): once everything delivered is settled, that is what may be
    /// committed, so that the group's lag does not count markers or aborted records it will
    /// never deliver. `false`: nothing changed.
    pub fn advance_to(&mut self, partition: &TopicPartition, position: i64) -> bool {
        let Some(owned) = self.owned.get_mut(partition) else {
            return false;
        };
        if !owned.delivered.is_empty() || owned.settled_up_to >= Some(position) {
            return false;
        }
        owned.settled_up_to = Some(position);
        true
    }

    /// The epoch of an owned partition.
    pub fn epoch(&self, partition: &TopicPartition) -> Option<u64> {
        self.owned.get(partition).map(|owned| owned.epoch)
    }

    /// When `epoch` of `partition` began (before its first fetch), while it is owned under it.
    pub fn began(&self, partition: &TopicPartition, epoch: u64) -> Option<Instant> {
        self.owned
            .get(partition)
            .filter(|owned| owned.epoch == epoch)
            .map(|owned| owned.began)
    }

    /// Records `offset` as delivered to the pipeline under `epoch`. `false`: the partition is no
    /// longer owned under that epoch, or the offset is not past the last one delivered (the
    /// record must not be handed on).
    pub fn deliver(&mut self, partition: &TopicPartition, epoch: u64, offset: i64) -> bool {
        let Some(owned) = self.owned.get_mut(partition).filter(|o| o.epoch == epoch) else {
            return false;
        };
        let last = owned
            .delivered
            .back()
            .map(|(last, _)| *last)
            .or(owned.settled_up_to.map(|next| next - 1));
        if last.is_some_and(|last| offset <= last) {
            return false;
        }
        owned.delivered.push_back((offset, false));
        owned.last_delivery = Instant::now();
        true
    }

    /// Owned partitions with nothing in flight that delivered nothing for `idle`, each with the
    /// offset after its settled prefix (`None`: nothing settled since it was assigned).
    pub fn idle(&self, idle: Duration) -> Vec<(TopicPartition, Option<i64>)> {
        self.owned
            .iter()
            .filter(|(_, owned)| {
                owned.delivered.is_empty() && owned.last_delivery.elapsed() >= idle
            })
            .map(|(partition, owned)| (partition.clone(), owned.settled_up_to))
            .collect()
    }

    /// The fetch of `partition` was restarted: it is not idle from now.
    pub fn restarted(&mut self, partition: &TopicPartition) {
        if let Some(owned) = self.owned.get_mut(partition) {
            owned.last_delivery = Instant::now();
        }
    }

    /// Marks a delivered record settled (stored, duplicate or dead-lettered). `false`: stale
    /// (the partition is no longer owned under `epoch`).
    pub fn settle(&mut self, partition: &TopicPartition, epoch: u64, offset: i64) -> bool {
        let Some(owned) = self.owned.get_mut(partition).filter(|o| o.epoch == epoch) else {
            return false;
        };
        if let Ok(index) = owned
            .delivered
            .binary_search_by_key(&offset, |(offset, _)| *offset)
        {
            owned.delivered[index].1 = true;
        }
        while let Some(&(offset, true)) = owned.delivered.front() {
            owned.delivered.pop_front();
            owned.settled_up_to = Some(offset + 1);
        }
        true
    }

    /// The partitions whose settled prefix moved past their last commit, each with the offset
    /// to commit; they count as committed from now on (see [`Offsets::recommit`]).
    pub fn committable(&mut self) -> Vec<(TopicPartition, i64)> {
        self.owned
            .iter_mut()
            .filter_map(|(partition, owned)| {
                let up_to = owned.settled_up_to?;
                (owned.committed < Some(up_to)).then(|| {
                    owned.committed = Some(up_to);
                    (partition.clone(), up_to)
                })
            })
            .collect()
    }

    /// A commit of `partition` failed: it is committed again by the next
    /// [`Offsets::committable`].
    pub fn recommit(&mut self, partition: &TopicPartition) {
        if let Some(owned) = self.owned.get_mut(partition) {
            owned.committed = None;
        }
    }

    /// Records delivered and not yet committable, over every owned partition.
    pub fn unsettled(&self) -> usize {
        self.owned.values().map(|owned| owned.delivered.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(partition: i32) -> TopicPartition {
        TopicPartition {
            topic: Arc::from("orders"),
            partition,
        }
    }

    #[test]
    fn only_the_contiguous_settled_prefix_is_committable_across_offset_gaps() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(0));
        // Offsets 3 and 6 are transaction markers: never delivered.
        for offset in [1, 2, 4, 5, 7] {
            assert!(offsets.deliver(&tp(0), epoch, offset));
        }
        assert!(offsets.settle(&tp(0), epoch, 2));
        assert_eq!(offsets.committable(), vec![], "1 is not settled yet");
        assert!(offsets.settle(&tp(0), epoch, 1));
        assert_eq!(offsets.committable(), vec![(tp(0), 3)]);
        assert!(offsets.settle(&tp(0), epoch, 5));
        assert!(offsets.settle(&tp(0), epoch, 7));
        assert_eq!(offsets.committable(), vec![], "4 holds the rest back");
        assert!(offsets.settle(&tp(0), epoch, 4));
        assert_eq!(offsets.committable(), vec![(tp(0), 8)]);
        assert_eq!(offsets.committable(), vec![], "committed once");
        assert_eq!(offsets.unsettled(), 0);
    }

    #[test]
    fn a_revoked_partition_commits_its_settled_prefix_and_refuses_later_acks() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(1));
        for offset in 10..15 {
            assert!(offsets.deliver(&tp(1), epoch, offset));
        }
        assert!(offsets.settle(&tp(1), epoch, 10));
        assert!(offsets.settle(&tp(1), epoch, 11));
        assert!(offsets.settle(&tp(1), epoch, 13));
        assert_eq!(offsets.revoke(&tp(1)), (Some(12), 2));
        assert!(!offsets.settle(&tp(1), epoch, 12), "no longer owned");
        assert!(!offsets.deliver(&tp(1), epoch, 15));
        assert_eq!(offsets.committable(), vec![]);
        // Assigned back: a new epoch; the old receipts stay stale.
        let again = offsets.assign(tp(1));
        assert_ne!(again, epoch);
        assert!(!offsets.settle(&tp(1), epoch, 12));
        assert!(offsets.deliver(&tp(1), again, 12));
        assert!(offsets.settle(&tp(1), again, 12));
        assert_eq!(offsets.committable(), vec![(tp(1), 13)]);
    }

    #[test]
    fn only_partitions_with_nothing_in_flight_are_idle_with_where_to_fetch_from() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(0));
        offsets.assign(tp(1));
        assert!(offsets.deliver(&tp(0), epoch, 7));
        assert_eq!(
            offsets.idle(Duration::ZERO),
            vec![(tp(1), None)],
            "7 is in flight"
        );
        assert!(offsets.settle(&tp(0), epoch, 7));
        assert_eq!(
            offsets.idle(Duration::ZERO),
            vec![(tp(0), Some(8)), (tp(1), None)]
        );
        assert_eq!(
            offsets.idle(Duration::from_secs(3600)),
            vec![],
            "both just started"
        );
        offsets.restarted(&tp(1));
        assert_eq!(offsets.idle(Duration::from_secs(3600)), vec![]);
    }

    #[test]
    fn the_position_past_markers_is_committable_only_with_nothing_in_flight() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(0));
        assert!(offsets.deliver(&tp(0), epoch, 4));
        assert!(!offsets.advance_to(&tp(0), 9), "4 is in flight");
        assert!(offsets.settle(&tp(0), epoch, 4));
        assert_eq!(offsets.committable(), vec![(tp(0), 5)]);
        // Offsets 5 to 8: an aborted transaction and its marker, never delivered.
        assert!(offsets.advance_to(&tp(0), 9));
        assert!(!offsets.advance_to(&tp(0), 9), "once");
        assert_eq!(offsets.committable(), vec![(tp(0), 9)]);
        assert!(!offsets.deliver(&tp(0), epoch, 8), "behind the position");
        assert!(offsets.deliver(&tp(0), epoch, 9));
    }

    #[test]
    fn a_new_incarnation_starts_over_under_a_new_epoch() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(0));
        let began = offsets.began(&tp(0), epoch).expect("owned");
        assert!(offsets.deliver(&tp(0), epoch, 40));
        assert!(offsets.settle(&tp(0), epoch, 40));
        offsets.restart_epoch(&tp(0));
        let again = offsets.epoch(&tp(0)).expect("still owned");
        assert_ne!(again, epoch);
        assert_eq!(offsets.began(&tp(0), epoch), None, "the old epoch is over");
        assert!(offsets.began(&tp(0), again).expect("owned") >= began);
        assert!(!offsets.settle(&tp(0), epoch, 41), "stale");
        assert!(offsets.deliver(&tp(0), again, 0), "offsets start over");
        assert_eq!(offsets.committable(), vec![]);
        assert_eq!(offsets.owned_of("orders"), vec![tp(0)]);
    }

    #[test]
    fn a_failed_commit_is_sent_again_and_nothing_is_delivered_twice() {
        let mut offsets = Offsets::default();
        let epoch = offsets.assign(tp(2));
        assert!(offsets.deliver(&tp(2), epoch, 0));
        assert!(!offsets.deliver(&tp(2), epoch, 0), "not past the last one");
        assert!(offsets.settle(&tp(2), epoch, 0));
        assert!(!offsets.deliver(&tp(2), epoch, 0), "settled already");
        assert_eq!(offsets.committable(), vec![(tp(2), 1)]);
        offsets.recommit(&tp(2));
        assert_eq!(offsets.committable(), vec![(tp(2), 1)]);
        assert_eq!(offsets.revoke(&tp(2)), (None, 0), "nothing left to commit");
    }
}
