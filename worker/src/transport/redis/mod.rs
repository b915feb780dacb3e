//! Redis: streams with a consumer group, reliable lists and pub/sub, and the plumbing they share:
//! connections that reconnect after failures, error mapping, reply helpers, body-hash keys and
//! the dead-letter record.

pub mod list;
pub mod pubsub;
pub mod reader;
pub mod stream;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, FromRedisValue, Value};

use super::dead_letter::DeadLetterContext;
use super::{DeadLetter, TransportError};
use crate::payload::{fields_json, insert_body};

pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one blocking read waits for new messages.
pub const BLOCK: Duration = Duration::from_secs(1);

/// A key a transport works on, and the setting that names it: a key holding another type
/// (WRONGTYPE) is a misconfiguration the user fixes there.
#[derive(Debug, Clone)]
pub struct NamedKey {
    pub key: String,
    /// `spec.source.redis.stream`, `spec.delivery.deadLetter.list`, …
    pub setting: &'static str,
    /// What the key must hold: `stream`, `list`, `hash`, …
    pub kind: &'static str,
}

impl NamedKey {
    pub fn new(key: impl Into<String>, setting: &'static str, kind: &'static str) -> Self {
        Self {
            key: key.into(),
            setting,
            kind,
        }
    }
}

/// The error codes of every server error inside `err` (one per failed command of a pipeline).
fn server_codes(err: &redis::RedisError) -> Vec<(usize, String)> {
    match err.clone().into_server_errors() {
        Some(errors) => errors
            .iter()
            .map(|(index, error)| (*index, error.code().to_owned()))
            .collect(),
        None => err
            .code()
            .map(|code| vec![(0, code.to_owned())])
            .unwrap_or_default(),
    }
}

/// The one place a Redis failure is classified. Refused credentials, a database index the
/// server refuses, a denied command and an invalid URL are fatal naming `REDIS_URL`; a key
/// of the wrong type is fatal naming the key and its setting (among `keys`, those `commands`
/// use); everything else (refused connections, timeouts, a server loading its data) is
/// transient. Never prints the URL (it may hold the password).
pub fn classify_redis_error(
    command: &'static str,
    commands: &[&redis::Cmd],
    keys: &[NamedKey],
    source: redis::RedisError,
) -> TransportError {
    let codes = server_codes(&source);
    let has = |wanted: &str| codes.iter().any(|(_, code)| code == wanted);
    let fatal = |setting: &str, context: String, source: redis::RedisError| {
        TransportError::fatal(setting, context, Some(Box::new(source)))
    };
    if source.kind() == redis::ErrorKind::AuthenticationFailed || has("WRONGPASS") || has("NOAUTH")
    {
        return fatal(
            "REDIS_URL",
            format!(
                "Redis refused the credentials ({command}): check the user name and password in REDIS_URL"
            ),
            source,
        );
    }
    if has("NOPERM") {
        return fatal(
            "REDIS_URL",
            format!("the Redis user of REDIS_URL may not run {command} on these keys (ACL)"),
            source,
        );
    }
    if source.to_string().contains("refused to switch database") {
        return fatal(
            "REDIS_URL",
            "Redis refused the database number in REDIS_URL's path (redis://host:port/<db>)"
                .to_owned(),
            source,
        );
    }
    if has("WRONGTYPE") {
        return wrongtype(command, commands, keys, &codes, source);
    }
    TransportError::transient(format!("redis command {command} failed"), source)
}

/// A key of the wrong type: fatal naming the key (among `keys`, those the failed `commands`
/// use) and the setting that names it.
fn wrongtype(
    command: &'static str,
    commands: &[&redis::Cmd],
    keys: &[NamedKey],
    codes: &[(usize, String)],
    source: redis::RedisError,
) -> TransportError {
    let fatal = |setting: &str, context: String, source: redis::RedisError| {
        TransportError::fatal(setting, context, Some(Box::new(source)))
    };
    let failed: Vec<&redis::Cmd> = codes
        .iter()
        .filter(|(_, code)| code == "WRONGTYPE")
        .filter_map(|(index, _)| commands.get(*index).copied())
        .collect();
    let candidates = if failed.is_empty() {
        commands
    } else {
        &failed[..]
    };
    let named: Vec<&NamedKey> = keys
        .iter()
        .filter(|key| {
            candidates.iter().any(|cmd| {
                cmd.args_iter().any(
                    |arg| matches!(arg, redis::Arg::Simple(bytes) if bytes == key.key.as_bytes()),
                )
            })
        })
        .collect();
    match named.as_slice() {
        [key] => fatal(
            key.setting,
            format!(
                "Redis key `{}` holds another type than a {} (WRONGTYPE from {command}); \
                 delete or rename it, or choose another key",
                key.key, key.kind
            ),
            source,
        ),
        [first, ..] => {
            let list: Vec<String> = named
                .iter()
                .map(|key| format!("`{}` ({}, a {})", key.key, key.setting, key.kind))
                .collect();
            fatal(
                first.setting,
                format!(
                    "one of the Redis keys {} holds another type (WRONGTYPE from {command})",
                    list.join(", ")
                ),
                source,
            )
        }
        [] => fatal(
            "spec.source.redis",
            format!("a Redis key of {command} holds another type (WRONGTYPE)"),
            source,
        ),
    }
}

