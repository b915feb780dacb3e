//! Which `basic.ack` frames settle a set of delivery tags: one `multiple=true` for the settled
//! prefix of what the channel holds, when that prefix is contiguous, and one individual ack for
//! each of the rest. A tag is acknowledged at most once (RabbitMQ closes the channel on an
//! unknown tag).

use std::collections::{BTreeMap, BTreeSet};

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
