//! Stale acknowledgements in the log, summed up like dead letters: the first refusal after a
//! quiet period is logged at once; what follows is summed up at most once per
//! [`SUMMARY_INTERVAL`](super::dead_letter_log::SUMMARY_INTERVAL) (the count and the first
//! error), and what is left when the loop stops is logged then. Each refusal is counted by
//! `switchboard_stale_receipts_total` when it happens.

use std::time::Instant;

use switchboard_telemetry::ErrorChain;

use super::dead_letter_log::SummaryPace;
use crate::transport::TransportError;

#[derive(Debug, Default)]
pub(super) struct StaleLog {
    /// Receipts refused as stale since the last summary.
    count: u64,
    /// The error of the first refusal since the last summary.
    first_error: Option<String>,
    pace: SummaryPace,
}

impl StaleLog {
    /// Counts `count` receipts refused with `err` and logs the summary if due.
    pub(super) fn add(&mut self, count: usize, err: &TransportError, now: Instant) {
        self.count += count as u64;
        self.first_error
            .get_or_insert_with(|| ErrorChain(err).to_string());
        self.flush(now, false);
    }

    /// Logs the refusals since the last summary, if any, when the interval has passed or
    /// `stopping`. Returns whether it logged.
    pub(super) fn flush(&mut self, now: Instant, stopping: bool) -> bool {
        if self.count == 0 || !self.pace.due(now, stopping) {
            return false;
        }
        let count = std::mem::take(&mut self.count);
        let first_error = self.first_error.take().unwrap_or_default();
        tracing::warn!(
            count,
            first_error = %first_error,
            "acknowledgements refused as stale (summed up at most every 10 s); the broker \
             redelivers and deduplication collapses them"
        );
        self.pace.logged(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_storm_of_a_thousand_stale_receipts_is_two_lines_and_a_quiet_one_is_one() {
        let err = TransportError::stale("the broker refused receipts as no longer valid", None);
        let start = Instant::now();
        let mut log = StaleLog::default();
        let mut lines = 0;
        // 100 acknowledgement calls of 10 refused receipts over 5 s.
        for call in 0..100 {
            let now = start + Duration::from_millis(50 * call);
            let before = log.count;
            log.add(10, &err, now);
            lines += usize::from(log.count < before + 10);
        }
        assert_eq!(
            lines, 1,
            "the first refusal is logged at once, the rest summed up"
        );
        assert_eq!(log.count, 990);
        assert!(!log.flush(start + Duration::from_secs(6), false), "not due");
        assert!(log.flush(start + Duration::from_secs(10), false), "due");
        assert_eq!(log.count, 0);
        assert!(
            !log.flush(start + Duration::from_secs(30), true),
            "nothing left"
        );
        log.add(1, &err, start + Duration::from_secs(31));
        assert_eq!(
            log.count, 0,
            "a refusal after a quiet spell is logged at once"
        );
        log.add(2, &err, start + Duration::from_secs(32));
        assert!(
            log.flush(start + Duration::from_secs(33), true),
            "left at the stop"
        );
        assert!(log.first_error.is_none());
    }
}
