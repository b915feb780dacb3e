//! The circuit breaker in front of the gateway: after [`FAILURES_TO_OPEN`] calls in a row
//! failed because the gateway was overloaded or unreachable (429, 502, 503, 504, no
//! connection), it **opens**: calls fail at once without reaching the gateway. After
//! [`OPEN_FOR`] it is **half-open**: one call goes through as a probe while the others still
//! fail at once; the probe's success **closes** it, its failure opens it again. The pipeline's
//! backoff paces the retries meanwhile. One log line per change of state.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use crate::transport::TransportError;

/// Failures in a row that open the circuit.
pub const FAILURES_TO_OPEN: u32 = 5;
/// How long the circuit stays open before a probe is let through.
pub const OPEN_FOR: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe is out.
    HalfOpen,
}

/// The state as the gauge shows it: 0 closed, 1 open, 2 half-open.
fn gauge_value(phase: Phase) -> i64 {
    match phase {
        Phase::Closed { .. } => 0,
        Phase::Open { .. } => 1,
        Phase::HalfOpen => 2,
    }
}

/// The circuit fails the call at once.
#[derive(Debug, thiserror::Error)]
#[error("the circuit breaker is open after {FAILURES_TO_OPEN} failed calls in a row")]
pub struct CircuitOpen;

#[derive(Debug)]
pub struct CircuitBreaker {
    phase: Mutex<Phase>,
    state: Gauge,
    opened: Counter,
}

impl CircuitBreaker {
    /// `state` shows the state, `opened` counts openings.
    pub fn new(state: Gauge, opened: Counter) -> Self {
        Self {
            phase: Mutex::new(Phase::Closed { failures: 0 }),
            state,
            opened,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Phase) -> T) -> T {
        let mut phase = self.phase.lock().unwrap_or_else(PoisonError::into_inner);
        let result = f(&mut phase);
        self.state.set(gauge_value(*phase));
        result
    }

    /// Whether a call may go out now: a permit to report the call's outcome with.
    pub fn admit(&self) -> Result<Permit<'_>, TransportError> {
        self.with(|phase| match *phase {
            Phase::Closed { .. } => Ok(()),
            Phase::Open { until } if Instant::now() >= until => {
                *phase = Phase::HalfOpen;
                tracing::info!("gateway circuit half-open: one call probes the gateway");
                Ok(())
            }
            Phase::Open { .. } | Phase::HalfOpen => Err(TransportError::transient(
                "the gateway call was not sent",
                CircuitOpen,
            )),
        })?;
        Ok(Permit {
            breaker: self,
            reported: false,
        })
    }

    /// The gateway answered (whatever the answer, it is up).
    fn succeeded(&self) {
        self.with(|phase| {
            if !matches!(*phase, Phase::Closed { .. }) {
                tracing::info!("gateway circuit closed: the gateway answers again");
            }
            *phase = Phase::Closed { failures: 0 };
        });
    }

    /// The gateway was overloaded or unreachable.
    fn failed(&self) {
        self.with(|phase| match *phase {
            Phase::Closed { failures } if failures + 1 >= FAILURES_TO_OPEN => {
                *phase = Phase::Open {
                    until: Instant::now() + OPEN_FOR,
                };
                self.opened.inc();
                tracing::warn!(
                    failures = failures + 1,
                    open_for = ?OPEN_FOR,
                    "gateway circuit open: calls fail at once until a probe succeeds"
                );
            }
            Phase::Closed { failures } => *phase = Phase::Closed { failures: failures + 1 },
            Phase::HalfOpen => {
                *phase = Phase::Open {
                    until: Instant::now() + OPEN_FOR,
                };
                self.opened.inc();
                tracing::warn!(open_for = ?OPEN_FOR, "gateway circuit open again: the probe failed");
            }
            // A call admitted before the circuit opened.
            Phase::Open { .. } => {}
        });
    }
}

/// One admitted call; its outcome is reported once. A call dropped unreported (its future
/// was cancelled) lets the next call probe, if it was the probe.
#[derive(Debug)]
pub struct Permit<'a> {
    breaker: &'a CircuitBreaker,
    reported: bool,
}

impl Permit<'_> {
    /// The gateway answered.
    pub fn succeeded(mut self) {
        self.reported = true;
        self.breaker.succeeded();
    }

    /// The gateway was overloaded or unreachable.
    pub fn failed(mut self) {
        self.reported = true;
        self.breaker.failed();
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.reported {
            self.breaker.with(|phase| {
                if *phase == Phase::HalfOpen {
                    *phase = Phase::Open {
                        until: Instant::now(),
                    };
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> CircuitBreaker {
        CircuitBreaker::new(Gauge::default(), Counter::default())
    }

    #[test]
    fn opens_after_failures_in_a_row_and_a_success_resets_the_count() {
        let breaker = breaker();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            breaker.admit().expect("closed").failed();
        }
        breaker.admit().expect("closed").succeeded();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            breaker.admit().expect("closed").failed();
        }
        breaker.admit().expect("still closed").failed();
        assert!(breaker.admit().is_err(), "open");
        assert_eq!(breaker.opened.get(), 1);
        assert_eq!(breaker.state.get(), 1);
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_outcome_decides() {
        let breaker = breaker();
        *breaker.phase.lock().unwrap() = Phase::Open {
            until: Instant::now(),
        };
        let probe = breaker.admit().expect("the probe");
        assert_eq!(breaker.state.get(), 2);
        assert!(breaker.admit().is_err(), "only one probe at a time");
        probe.failed();
        assert!(breaker.admit().is_err(), "open again");
        assert_eq!(breaker.opened.get(), 1);
        *breaker.phase.lock().unwrap() = Phase::Open {
            until: Instant::now(),
        };
        drop(breaker.admit().expect("a probe, cancelled"));
        breaker.admit().expect("the next call probes").succeeded();
        assert!(breaker.admit().is_ok() && breaker.admit().is_ok(), "closed");
        assert_eq!(breaker.state.get(), 0);
    }
}
