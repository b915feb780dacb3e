//! The messages this worker holds (received, not yet deleted), for the oldest-pending gauge:
//! SQS itself reports the age of its oldest message only as a CloudWatch metric.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::receive::SqsDelivery;

#[derive(Debug, Clone, Copy)]
struct Held {
    sent_ms: u64,
    /// When the visibility timeout expires: past it, SQS may hand the message to anyone and
    /// this worker no longer holds it (its acknowledgement will be stale).
    until: Instant,
}

/// Shared between the transport (which receives, extends and deletes) and its probe.
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<Mutex<HashMap<String, Held>>>);

impl InFlight {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Held>) -> T) -> T {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut held)
    }

    /// Messages just received, hidden for `lease`.
    pub fn received(&self, messages: &[SqsDelivery], lease: Duration) {
        let until = Instant::now() + lease;
        self.with(|held| {
            for message in messages {
                if let Some(sent_ms) = message.enqueued_at_ms {
                    held.insert(message.external_id.clone(), Held { sent_ms, until });
                }
            }
        });
    }

    /// Messages whose visibility was just extended by `lease`.
    pub fn extended(&self, messages: &[&SqsDelivery], lease: Duration) {
        let until = Instant::now() + lease;
        self.with(|held| {
            for message in messages {
                if let Some(entry) = held.get_mut(&message.external_id) {
                    entry.until = until;
                }
            }
        });
    }

    /// Messages deleted (or whose receipts turned out stale).
    pub fn settled<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        self.with(|held| {
            for id in ids {
                held.remove(id);
            }
        });
    }

    /// How long ago the oldest message still held was sent (zero when none is held).
    /// Forgets messages whose visibility expired.
    pub fn oldest_age(&self, now_ms: u64) -> Duration {
        let now = Instant::now();
        self.with(|held| {
            held.retain(|_, entry| entry.until > now);
            held.values()
                .map(|entry| entry.sent_ms)
                .min()
                .map_or(Duration::ZERO, |sent| {
                    Duration::from_millis(now_ms.saturating_sub(sent))
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Message;
    use crate::transport::sqs::receive::Receipt;

    fn message(id: &str, sent_ms: u64) -> SqsDelivery {
        Message {
            receipt: Receipt {
                handle: format!("h-{id}"),
                group: None,
            },
            external_id: id.into(),
            idempotency_key: format!("sqs:a/b:{id}"),
            body: b"{}".to_vec(),
            headers: Vec::new(),
            delivery_count: 1,
            enqueued_at_ms: Some(sent_ms),
            position: None,
            undecodable: None,
        }
    }

    #[test]
    fn oldest_held_message_ages_until_it_is_deleted() {
        let held = InFlight::default();
        let lease = Duration::from_secs(60);
        held.received(&[message("a", 1_000), message("b", 4_000)], lease);
        assert_eq!(held.oldest_age(10_000), Duration::from_secs(9));
        held.settled(["a"]);
        assert_eq!(held.oldest_age(10_000), Duration::from_secs(6));
        held.settled(["b"]);
        assert_eq!(held.oldest_age(10_000), Duration::ZERO);
    }

    #[test]
    fn messages_whose_visibility_expired_are_no_longer_held() {
        let held = InFlight::default();
        let b = message("b", 2_000);
        held.received(&[message("a", 1_000), b.clone()], Duration::ZERO);
        held.extended(&[&b], Duration::from_secs(60));
        assert_eq!(held.oldest_age(3_000), Duration::from_secs(1));
    }
}
