//! Liveness and readiness, shared between the pipeline and the HTTP server.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A dependency the worker waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dependency {
    Broker,
    Database,
}

impl Dependency {
    pub const ALL: [Dependency; 2] = [Dependency::Broker, Dependency::Database];

    pub fn as_str(self) -> &'static str {
        match self {
            Dependency::Broker => "broker",
            Dependency::Database => "database",
        }
    }
}

/// `/readyz`: the loop has started and every dependency answers.
/// `/healthz`: the loop made progress within its own announced deadline.
#[derive(Debug, Default)]
pub struct Health {
    started: AtomicBool,
    broker_up: AtomicBool,
    database_up: AtomicBool,
    alive_until_ms: AtomicU64,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Health {
    pub fn new() -> Self {
        let health = Self::default();
        health.beat(Duration::from_secs(120));
        health
    }

    /// The loop is alive and promises to beat again within `within`.
    pub fn beat(&self, within: Duration) {
        let until = now_ms().saturating_add(u64::try_from(within.as_millis()).unwrap_or(u64::MAX));
        self.alive_until_ms.store(until, Ordering::Relaxed);
    }

    pub fn set_started(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    pub fn set_up(&self, dependency: Dependency, up: bool) {
        let flag = match dependency {
            Dependency::Broker => &self.broker_up,
            Dependency::Database => &self.database_up,
        };
        flag.store(up, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::Relaxed)
            && self.broker_up.load(Ordering::Relaxed)
            && self.database_up.load(Ordering::Relaxed)
    }

    pub fn is_live(&self) -> bool {
        now_ms() < self.alive_until_ms.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_started_and_both_dependencies_up() {
        let health = Health::new();
        assert!(!health.is_ready());
        health.set_started();
        health.set_up(Dependency::Broker, true);
        assert!(!health.is_ready());
        health.set_up(Dependency::Database, true);
        assert!(health.is_ready());
        health.set_up(Dependency::Database, false);
        assert!(!health.is_ready());
    }

    #[test]
    fn liveness_expires_after_the_announced_deadline() {
        let health = Health::new();
        assert!(health.is_live());
        health.beat(Duration::ZERO);
        assert!(!health.is_live());
    }
}
