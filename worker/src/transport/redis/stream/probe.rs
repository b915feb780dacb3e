//! The stream's queue health: lag, pending entries, the oldest waiting entry's age and the
//! dead-letter stream's length, read on a connection of its own.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use redis::Value;

use super::reply::{flat_map, parse_id};
use super::{Connection, array, error_code, integer, is_nogroup, text};
use crate::health::now_ms;
use crate::transport::{QueueHealth, QueueProbe, TransportError};

/// Reads the group's lag, pending count and oldest pending entry, the age of the oldest entry
/// still waiting and the dead-letter stream's length, on its own connection.
#[derive(Debug)]
pub struct StreamProbe {
    pub(super) conn: Connection,
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) dead_letter_stream: String,
    pub(super) oldest_waiting_age_seconds: Gauge<f64, AtomicU64>,
}

impl StreamProbe {
    /// The age of the first entry after the group's last-delivered id (the oldest not yet
    /// delivered) into its gauge; returns the dead-letter stream's length and the age of its
    /// oldest entry.
    async fn record_waiting_and_count_dead_letters(
        &mut self,
        last_delivered: Option<String>,
    ) -> Result<(Option<u64>, Option<Duration>), TransportError> {
        let age_of = |reply: Option<&Value>| {
            reply
                .and_then(array)
                .and_then(|entries| entries.first())
                .and_then(array)
                .and_then(|entry| entry.first())
                .and_then(text)
                .and_then(|id| parse_id(&id))
                .map(|(ms, _)| Duration::from_millis(now_ms().saturating_sub(ms)))
        };
        let mut pipe = redis::pipe();
        pipe.cmd("XLEN").arg(&self.dead_letter_stream);
        pipe.cmd("XRANGE")
            .arg(&self.dead_letter_stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1);
        if let Some(last) = &last_delivered {
            pipe.cmd("XRANGE")
                .arg(&self.stream)
                .arg(format!("({last}"))
                .arg("+")
                .arg("COUNT")
                .arg(1);
        }
        let replies: Vec<Value> = self.conn.pipeline("XLEN+XRANGE", &pipe).await?;
        if last_delivered.is_some() {
            let age = age_of(replies.get(2)).unwrap_or(Duration::ZERO);
            self.oldest_waiting_age_seconds.set(age.as_secs_f64());
        }
        let count = replies.first().and_then(integer);
        Ok((count, age_of(replies.get(1)).or(Some(Duration::ZERO))))
    }
}

impl QueueProbe for StreamProbe {
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let mut cmd = redis::cmd("XINFO");
        cmd.arg("GROUPS").arg(&self.stream);
        let reply = match self.conn.query("XINFO GROUPS", &cmd).await {
            // No stream yet (the group is created with it): nothing waits.
            Err(err) if error_code(&err) == Some("ERR") => Value::Array(Vec::new()),
            other => other?,
        };
        let group = array(&reply)
            .unwrap_or_default()
            .iter()
            .map(flat_map)
            .find(|info| {
                info.get("name").and_then(|v| text(v)).as_deref() == Some(self.group.as_str())
            });
        let last_delivered = group
            .as_ref()
            .and_then(|info| info.get("last-delivered-id").and_then(|v| text(v)));
        let (dead_letters, oldest_dead_letter_age) = self
            .record_waiting_and_count_dead_letters(last_delivered)
            .await?;
        let backlog = group
            .as_ref()
            .and_then(|info| info.get("lag").and_then(|v| integer(v)));
        let pending = group
            .as_ref()
            .and_then(|info| info.get("pending").and_then(|v| integer(v)));
        let mut cmd = redis::cmd("XPENDING");
        cmd.arg(&self.stream).arg(&self.group);
        let summary = match self.conn.query("XPENDING", &cmd).await {
            // The group is recreated by the loop; until then nothing is pending.
            Err(err) if is_nogroup(&err) => {
                return Ok(QueueHealth {
                    dead_letters,
                    oldest_dead_letter_age,
                    ..QueueHealth::default()
                });
            }
            other => other?,
        };
        let oldest_pending_age = array(&summary)
            .and_then(|parts| parts.get(1))
            .and_then(text)
            .and_then(|id| parse_id(&id))
            .map(|(ms, _)| Duration::from_millis(now_ms().saturating_sub(ms)));
        Ok(QueueHealth {
            backlog,
            pending,
            oldest_pending_age: oldest_pending_age.or(Some(Duration::ZERO)),
            dead_letters,
            oldest_dead_letter_age,
        })
    }
}
