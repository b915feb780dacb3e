//! Retention that holds: a dead-letter queue keeps its letters at least
//! `spec.delivery.deadLetter.retentionDays`. Each broker raises a shorter retention where it
//! may; where it may not, [`Retention::refused`] makes that fatal, naming the setting and the
//! opt-out (`acceptShorterRetention`, which turns it into a warning).
//!
//! And the other way round for the source: a broker that keeps a message longer than the dedup
//! window may deliver it again after its first delivery's marker was dropped, making a second
//! todo. [`SourceRetention::warn_beyond`] says so at start (docs/storage.md, per broker).

use std::time::Duration;

use switchboard_api::DeadLetter;

use super::TransportError;

/// How long a broker keeps the source's messages, where the worker reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceRetention {
    /// The broker has no such setting the worker can read (Redis, RabbitMQ's queue arguments,
    /// the gateway).
    Unknown,
    /// At most `kept`, as `setting` says (`retention.ms of topic orders`).
    Bounded { kept: Duration, setting: String },
    /// Until consumed or deleted, as `setting` says.
    Unbounded { setting: String },
}

impl SourceRetention {
    /// Warns (and says `true`) when the broker keeps messages longer than `window`, the dedup
    /// window the database keeps events for: a delivery later than that after the first
    /// (workers or the database down that long, a replay) makes a second todo. A retention
    /// without limit is the broker's default for most: said once at info level.
    pub fn warn_beyond(&self, window: Duration) -> bool {
        const CONSEQUENCE: &str = "a message delivered again more than the dedup window after \
            its first delivery (workers or the database down that long, a replay) makes a second \
            todo; raise spec.delivery.dedupWindowDays (the operator keeps events for the longest \
            any adapter asks) or shorten the broker's retention";
        match self {
            Self::Unknown => false,
            Self::Bounded { kept, .. } if *kept <= window => false,
            Self::Bounded { kept, setting } => {
                tracing::warn!(
                    retention = %readable(*kept),
                    %setting,
                    dedup_window = %readable(window),
                    "the broker keeps messages longer than the dedup window: {CONSEQUENCE}"
                );
                true
            }
            Self::Unbounded { setting } => {
                tracing::info!(
                    %setting,
                    dedup_window = %readable(window),
                    "the broker keeps messages without a time limit: {CONSEQUENCE}"
                );
                false
            }
        }
    }
}

/// `30d`, `36d 12h`, `2h 30m`: a retention for people, in days (humantime's months are not).
fn readable(duration: Duration) -> String {
    let secs = duration.as_secs();
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3_600, "h"),
        (secs % 3_600 / 60, "m"),
    ];
    let shown: Vec<String> = parts
        .iter()
        .filter(|(count, _)| *count > 0)
        .map(|(count, unit)| format!("{count}{unit}"))
        .collect();
    if shown.is_empty() {
        format!("{secs}s")
    } else {
        shown.join(" ")
    }
}

/// The setting a shorter retention is reported against.
pub const SETTING: &str = "spec.delivery.deadLetter.retentionDays";

/// How long dead letters must be kept, and whether a shorter retention is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// `retentionDays`.
    pub wanted: Duration,
    /// `acceptShorterRetention`.
    pub accept_shorter: bool,
}

impl Retention {
    /// The retention `dead_letter` asks for.
    pub fn of(dead_letter: &DeadLetter) -> Self {
        Self {
            wanted: dead_letter.retention(),
            accept_shorter: dead_letter.accept_shorter_retention,
        }
    }

    /// Whether a queue keeping messages for `kept` (`None`: for ever) keeps them too briefly.
    pub fn too_short(&self, kept: Option<Duration>) -> bool {
        kept.is_some_and(|kept| kept < self.wanted)
    }

    /// The dead-letter queue `queue` keeps messages for `kept` only, and the worker could not
    /// raise it (`why`): fatal, or a warning when `acceptShorterRetention` is set.
    pub fn refused(
        &self,
        queue: &str,
        kept: Duration,
        why: impl std::fmt::Display,
    ) -> Result<(), TransportError> {
        if self.accept_shorter {
            tracing::warn!(
                dead_letter_queue = %queue,
                retention_seconds = kept.as_secs(),
                wanted_seconds = self.wanted.as_secs(),
                reason = %why,
                "the dead-letter queue keeps messages for less than deadLetter.retentionDays (accepted: deadLetter.acceptShorterRetention)"
            );
            return Ok(());
        }
        Err(TransportError::fatal(
            SETTING,
            format!(
                "the dead-letter queue {queue} keeps messages for {} s, less than the {} s wanted, and the worker could not raise it ({why}); raise it, lower retentionDays, or set spec.delivery.deadLetter.acceptShorterRetention: true to accept it",
                kept.as_secs(),
                self.wanted.as_secs()
            ),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn only_a_bounded_retention_known_to_outlast_the_window_is_warned_about() {
        let bounded = |days: u32| SourceRetention::Bounded {
            kept: DAY * days,
            setting: "retention.ms of topic orders".to_owned(),
        };
        assert!(!SourceRetention::Unknown.warn_beyond(DAY));
        assert!(!bounded(30).warn_beyond(DAY * 30));
        assert!(bounded(31).warn_beyond(DAY * 30));
        let unbounded = SourceRetention::Unbounded {
            setting: "max_age of stream ORDERS".to_owned(),
        };
        assert!(!unbounded.warn_beyond(DAY * 3650));
        assert_eq!(readable(DAY * 36 + DAY / 2), "36d 12h");
        assert_eq!(readable(Duration::from_secs(9_000)), "2h 30m");
        assert_eq!(readable(Duration::from_secs(5)), "5s");
    }
}
