//! Redis: streams with a consumer group, reliable lists and pub/sub, and the plumbing they share:
//! connections that reconnect after failures, error mapping, reply helpers, body-hash keys and
//! the dead-letter record.

pub mod list;
pub mod pubsub;
pub mod stream;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, FromRedisValue, Value};
use sha2::{Digest, Sha256};

use super::{DeadLetter, TransportError};
use crate::payload::fields_json;

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one blocking read waits for new messages.
pub const BLOCK: Duration = Duration::from_secs(1);

pub fn redis_error(command: &'static str) -> impl FnOnce(redis::RedisError) -> TransportError {
    move |source| TransportError::transient(format!("redis command {command} failed"), source)
}

pub fn protocol(command: &'static str, detail: impl Into<String>) -> TransportError {
    TransportError::protocol(format!(
        "redis reply to {command} was not understood: {}",
        detail.into()
    ))
}

/// The error code of the Redis reply behind `err` (`NOGROUP`, `BUSYGROUP`, …), if it is one.
pub fn error_code(err: &TransportError) -> Option<&str> {
    std::error::Error::source(err)?
        .downcast_ref::<redis::RedisError>()?
        .code()
}

/// Opens a client for `url`.
pub fn open(url: &str) -> Result<Client, TransportError> {
    Client::open(url).map_err(redis_error("CONNECT"))
}

/// A lazily (re)connected multiplexed connection. A failure other than an error reply from the
/// server drops it, so the next call reconnects.
#[derive(Debug)]
pub struct Connection {
    client: Client,
    response_timeout: Duration,
    slot: Option<MultiplexedConnection>,
}

impl Connection {
    pub fn new(client: Client, response_timeout: Duration) -> Self {
        Self {
            client,
            response_timeout,
            slot: None,
        }
    }

    async fn take(&mut self) -> Result<MultiplexedConnection, TransportError> {
        match self.slot.take() {
            Some(conn) => Ok(conn),
            None => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(self.response_timeout));
                self.client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(redis_error("CONNECT"))
            }
        }
    }

    fn keep<T>(&mut self, conn: MultiplexedConnection, result: &redis::RedisResult<T>) {
        if result
            .as_ref()
            .map_or_else(|err| err.code().is_some(), |_| true)
        {
            self.slot = Some(conn);
        }
    }

    /// Runs one command.
    pub async fn query(
        &mut self,
        command: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<Value, TransportError> {
        let mut conn = self.take().await?;
        let result = cmd.query_async::<Value>(&mut conn).await;
        self.keep(conn, &result);
        result.map_err(redis_error(command))
    }

    /// Runs a pipeline (one round trip).
    pub async fn pipeline<T: FromRedisValue>(
        &mut self,
        command: &'static str,
        pipe: &redis::Pipeline,
    ) -> Result<T, TransportError> {
        let mut conn = self.take().await?;
        let result = pipe.query_async::<T>(&mut conn).await;
        self.keep(conn, &result);
        result.map_err(redis_error(command))
    }

    /// Closes the connection; the next call reconnects.
    pub fn disconnect(&mut self) {
        self.slot = None;
    }
}

pub fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

pub fn integer(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other).and_then(|s| s.parse().ok()),
    }
}

pub fn array(value: &Value) -> Option<&[Value]> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

/// Hex SHA-256 of a body.
pub fn body_hash(body: &[u8]) -> String {
    hex::encode(Sha256::digest(body))
}

pub fn rfc3339_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// Where a dead letter came from, for its record.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    /// `list` or `channel`.
    pub kind: &'static str,
    pub name: &'a str,
    pub adapter: &'a str,
    pub consumer: &'a str,
}

/// A dead letter as one JSON document (list and pub/sub modes): the body byte-for-byte (as
/// `body` when UTF-8, else `body_base64`) and its context.
pub fn dead_letter_record<R>(letter: &DeadLetter<'_, R>, origin: Origin<'_>) -> String {
    let message = letter.message;
    let mut record = serde_json::json!({
        "reason": letter.reason.as_str(),
        "last_error": letter.error,
        "delivery_count": message.delivery_count,
        "adapter": origin.adapter,
        "consumer": origin.consumer,
        "first_seen": message.enqueued_at_ms.map(rfc3339_ms),
        "last_seen": now_rfc3339(),
        "headers": serde_json::from_str::<serde_json::Value>(&fields_json(&message.headers))
            .unwrap_or_default(),
    });
    record[format!("origin_{}", origin.kind)] = origin.name.into();
    match std::str::from_utf8(&message.body) {
        Ok(body) => record["body"] = body.into(),
        Err(_) => {
            record["body_base64"] = base64::engine::general_purpose::STANDARD
                .encode(&message.body)
                .into();
        }
    }
    record.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::Message;

    fn message(body: &[u8]) -> Message<()> {
        Message {
            receipt: (),
            external_id: "sha256:x".into(),
            idempotency_key: "redis:a/b:sha256:x".into(),
            body: body.to_vec(),
            headers: vec![("channel".into(), b"orders".to_vec())],
            delivery_count: 2,
            enqueued_at_ms: Some(0),
            position: None,
            undecodable: None,
        }
    }

    #[test]
    fn dead_letter_record_keeps_binary_bodies_losslessly() {
        let message = message(&[0xff, 0x00, 0x01]);
        let letter = DeadLetter {
            message: &message,
            reason: PoisonReason::NotUtf8,
            error: "not UTF-8".into(),
        };
        let origin = Origin {
            kind: "list",
            name: "jobs",
            adapter: "a/b",
            consumer: "c",
        };
        let record: serde_json::Value =
            serde_json::from_str(&dead_letter_record(&letter, origin)).expect("json");
        assert_eq!(record["body_base64"], "/wAB");
        assert!(record.get("body").is_none());
        assert_eq!(record["origin_list"], "jobs");
        assert_eq!(record["reason"], "not_utf8");
        assert_eq!(record["delivery_count"], 2);
        assert_eq!(record["first_seen"], "1970-01-01T00:00:00.000Z");
        assert_eq!(record["headers"]["channel"], "orders");
    }

    #[test]
    fn body_hash_is_hex_sha256() {
        assert_eq!(
            body_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
