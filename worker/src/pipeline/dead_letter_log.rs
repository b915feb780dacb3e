//! Dead letters in the log: a poison storm is a few summary lines, not one per message. The
//! first dead letters after a quiet period are logged at once; what follows is summed up at
//! most once per [`SUMMARY_INTERVAL`] (count by reason, the first one's id and error), and
//! what is left when the loop stops is logged then. Each letter is logged at debug level, and
//! counted by `switchboard_messages_dead_lettered_total`.

use std::time::{Duration, Instant};

use crate::payload::PoisonReason;
use crate::transport::DeadLetter;

/// The least time between two summaries.
pub(super) const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

/// When a summary line is due: the first at once, then at most once per [`SUMMARY_INTERVAL`],
/// and whatever is left when the loop stops.
#[derive(Debug, Default)]
pub(super) struct SummaryPace {
    last_summary: Option<Instant>,
}

impl SummaryPace {
    /// Whether a summary of something pending may be logged at `now`.
    pub(super) fn due(&self, now: Instant, stopping: bool) -> bool {
        stopping
            || self
                .last_summary
                .is_none_or(|last| now.duration_since(last) >= SUMMARY_INTERVAL)
    }

    /// A summary was logged at `now`.
    pub(super) fn logged(&mut self, now: Instant) {
        self.last_summary = Some(now);
    }
}

#[derive(Debug, Default)]
pub(super) struct DeadLetterLog {
    /// Dead-lettered since the last summary, by reason, in the order first seen.
    reasons: Vec<(PoisonReason, u64)>,
    /// The first of them: its id and why.
    first: Option<(String, String)>,
    pace: SummaryPace,
}

impl DeadLetterLog {
    /// Counts a batch's dead letters (each logged at debug level) and logs the summary if due.
    pub(super) fn add<R>(&mut self, letters: &[DeadLetter<'_, R>], now: Instant) {
        for letter in letters {
            tracing::debug!(
                id = %letter.message.external_id,
                reason = letter.reason.as_str(),
                delivery_count = letter.message.delivery_count,
                error = %letter.error,
                "dead-lettered message"
            );
            match self.reasons.iter_mut().find(|(r, _)| *r == letter.reason) {
                Some((_, count)) => *count += 1,
                None => self.reasons.push((letter.reason, 1)),
            }
            self.first
                .get_or_insert_with(|| (letter.message.external_id.clone(), letter.error.clone()));
        }
        self.flush(now, false);
    }

    /// Logs what was dead-lettered since the last summary, if anything, when the interval has
    /// passed or `stopping`. Returns whether it logged.
    pub(super) fn flush(&mut self, now: Instant, stopping: bool) -> bool {
        if self.reasons.is_empty() || !self.pace.due(now, stopping) {
            return false;
        }
        let count: u64 = self.reasons.iter().map(|(_, count)| count).sum();
        let reasons: Vec<String> = self
            .reasons
            .drain(..)
            .map(|(reason, count)| format!("{}: {count}", reason.as_str()))
            .collect();
        let (first_id, first_error) = self.first.take().unwrap_or_default();
        tracing::warn!(
            count,
            reasons = %reasons.join(", "),
            first_id = %first_id,
            first_error = %first_error,
            "dead-lettered messages (summed up at most every 10 s; each one at debug level)"
        );
        self.pace.logged(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::{Attempts, Message};

    fn message(id: usize) -> Message<()> {
        Message {
            receipt: (),
            external_id: format!("m{id}"),
            idempotency_key: format!("fake:m{id}"),
            body: Vec::new(),
            headers: Vec::new(),
            delivery_count: 1,
            enqueued_at_ms: None,
            position: None,
            undecodable: None,
        }
    }

    #[test]
    fn a_storm_of_a_thousand_letters_is_two_lines_and_a_quiet_one_is_one() {
        let messages: Vec<Message<()>> = (0..1000).map(message).collect();
        let start = Instant::now();
        let mut log = DeadLetterLog::default();
        let mut lines = 0;
        // 100 batches of 10 over 5 s.
        for (batch, chunk) in messages.chunks(10).enumerate() {
            let letters: Vec<DeadLetter<'_, ()>> = chunk
                .iter()
                .map(|message| DeadLetter {
                    message,
                    reason: PoisonReason::InvalidJson,
                    error: "not JSON".to_owned(),
                    attempts: Attempts::default(),
                })
                .collect();
            let now = start + Duration::from_millis(50 * batch as u64);
            let before = log.pace.last_summary;
            log.add(&letters, now);
            lines += usize::from(log.pace.last_summary != before);
        }
        assert_eq!(
            lines, 1,
            "the first batch is logged at once, the rest summed up"
        );
        assert!(!log.flush(start + Duration::from_secs(6), false), "not due");
        assert!(log.flush(start + Duration::from_secs(10), false), "due");
        assert!(
            !log.flush(start + Duration::from_secs(30), true),
            "nothing left"
        );
        assert!(log.reasons.is_empty() && log.first.is_none());
    }
}
