//! Redis streams and reliable lists, on the fixture's own Redis.

use anyhow::{Context as _, Result};
use base64::Engine as _;

use super::{BrokerFixture, GROUP};
use crate::Fixture;

/// A Redis stream read by a consumer group (the fixture's Redis).
#[derive(Debug)]
pub struct RedisStreamBroker;

/// A Redis reliable list (the fixture's Redis).
#[derive(Debug)]
pub struct RedisListBroker;

impl BrokerFixture for RedisStreamBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Ok((Self, Vec::new()))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        Ok(format!("redis: {{mode: stream, stream: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        fx.produce(name, bodies).map(drop)
    }

    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64> {
        let mut conn = fx.redis.connection()?;
        let groups: redis::Value =
            match redis::cmd("XINFO").arg("GROUPS").arg(name).query(&mut conn) {
                Ok(groups) => groups,
                // No stream yet: nothing produced.
                Err(err) if err.code() == Some("ERR") => return Ok(0),
                Err(err) => return Err(err.into()),
            };
        let lag = group_field(&groups, "lag");
        match lag {
            Some(lag) => Ok(lag + fx.pending(name, GROUP)?),
            // No group yet: every entry is waiting.
            None => fx.xlen(name),
        }
    }

    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        fx.stream_entries(&format!("{name}.dlq"))?
            .into_iter()
            .map(|letter| {
                let body = letter.get("body").context("dead letter without a body")?;
                Ok((body.clone(), crate::field(&letter, "reason")?))
            })
            .collect()
    }

    async fn restart(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.restart_empty()
    }

    async fn crash(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.crash()
    }

    fn address(&self, fx: &Fixture) -> Result<String> {
        Ok(fx.redis.address())
    }

    async fn recreate(&self, fx: &Fixture, name: &str) -> Result<()> {
        delete_key(fx, name)
    }

    /// An entry whose `body` field is the body and whose other fields are the headers.
    async fn produce_with_headers(
        &self,
        fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut conn = fx.redis.connection()?;
        let mut cmd = redis::cmd("XADD");
        cmd.arg(name).arg("*").arg("body").arg(body);
        for (field, value) in headers {
            cmd.arg(field).arg(value);
        }
        cmd.query::<String>(&mut conn)?;
        Ok(())
    }

    /// A field whose value is not UTF-8 and holds a NUL byte (a field *name* that is not
    /// UTF-8 makes the entry poison, tests/tests/stream.rs).
    async fn produce_undecodable(&self, fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        let mut conn = fx.redis.connection()?;
        redis::cmd("XADD")
            .arg(name)
            .arg("*")
            .arg("body")
            .arg(body)
            .arg("trace")
            .arg(&b"\x00\xfe\xff binary"[..])
            .query::<String>(&mut conn)?;
        Ok(())
    }

    async fn refuse_dead_letters(&self, fx: &Fixture, name: &str) -> Result<()> {
        occupy_with_a_string(fx, &format!("{name}.dlq"))
    }
}

/// Deletes Redis key `key`.
fn delete_key(fx: &Fixture, key: &str) -> Result<()> {
    let mut conn = fx.redis.connection()?;
    redis::cmd("DEL").arg(key).query::<i64>(&mut conn)?;
    Ok(())
}

/// Puts a string at `key`: a stream or list command on it fails with WRONGTYPE, for good.
fn occupy_with_a_string(fx: &Fixture, key: &str) -> Result<()> {
    let mut conn = fx.redis.connection()?;
    redis::cmd("SET")
        .arg(key)
        .arg("not a stream or list")
        .query::<()>(&mut conn)?;
    Ok(())
}

/// `field` of the consumer group [`GROUP`] in an XINFO GROUPS reply.
fn group_field(groups: &redis::Value, field: &str) -> Option<u64> {
    let redis::Value::Array(groups) = groups else {
        return None;
    };
    groups.iter().find_map(|group| {
        let redis::Value::Array(pairs) = group else {
            return None;
        };
        let text = |value: &redis::Value| match value {
            redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            redis::Value::SimpleString(text) => Some(text.clone()),
            _ => None,
        };
        let named = pairs.chunks_exact(2).any(|pair| {
            text(&pair[0]).as_deref() == Some("name") && text(&pair[1]).as_deref() == Some(GROUP)
        });
        if !named {
            return None;
        }
        pairs.chunks_exact(2).find_map(|pair| {
            (text(&pair[0]).as_deref() == Some(field)).then_some(())?;
            match &pair[1] {
                redis::Value::Int(n) => u64::try_from(*n).ok(),
                _ => None,
            }
        })
    })
}

impl BrokerFixture for RedisListBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Ok((Self, Vec::new()))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        Ok(format!("redis: {{mode: list, list: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        fx.push(name, bodies)
    }

    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64> {
        fx.unacknowledged_items(name)
    }

    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        let mut conn = fx.redis.connection()?;
        let records: Vec<String> = redis::cmd("LRANGE")
            .arg(format!("{name}.dlq"))
            .arg(0)
            .arg(-1)
            .query(&mut conn)?;
        records
            .iter()
            .map(|record| {
                let record: serde_json::Value = serde_json::from_str(record)?;
                let body = match (record["body"].as_str(), record["body_base64"].as_str()) {
                    (Some(body), _) => body.as_bytes().to_vec(),
                    (None, Some(encoded)) => {
                        base64::engine::general_purpose::STANDARD.decode(encoded)?
                    }
                    (None, None) => anyhow::bail!("dead letter without a body: {record}"),
                };
                let reason = record["reason"].as_str().unwrap_or_default().to_owned();
                Ok((body, reason))
            })
            .collect()
    }

    async fn restart(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.restart_empty()
    }

    async fn crash(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.crash()
    }

    fn address(&self, fx: &Fixture) -> Result<String> {
        Ok(fx.redis.address())
    }

    async fn recreate(&self, fx: &Fixture, name: &str) -> Result<()> {
        delete_key(fx, name)
    }

    /// A list item is a body alone: a trace context has to ride in the body (a structured
    /// CloudEvent's `traceparent`).
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        _body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let names: Vec<&str> = headers.iter().map(|(header, _)| *header).collect();
        anyhow::bail!(
            "list {name}: a Redis list item is a body alone and has no headers for {names:?} \
             (send a structured CloudEvent instead)"
        )
    }

    /// A list item is a body alone: it has no header, key or attribute that could be
    /// undecodable, so the item is just the body.
    async fn produce_undecodable(&self, fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        fx.push(name, [body])
    }

    async fn refuse_dead_letters(&self, fx: &Fixture, name: &str) -> Result<()> {
        occupy_with_a_string(fx, &format!("{name}.dlq"))
    }
}
