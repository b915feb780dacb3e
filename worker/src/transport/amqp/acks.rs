//! Acknowledging settled deliveries: which `basic.ack` frames settle a set of delivery tags
//! (one `multiple=true` for the settled prefix of what the channel holds, when that prefix is
//! contiguous, and one individual ack for each of the rest), and sending them. A tag is
//! acknowledged at most once (RabbitMQ closes the channel on an unknown tag); a tag of an
//! earlier channel is stale.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use lapin::options::BasicAckOptions;

use super::delivery::AmqpDelivery;
use super::{Amqp, CALL_TIMEOUT};
use crate::transport::{Acked, TransportError};

/// One `basic.ack` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckFrame {
    pub tag: u64,
    pub multiple: bool,
}

/// The frames that acknowledge `settled` (each held in `outstanding`, keyed by tag), and
/// nothing else.
pub fn plan<V>(outstanding: &BTreeMap<u64, V>, settled: &BTreeSet<u64>) -> Vec<AckFrame> {
    // The longest run of the lowest outstanding tags that are all settled.
    let prefix: Vec<u64> = outstanding
        .keys()
        .take_while(|tag| settled.contains(tag))
        .copied()
        .collect();
    let mut frames = Vec::new();
    let rest = match prefix.as_slice() {
        [] | [_] => settled.iter().copied().collect::<Vec<_>>(),
        [.., last] => {
            frames.push(AckFrame {
                tag: *last,
                multiple: true,
            });
            settled.range(last + 1..).copied().collect()
        }
    };
    frames.extend(rest.into_iter().map(|tag| AckFrame {
        tag,
        multiple: false,
    }));
    frames
}

/// The tags `frame` acknowledges, of `outstanding`.
pub fn covered<V>(outstanding: &BTreeMap<u64, V>, frame: AckFrame) -> Vec<u64> {
    if frame.multiple {
        outstanding
            .range(..=frame.tag)
            .map(|(tag, _)| *tag)
            .collect()
    } else {
        outstanding
            .contains_key(&frame.tag)
            .then_some(frame.tag)
            .into_iter()
            .collect()
    }
}

impl Amqp {
    /// Acknowledges `messages` (settled, in receive order) on the session they came on; those
    /// of an earlier channel, or left when the channel fails, are stale.
    pub(super) async fn acknowledge(
        &mut self,
        messages: &[&AmqpDelivery],
    ) -> Result<Acked, TransportError> {
        let mut acked = Acked::all();
        let Some(session) = self.session.as_mut() else {
            return Err(TransportError::stale(
                "the channel these deliveries came on is gone",
                None,
            ));
        };
        let mut settled = BTreeSet::new();
        let mut index_of = HashMap::new();
        for (index, message) in messages.iter().enumerate() {
            let tag = message.receipt.tag;
            if message.receipt.channel == session.generation
                && session.outstanding.contains_key(&tag)
            {
                settled.insert(tag);
                index_of.insert(tag, index);
            } else {
                acked.stale.push(index);
            }
        }
        let mut lost = false;
        for frame in plan(&session.outstanding, &settled) {
            let covered = covered(&session.outstanding, frame);
            let options = BasicAckOptions {
                multiple: frame.multiple,
            };
            match tokio::time::timeout(CALL_TIMEOUT, session.consume.basic_ack(frame.tag, options))
                .await
            {
                Ok(Ok(())) => {
                    for tag in covered {
                        session.outstanding.remove(&tag);
                    }
                }
                // The channel is gone (or hangs): RabbitMQ puts back what it held.
                _ => {
                    lost = true;
                    break;
                }
            }
        }
        if lost {
            acked.stale.extend(
                settled
                    .iter()
                    .filter(|tag| session.outstanding.contains_key(tag))
                    .map(|tag| index_of[tag]),
            );
            acked.stale.sort_unstable();
            self.lose_session();
        } else {
            self.held.record(&session.outstanding);
        }
        // A message acknowledged needs no memory of its dead letter's publish any more.
        for (index, message) in messages.iter().enumerate() {
            if acked.stale.binary_search(&index).is_err() {
                self.publisher.forget(&message.idempotency_key);
            }
        }
        Ok(acked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(tags: &[u64]) -> BTreeSet<u64> {
        tags.iter().copied().collect()
    }

    fn held(tags: &[u64]) -> BTreeMap<u64, ()> {
        tags.iter().map(|tag| (*tag, ())).collect()
    }

    fn ack(tag: u64) -> AckFrame {
        AckFrame {
            tag,
            multiple: false,
        }
    }

    #[test]
    fn settled_prefix_is_one_multiple_ack() {
        let frames = plan(&held(&[1, 2, 3, 4, 5]), &set(&[1, 2, 3]));
        assert_eq!(
            frames,
            vec![AckFrame {
                tag: 3,
                multiple: true
            }]
        );
    }

    #[test]
    fn a_gap_below_the_settled_tags_means_individual_acks() {
        // Tag 1 is still held by an earlier batch: a multiple ack would settle it too.
        let frames = plan(&held(&[1, 2, 3, 4]), &set(&[2, 3]));
        assert_eq!(frames, vec![ack(2), ack(3)]);
    }

    #[test]
    fn tags_after_the_prefix_are_acked_one_by_one() {
        let outstanding = held(&[4, 5, 6, 7, 9]);
        let frames = plan(&outstanding, &set(&[4, 5, 7, 9]));
        assert_eq!(
            frames,
            vec![
                AckFrame {
                    tag: 5,
                    multiple: true
                },
                ack(7),
                ack(9)
            ]
        );
        assert_eq!(covered(&outstanding, frames[0]), vec![4, 5]);
        assert_eq!(covered(&outstanding, frames[1]), vec![7]);
    }

    #[test]
    fn a_single_tag_is_an_individual_ack() {
        assert_eq!(plan(&held(&[8, 9]), &set(&[8])), vec![ack(8)]);
        assert!(plan(&held(&[8]), &set(&[])).is_empty());
    }
}
