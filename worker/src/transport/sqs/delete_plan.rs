//! The order of deletions (`DeleteMessageBatch`) that keeps a FIFO group's order.
//!
//! A group's later message must never be deleted before an earlier one, and SQS does not
//! promise any order among the entries of one batch call. So deletions go in rounds: round
//! *k* holds the *k*-th message of every group still open (a message without a group is a
//! group of its own, so a standard queue needs one round), split into calls of at most ten
//! entries. When an entry of a group fails, the group's later messages are not sent: they
//! get the same outcome (retried, or stale) without a call.

use std::collections::{HashMap, VecDeque};

use crate::transport::Acked;

/// At most this many entries per SQS batch call.
pub const BATCH_LIMIT: usize = 10;

/// What became of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Deleted,
    /// The receipt handle is no longer valid.
    Stale,
    /// Not deleted this time; the pipeline retries it.
    Retry,
}

/// The deletions still to do for one acknowledgement call.
#[derive(Debug)]
pub struct DeletePlan {
    /// Per group, in order of first appearance: its messages not yet sent, in receive order.
    queues: Vec<VecDeque<usize>>,
    /// Each message's group (its index in `queues`).
    group_of: Vec<usize>,
    outcomes: Vec<Option<Outcome>>,
}

impl DeletePlan {
    /// `groups[i]` is the FIFO group of message `i` (in receive order), `None` for a message
    /// that orders nothing.
    pub fn new<'a>(groups: impl IntoIterator<Item = Option<&'a str>>) -> Self {
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        let mut queues: Vec<VecDeque<usize>> = Vec::new();
        let mut group_of = Vec::new();
        for (index, group) in groups.into_iter().enumerate() {
            let queue = match group {
                Some(name) => *by_name.entry(name).or_insert_with(|| {
                    queues.push(VecDeque::new());
                    queues.len() - 1
                }),
                None => {
                    queues.push(VecDeque::new());
                    queues.len() - 1
                }
            };
            queues[queue].push_back(index);
            group_of.push(queue);
        }
        let outcomes = vec![None; group_of.len()];
        Self {
            queues,
            group_of,
            outcomes,
        }
    }

    /// The next round's calls: the next message of every open group, in receive order, at
    /// most [`BATCH_LIMIT`] per call; empty when everything has an outcome. Record every
    /// entry of a round before asking for the next.
    pub fn next_round(&mut self) -> Vec<Vec<usize>> {
        let mut round: Vec<usize> = self
            .queues
            .iter_mut()
            .filter_map(VecDeque::pop_front)
            .collect();
        round.sort_unstable();
        round.chunks(BATCH_LIMIT).map(<[usize]>::to_vec).collect()
    }

    /// Records what became of message `index`; a failure gives the group's later messages
    /// the same outcome, unsent.
    pub fn record(&mut self, index: usize, outcome: Outcome) {
        self.outcomes[index] = Some(outcome);
        if outcome != Outcome::Deleted {
            let queue = &mut self.queues[self.group_of[index]];
            for later in queue.drain(..) {
                self.outcomes[later] = Some(outcome);
            }
        }
    }

    /// Whether any message was deleted so far.
    pub fn any_deleted(&self) -> bool {
        self.outcomes.contains(&Some(Outcome::Deleted))
    }

    /// The report for the pipeline: indices of stale and retried messages. A message never
    /// recorded (the plan was abandoned) is retried.
    pub fn finish(self) -> Acked {
        let mut acked = Acked::all();
        for (index, outcome) in self.outcomes.into_iter().enumerate() {
            match outcome {
                Some(Outcome::Deleted) => {}
                Some(Outcome::Stale) => acked.stale.push(index),
                Some(Outcome::Retry) | None => acked.retry.push(index),
            }
        }
        acked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a plan to the end, with `fail` deciding each entry's outcome; returns the calls
    /// made and the report.
    fn run(
        groups: &[Option<&str>],
        mut fail: impl FnMut(usize) -> Outcome,
    ) -> (Vec<Vec<usize>>, Acked) {
        let mut plan = DeletePlan::new(groups.iter().copied());
        let mut calls = Vec::new();
        loop {
            let round = plan.next_round();
            if round.is_empty() {
                break;
            }
            for call in round {
                for &index in &call {
                    plan.record(index, fail(index));
                }
                calls.push(call);
            }
        }
        (calls, plan.finish())
    }

    #[test]
    fn standard_messages_are_deleted_in_calls_of_ten_in_receive_order() {
        let groups = vec![None; 23];
        let (calls, acked) = run(&groups, |_| Outcome::Deleted);
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[0], (0..10).collect::<Vec<_>>());
        assert_eq!(calls[2], vec![20, 21, 22]);
        assert_eq!(acked, Acked::all());
    }

    #[test]
    fn fifo_calls_hold_one_message_per_group_and_keep_each_groups_order() {
        let groups = [
            Some("a"),
            Some("b"),
            Some("a"),
            Some("a"),
            Some("b"),
            Some("c"),
        ];
        let (calls, acked) = run(&groups, |_| Outcome::Deleted);
        assert_eq!(calls, vec![vec![0, 1, 5], vec![2, 4], vec![3]]);
        for call in &calls {
            let mut seen: Vec<_> = call.iter().map(|&i| groups[i]).collect();
            seen.dedup();
            assert_eq!(seen.len(), call.len(), "one entry per group in {call:?}");
        }
        assert_eq!(acked, Acked::all());
    }

    #[test]
    fn a_failed_entry_turns_its_groups_later_messages_into_retries_unsent() {
        let groups = [Some("a"), Some("b"), Some("a"), Some("b"), Some("a")];
        let (calls, acked) = run(&groups, |index| {
            if index == 0 {
                Outcome::Retry
            } else {
                Outcome::Deleted
            }
        });
        assert_eq!(
            calls,
            vec![vec![0, 1], vec![3]],
            "a's later messages are never sent"
        );
        assert_eq!(acked.retry, vec![0, 2, 4]);
        assert!(acked.stale.is_empty());
    }

    #[test]
    fn a_stale_entry_makes_its_groups_later_messages_stale() {
        let groups = [Some("a"), Some("a"), Some("b")];
        let (calls, acked) = run(&groups, |index| {
            if index == 0 {
                Outcome::Stale
            } else {
                Outcome::Deleted
            }
        });
        assert_eq!(calls, vec![vec![0, 2]]);
        assert_eq!(acked.stale, vec![0, 1]);
        assert!(acked.retry.is_empty());
    }

    #[test]
    fn a_standard_failure_affects_only_its_own_message() {
        let (_, acked) = run(&[None, None, None], |index| {
            if index == 1 {
                Outcome::Retry
            } else {
                Outcome::Deleted
            }
        });
        assert_eq!(acked.retry, vec![1]);
    }

    #[test]
    fn unrecorded_messages_are_retried() {
        let mut plan = DeletePlan::new([Some("a"), Some("a")]);
        let round = plan.next_round();
        assert_eq!(round, vec![vec![0]]);
        plan.record(0, Outcome::Deleted);
        assert!(plan.any_deleted());
        assert_eq!(plan.finish().retry, vec![1]);
    }
}
