//! The stream's housekeeping, run by `maintain`: taking over entries idle longer than
//! `claimIdleSeconds` (XAUTOCLAIM), trimming expired dead letters and removing idle consumers.

use std::time::Duration;

use redis::Value;

use super::super::protocol;
use super::reply::{flat_map, into_array, into_text, parse_entries};
use super::{BLOCK, RedisStream, array, integer, text};
use crate::health::now_ms;
use crate::transport::TransportError;

impl RedisStream {
    /// XAUTOCLAIM entries idle longer than `claimIdleSeconds` into `reclaimed`.
    pub(super) async fn reclaim_idle_entries(&mut self) -> Result<(), TransportError> {
        let limit = self.settings.batch_size.saturating_mul(10);
        let mut cursor = "0-0".to_owned();
        while self.reclaimed.len() < limit {
            let mut cmd = redis::cmd("XAUTOCLAIM");
            cmd.arg(&self.settings.stream)
                .arg(&self.settings.group)
                .arg(&self.settings.consumer)
                .arg(u64::try_from(self.settings.claim_idle.as_millis()).unwrap_or(u64::MAX))
                .arg(&cursor)
                .arg("COUNT")
                .arg(self.settings.batch_size);
            let reply = self.control("XAUTOCLAIM", &cmd).await?;
            let mut parts = into_array(reply)
                .ok_or_else(|| protocol("XAUTOCLAIM", "reply is not an array"))?
                .into_iter();
            let next = parts
                .next()
                .and_then(into_text)
                .ok_or_else(|| protocol("XAUTOCLAIM", "no cursor"))?;
            let entries = parse_entries(
                "XAUTOCLAIM",
                parts.next().unwrap_or(Value::Array(Vec::new())),
            )?;
            if !entries.is_empty() {
                let messages = self.with_counts(entries).await?;
                self.metrics.reclaimed.inc_by(messages.len() as u64);
                tracing::info!(
                    count = messages.len(),
                    "took over entries idle longer than claimIdleSeconds"
                );
                self.reclaimed.extend(messages);
            }
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        Ok(())
    }

    /// Trims dead letters older than the retention (`XTRIM … MINID`: entry ids are times).
    pub(super) async fn trim_expired_dead_letters(&mut self) -> Result<(), TransportError> {
        let retention =
            u64::try_from(self.settings.dead_letter_retention.as_millis()).unwrap_or(u64::MAX);
        let Some(cutoff) = now_ms().checked_sub(retention) else {
            return Ok(());
        };
        let mut cmd = redis::cmd("XTRIM");
        cmd.arg(&self.settings.dead_letter_stream)
            .arg("MINID")
            .arg(cutoff);
        let trimmed = integer(&self.control("XTRIM", &cmd).await?).unwrap_or(0);
        if trimmed > 0 {
            tracing::info!(
                trimmed,
                "deleted dead letters older than deadLetter.retentionDays"
            );
        }
        Ok(())
    }

    /// Removes other consumers that hold no pending entries and have been idle well beyond a
    /// blocking read. A consumer with pending entries is never removed.
    pub(super) async fn remove_idle_consumers(&mut self) -> Result<(), TransportError> {
        let threshold = (self.settings.claim_idle * 2).max(BLOCK * 5);
        let mut cmd = redis::cmd("XINFO");
        cmd.arg("CONSUMERS")
            .arg(&self.settings.stream)
            .arg(&self.settings.group);
        let reply = self.control("XINFO CONSUMERS", &cmd).await?;
        for consumer in array(&reply).unwrap_or_default() {
            let info = flat_map(consumer);
            let name = info.get("name").and_then(|v| text(v));
            let pending = info.get("pending").and_then(|v| integer(v));
            let idle = info.get("idle").and_then(|v| integer(v));
            let (Some(name), Some(0), Some(idle)) = (name, pending, idle) else {
                continue;
            };
            if name == self.settings.consumer || Duration::from_millis(idle) < threshold {
                continue;
            }
            let mut cmd = redis::cmd("XGROUP");
            cmd.arg("DELCONSUMER")
                .arg(&self.settings.stream)
                .arg(&self.settings.group)
                .arg(&name);
            self.control("XGROUP DELCONSUMER", &cmd).await?;
            self.metrics.consumers_removed.inc();
            tracing::info!(consumer = %name, idle_ms = idle, "removed idle consumer with no pending entries");
        }
        Ok(())
    }
}
