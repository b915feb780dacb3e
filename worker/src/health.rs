//! Liveness and readiness, shared between the pipeline and the HTTP server.

use std::sync::Mutex;
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

/// How long the loop may go without settling a batch (or finding the queue empty) while the
/// queue holds work before `/healthz` fails: a loop that keeps beating but never gets anything
/// done (a reply it retries forever, a database outage this long) is restarted.
pub const STALL_LIMIT: Duration = Duration::from_secs(600);

/// How much of a dependency's last error `/readyz` shows.
const MAX_SUMMARY_BYTES: usize = 300;

/// `/readyz`: the loop has started and every dependency answers; when not, it says what is
/// wrong (the dependency, since when, and its last error, on one line, without credentials).
/// `/healthz`: the loop made progress within its own announced deadline, and, while the queue
/// holds work, settled a batch within [`STALL_LIMIT`].
#[derive(Debug, Default)]
pub struct Health {
    started: AtomicBool,
    broker_up: AtomicBool,
    database_up: AtomicBool,
    alive_until_ms: AtomicU64,
    /// The queue probe's last answer: messages waiting or delivered and not acknowledged.
    work_waiting: AtomicBool,
    /// When a batch was last settled or the broker last had nothing for the loop.
    progressed_ms: AtomicU64,
    stall_limit_ms: AtomicU64,
    /// Each dependency's outage while it is down ([`Dependency::ALL`] order).
    outages: Mutex<[Option<Outage>; 2]>,
}

/// A dependency down: since when (Unix ms) and its last error.
#[derive(Debug, Clone)]
struct Outage {
    since_ms: u64,
    error: String,
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
        health.progressed();
        health.set_stall_limit(STALL_LIMIT);
        health
    }

    /// Overrides [`STALL_LIMIT`].
    pub fn set_stall_limit(&self, limit: Duration) {
        let ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
        self.stall_limit_ms.store(ms, Ordering::Relaxed);
    }

    /// A batch was settled, or the broker had nothing for the loop.
    pub fn progressed(&self) {
        self.progressed_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// What the queue probe last saw: whether messages are waiting or pending.
    pub fn set_work_waiting(&self, waiting: bool) {
        self.work_waiting.store(waiting, Ordering::Relaxed);
    }

    /// Work is waiting and nothing was settled for longer than the stall limit.
    fn is_stalled(&self) -> bool {
        let since = now_ms().saturating_sub(self.progressed_ms.load(Ordering::Relaxed));
        self.work_waiting.load(Ordering::Relaxed)
            && since > self.stall_limit_ms.load(Ordering::Relaxed)
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
        if up {
            self.outages()[dependency as usize] = None;
        }
    }

    /// `dependency` is down, and `error` (its whole cause chain) is why.
    pub fn set_down(&self, dependency: Dependency, error: &str) {
        self.set_up(dependency, false);
        let mut outages = self.outages();
        let outage = &mut outages[dependency as usize];
        let since_ms = outage
            .as_ref()
            .map_or_else(now_ms, |outage| outage.since_ms);
        *outage = Some(Outage {
            since_ms,
            error: summary(error),
        });
    }

    fn outages(&self) -> std::sync::MutexGuard<'_, [Option<Outage>; 2]> {
        self.outages
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What `/readyz` says while the worker is not ready: one line per thing that is wrong.
    pub fn not_ready_because(&self) -> String {
        let mut wrong = Vec::new();
        if !self.started.load(Ordering::Relaxed) {
            wrong.push("not started: waiting for the database schema and the broker".to_owned());
        }
        let outages = self.outages().clone();
        for dependency in Dependency::ALL {
            if !self.is_up(dependency) {
                let name = dependency.as_str();
                wrong.push(match &outages[dependency as usize] {
                    Some(outage) => format!(
                        "{name} unavailable since {} ({}s): {}",
                        humantime::format_rfc3339_seconds(
                            UNIX_EPOCH + Duration::from_millis(outage.since_ms)
                        ),
                        now_ms().saturating_sub(outage.since_ms) / 1000,
                        outage.error
                    ),
                    None => format!("{name} unavailable: no answer yet"),
                });
            }
        }
        if wrong.is_empty() {
            "ready".to_owned()
        } else {
            wrong.join("\n")
        }
    }

    pub fn is_up(&self, dependency: Dependency) -> bool {
        match dependency {
            Dependency::Broker => self.broker_up.load(Ordering::Relaxed),
            Dependency::Database => self.database_up.load(Ordering::Relaxed),
        }
    }

    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::Relaxed)
            && self.broker_up.load(Ordering::Relaxed)
            && self.database_up.load(Ordering::Relaxed)
    }

    pub fn is_live(&self) -> bool {
        now_ms() < self.alive_until_ms.load(Ordering::Relaxed) && !self.is_stalled()
    }
}

/// `error` on one line, at most [`MAX_SUMMARY_BYTES`], with the credentials of any URL in it
/// (`scheme://user:password@host`) masked.
fn summary(error: &str) -> String {
    let mut line: String = error
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut from = 0;
    while let Some(found) = line[from..].find("://") {
        let start = from + found + 3;
        let end = line[start..]
            .find(|c: char| c.is_whitespace() || c == '/')
            .map_or(line.len(), |end| start + end);
        if let Some(at) = line[start..end].rfind('@') {
            line.replace_range(start..start + at, "***");
            from = start + 3;
        } else {
            from = end;
        }
    }
    crate::text::truncate(&line, MAX_SUMMARY_BYTES)
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
    fn readiness_names_the_dependency_and_its_last_error_without_credentials() {
        let health = Health::new();
        health.set_started();
        health.set_up(Dependency::Broker, true);
        health.set_down(
            Dependency::Database,
            "database is unavailable: connect to postgres://app:s3cret@db:5432/x failed:\nrefused",
        );
        let because = health.not_ready_because();
        let (head, error) = because.split_once("s): ").expect(&because);
        assert!(
            head.starts_with("database unavailable since 20"),
            "{because}"
        );
        assert_eq!(
            error,
            "database is unavailable: connect to postgres://***@db:5432/x failed: refused"
        );
        assert!(!because.contains("s3cret"));
        // A later error of the same outage keeps its start.
        let since = |health: &Health| health.outages()[Dependency::Database as usize].clone();
        let first = since(&health).expect("down").since_ms;
        health.set_down(Dependency::Database, "still refused");
        assert_eq!(since(&health).expect("down").since_ms, first);
        health.set_up(Dependency::Database, true);
        assert!(health.is_ready());
        assert_eq!(health.not_ready_because(), "ready");
        let long = "x".repeat(1000);
        health.set_down(Dependency::Broker, &long);
        assert!(health.not_ready_because().len() < MAX_SUMMARY_BYTES + 80);
    }

    #[test]
    fn liveness_expires_after_the_announced_deadline() {
        let health = Health::new();
        assert!(health.is_live());
        health.beat(Duration::ZERO);
        assert!(!health.is_live());
    }

    #[test]
    fn liveness_fails_when_work_waits_and_nothing_is_settled_within_the_stall_limit() {
        let health = Health::new();
        health.set_stall_limit(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        assert!(health.is_live(), "an empty queue is not a stall");
        health.set_work_waiting(true);
        assert!(!health.is_live(), "work waits and nothing was settled");
        health.set_stall_limit(Duration::from_secs(60));
        health.progressed();
        assert!(health.is_live());
    }
}