/// A failed dead-letter write: when the dead-letter key holds another type (WRONGTYPE, for
/// good), every one of the `letters` is refused ([`TransportError::dead_letters_refused`], the
/// error naming the key and its setting) and the pipeline keeps them in PostgreSQL instead;
/// any other failure is returned as it is.
pub fn refused_by_dead_letter_key(err: TransportError, letters: usize) -> TransportError {
    let wrongtype = std::error::Error::source(&err)
        .and_then(|source| source.downcast_ref::<redis::RedisError>())
        .is_some_and(|source| {
            server_codes(source)
                .iter()
                .any(|(_, code)| code == "WRONGTYPE")
        });
    if !wrongtype {
        return err;
    }
    TransportError::dead_letters_refused(
        (0..letters).collect(),
        "the dead-letter key refuses every letter",
        Some(Box::new(err)),
    )
}

/// [`classify_redis_error`] for a call on no named key.
pub fn redis_error(command: &'static str) -> impl FnOnce(redis::RedisError) -> TransportError {
    move |source| classify_redis_error(command, &[], &[], source)
}

/// Which part of a Redis URL the client could not parse, without repeating the URL (it may hold
/// the password).
fn url_problem(url: &str) -> String {
    const FORM: &str = "redis://[user[:password]@]host[:port][/db] (rediss:// for TLS)";
    let Some((scheme, rest)) = url.split_once("://") else {
        return format!("it is not a URL of the form {FORM}");
    };
    let plain = |s: &str| {
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    };
    if !matches!(
        scheme,
        "redis" | "rediss" | "valkey" | "valkeys" | "redis+unix" | "unix" | "valkey+unix"
    ) {
        return if plain(scheme) && scheme.len() <= 20 {
            format!("the scheme `{scheme}` is not redis, rediss or unix; expected {FORM}")
        } else {
            format!("the scheme is not redis, rediss or unix; expected {FORM}")
        };
    }
    if scheme.ends_with("unix") {
        return "the socket path is missing or invalid (unix:///path/to/redis.sock)".to_owned();
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host_port)| host_port);
    let (host, port) = match host_port.rsplit_once(':') {
        Some((host, port)) if !host_port.ends_with(']') => (host, Some(port)),
        _ => (host_port, None),
    };
    if host.is_empty() {
        return format!("the host is missing; expected {FORM}");
    }
    if let Some(port) = port
        && !(plain(port) && port.parse::<u16>().is_ok_and(|port| port > 0))
    {
        return if plain(port) && port.len() <= 10 {
            format!("the port `{port}` is not a number from 1 to 65535")
        } else {
            "the port is not a number from 1 to 65535 (a user name or password with `@`, `:` or `/` \
             must be percent-encoded)"
                .to_owned()
        };
    }
    "the user name or password holds characters that must be percent-encoded (`@`, `:`, `/`, `?`, `#`, `%`), \
     or the host is invalid"
        .to_owned()
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

/// Opens a client for `url`; a URL it cannot use is fatal, saying which part is wrong.
pub fn open(url: &str) -> Result<Client, TransportError> {
    Client::open(url).map_err(|source| {
        let problem = if source.to_string().contains("did not parse") {
            url_problem(url)
        } else {
            source.detail().map_or_else(
                || source.to_string(),
                |detail| format!("{source} ({detail})"),
            )
        };
        TransportError::fatal(
            "REDIS_URL",
            format!("the Redis URL is invalid: {problem}"),
            None,
        )
    })
}

/// A lazily (re)connected multiplexed connection. A failure other than an error reply from the
/// server drops it, so the next call reconnects.
#[derive(Debug)]
pub struct Connection {
    client: Client,
    response_timeout: Duration,
    slot: Option<MultiplexedConnection>,
    /// The keys this connection's commands use, named in WRONGTYPE errors.
    keys: Vec<NamedKey>,
    /// Where connections opened after the first are counted, if anywhere.
    reconnects: Option<Counter>,
    connected_before: bool,
}

impl Connection {
    /// The server's `host:port` (or socket path).
    pub fn endpoint(&self) -> String {
        self.client.get_connection_info().addr().to_string()
    }

    pub fn new(client: Client, response_timeout: Duration) -> Self {
        Self {
            client,
            response_timeout,
            slot: None,
            keys: Vec::new(),
            reconnects: None,
            connected_before: false,
        }
    }

    /// Counts in `reconnects` every connection opened after the first one (each follows the
    /// loss of the one before).
    #[must_use]
    pub fn counting_reconnects(mut self, reconnects: Counter) -> Self {
        self.reconnects = Some(reconnects);
        self
    }

