//! Retention that holds: a dead-letter queue keeps its letters at least
//! `spec.delivery.deadLetter.retentionDays`. Each broker raises a shorter retention where it
//! may; where it may not, [`Retention::refused`] makes that fatal, naming the setting and the
//! opt-out (`acceptShorterRetention`, which turns it into a warning).

use std::time::Duration;

use switchboard_api::DeadLetter;

use super::TransportError;

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
