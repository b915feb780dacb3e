//! One backoff type for every retry of the worker and the operator: exponential, capped, with
//! full or equal jitter, reset after health.

use std::time::Duration;

/// How much of a wait is random.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// A random wait in `[0, ceiling]`: retries of many clients spread out the most.
    Full,
    /// A random wait in `[ceiling / 2, ceiling]`: never much shorter than the ceiling.
    Equal,
}

/// Exponential backoff: attempt `n` (from 0) has the ceiling `min(cap, initial·2ⁿ)` and waits
/// a random time below it, as [`Jitter`] says.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    jitter: Jitter,
    attempt: u32,
}

impl Default for Backoff {
    /// 100 ms doubling to 30 s, full jitter.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(30))
    }
}

impl Backoff {
    /// From `initial` doubling to `cap`, full jitter.
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Self {
            initial,
            cap,
            jitter: Jitter::Full,
            attempt: 0,
        }
    }

    #[must_use]
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The ceiling of attempt `attempt`'s wait (before jitter).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.cap)
    }

    /// The wait of attempt `attempt` (from 0), without advancing the counter: for callers
    /// that count failures themselves.
    pub fn delay(&self, attempt: u32) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_nanos()).unwrap_or(u64::MAX);
        let floor = match self.jitter {
            Jitter::Full => 0,
            Jitter::Equal => ceiling / 2,
        };
        Duration::from_nanos(fastrand::u64(floor..=ceiling))
    }

    /// The next wait; advances the attempt counter.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        delay
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
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn delays_stay_under_a_doubling_ceiling_and_the_cap() {
        let mut backoff = Backoff::default();
        for attempt in 0..40u32 {
            let ceiling = Duration::from_millis(100)
                .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
                .min(Duration::from_secs(30));
            assert_eq!(backoff.ceiling(attempt), ceiling);
            let delay = backoff.next_delay();
            assert!(
                delay <= ceiling,
                "attempt {attempt}: {delay:?} > {ceiling:?}"
            );
        }
        assert_eq!(backoff.attempts(), 40);
        assert_eq!(backoff.ceiling(40), Duration::from_secs(30));
    }

    #[test]
    fn full_jitter_spreads_delays_over_zero_to_the_ceiling() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let delays: Vec<Duration> = (0..200).map(|_| backoff.delay(0)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_secs(1)));
        assert!(
            delays.iter().any(|d| *d < Duration::from_millis(500)),
            "full jitter reaches below half the ceiling: {delays:?}"
        );
        let distinct: HashSet<&Duration> = delays.iter().collect();
        assert!(distinct.len() > 100, "full jitter must vary");
    }

    #[test]
    fn equal_jitter_stays_between_half_the_ceiling_and_the_ceiling() {
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(300))
            .with_jitter(Jitter::Equal);
        for attempt in [0, 1, 4, 20] {
            let ceiling = backoff.ceiling(attempt);
            let delays: Vec<Duration> = (0..100).map(|_| backoff.delay(attempt)).collect();
            assert!(
                delays.iter().all(|d| *d >= ceiling / 2 && *d <= ceiling),
                "attempt {attempt}: {delays:?} outside [{:?}, {ceiling:?}]",
                ceiling / 2
            );
            let distinct: HashSet<&Duration> = delays.iter().collect();
            assert!(distinct.len() > 50, "equal jitter must vary");
        }
        assert_eq!(backoff.ceiling(20), Duration::from_secs(300));
    }

    #[test]
    fn reset_restarts_from_the_initial_delay() {
        let mut backoff = Backoff::default();
        for _ in 0..10 {
            backoff.next_delay();
        }
        backoff.reset();
        assert_eq!(backoff.attempts(), 0);
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
