//! One backoff type for every dependency: exponential, capped, full jitter, reset after health.

use std::time::Duration;

/// Exponential backoff with full jitter: attempt `n` waits a random time in `[0, min(cap, initial·2ⁿ)]`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    attempt: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(30))
    }
}

impl Backoff {
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Self {
            initial,
            cap,
            attempt: 0,
        }
    }

    /// The ceiling of the next wait (before jitter).
    fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.cap)
    }

    /// The next wait; advances the attempt counter.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(fastrand::u64(0..=nanos))
    }

    /// Failed attempts since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_and_the_cap() {
        let mut backoff = Backoff::default();
        for attempt in 0..40u32 {
            let ceiling = Duration::from_millis(100)
                .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
                .min(Duration::from_secs(30));
            let delay = backoff.next_delay();
            assert!(
                delay <= ceiling,
                "attempt {attempt}: {delay:?} > {ceiling:?}"
            );
        }
        assert_eq!(backoff.attempts(), 40);
        assert_eq!(backoff.ceiling(), Duration::from_secs(30));
    }

    #[test]
    fn jitter_spreads_delays() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let delays: std::collections::HashSet<Duration> =
            (0..20).map(|_| backoff.next_delay()).collect();
        assert!(delays.len() > 10, "full jitter must vary: {delays:?}");
    }

    #[test]
    fn reset_restarts_from_the_initial_delay() {
        let mut backoff = Backoff::default();
        for _ in 0..10 {
            backoff.next_delay();
        }
        backoff.reset();
        assert_eq!(backoff.attempts(), 0);
        assert_eq!(backoff.ceiling(), Duration::from_millis(100));
    }
}