    /// The keys its commands use and the settings that name them.
    #[must_use]
    pub fn naming(mut self, keys: Vec<NamedKey>) -> Self {
        self.keys = keys;
        self
    }

    async fn take(&mut self) -> Result<MultiplexedConnection, TransportError> {
        match self.slot.take() {
            Some(conn) => Ok(conn),
            None => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(self.response_timeout));
                let conn = self
                    .client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(redis_error("CONNECT"))?;
                if std::mem::replace(&mut self.connected_before, true)
                    && let Some(reconnects) = &self.reconnects
                {
                    reconnects.inc();
                }
                Ok(conn)
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
        result.map_err(|err| classify_redis_error(command, &[cmd], &self.keys, err))
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
        result.map_err(|err| {
            let commands: Vec<&redis::Cmd> = pipe.cmd_iter().collect();
            classify_redis_error(command, &commands, &self.keys, err)
        })
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

/// When a dead-letter record (list and pub/sub modes) was written (Unix ms): its `last_seen`.
pub fn record_time_ms(record: &[u8]) -> Option<u64> {
    let record: serde_json::Value = serde_json::from_slice(record).ok()?;
    let at = humantime::parse_rfc3339(record.get("last_seen")?.as_str()?).ok()?;
    u64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()
}

/// A dead letter as one JSON document (list and pub/sub modes): the body byte-for-byte (as
/// `body` when UTF-8, else `body_base64`), its context and its attempts.
pub fn dead_letter_record<R>(letter: &DeadLetter<'_, R>, origin: Origin<'_>) -> String {
    let message = letter.message;
    let context = DeadLetterContext::new(letter);
    // Not the context's `error` (cut to 2 KiB) nor its attempts as text: the record keeps the
    // whole error as `last_error`, a number of deliveries and the attempts as JSON.
    let mut record = serde_json::json!({
        "reason": context.reason,
        "last_error": letter.error,
        "delivery_count": context.delivery_count,
        "adapter": origin.adapter,
        "consumer": origin.consumer,
        "first_seen": context.first_seen,
        "last_seen": now_rfc3339(),
        "headers": serde_json::from_str::<serde_json::Value>(&fields_json(&message.headers))
            .unwrap_or_default(),
        "attempts": letter.attempts,
    });
    record[format!("origin_{}", origin.kind)] = origin.name.into();
    insert_body(&mut record, &message.body);
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

    /// The dead-letter record of `message` from the `kind` `name`, parsed.
    fn record_of(
        message: &Message<()>,
        reason: PoisonReason,
        error: &str,
        kind: &'static str,
        name: &str,
    ) -> serde_json::Value {
        let letter = DeadLetter {
            message,
            reason,
            error: error.to_owned(),
            attempts: crate::transport::Attempts::default(),
        };
        let origin = Origin {
            kind,
            name,
            adapter: "a/b",
            consumer: "c",
        };
        serde_json::from_str(&dead_letter_record(&letter, origin)).expect("json")
    }

    #[test]
    fn dead_letter_record_keeps_binary_bodies_losslessly() {
        let message = message(&[0xff, 0x00, 0x01]);
        let record = record_of(&message, PoisonReason::NotUtf8, "not UTF-8", "list", "jobs");
        assert_eq!(record["body_base64"], "/wAB");
        assert!(record.get("body").is_none());
        assert_eq!(record["origin_list"], "jobs");
        assert_eq!(record["reason"], "not_utf8");
        assert_eq!(record["delivery_count"], 2);
        assert_eq!(record["first_seen"], "1970-01-01T00:00:00.000Z");
        assert_eq!(record["headers"]["channel"], "orders");
    }

    #[test]
    fn dead_letter_record_keeps_its_field_names_and_value_types() {
        let mut message = message(b"{");
        message.enqueued_at_ms = None;
        let long_error = "x".repeat(3000);
        let record = record_of(
            &message,
            PoisonReason::InvalidJson,
            &long_error,
            "channel",
            "orders",
        );
        assert_eq!(record["last_error"], long_error.as_str());
        assert!(record.get("error").is_none());
        assert!(record["delivery_count"].is_u64());
        assert!(record["attempts"].is_object(), "{}", record["attempts"]);
        assert!(record["first_seen"].is_null());
        assert_eq!(record["origin_channel"], "orders");
    }

    #[test]
    fn url_problems_name_the_part_without_the_password() {
        for (url, part) in [
            ("mysql://u:hunter2@h:1/0", "scheme `mysql`"),
            ("redis://:hunter2@host:port/0", "port `port`"),
            ("redis://:hunter2@host:70000/0", "port `70000`"),
            ("host:6379", "not a URL"),
            ("redis://:hunter2@/0", "host is missing"),
        ] {
            let err = open(url).expect_err(url);
            let text = err.to_string();
            assert!(text.starts_with("REDIS_URL: "), "{text}");
            assert!(text.contains(part), "{url}: {text}");
            assert!(!text.contains("hunter2"), "{text}");
            assert!(err.is_fatal());
        }
    }
}
