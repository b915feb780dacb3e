//! An SQS queue behind an HTTP gateway that takes JWT bearer tokens (seed 004): `GET /`
//! (receive) → (store) → `DELETE /` (delete), with the same semantics as the SQS transport.
//!
//! - **Calls** (`calls.rs`): every call carries `X-Service` (header and query) and
//!   `Authorization: Bearer <JWT>` from the token provider (`token.rs`: static, or OAuth2
//!   client credentials, cached and refreshed before expiry, one refresh at a time, a 401 on
//!   the current token → invalidate and retry once, on an older token → retry with the
//!   current one); the seed's error table decides what a refusal means; a
//!   circuit breaker (`breaker.rs`) stops calling a gateway that is overloaded or unreachable.
//!   TLS is always verified (the web roots, plus the CA of `spec.source.gateway.tls`, a file
//!   the operator mounts and names in `GATEWAY_CA_FILE`).
//! - **`prepare`** checks `GET /health`, then `GET /stats` of the queue: a missing queue is
//!   fatal (naming `spec.source.gateway.queue`), a refused token is not. A queue that goes
//!   missing later (deleted, maybe created again) is waited for, readiness false, and fatal
//!   only once it has been missing for 120 s.
//! - **Receive**: long polls of at most ten messages, a larger batch gathered from concurrent
//!   receives like the SQS transport's; bodies are base64; the key is
//!   `gateway:{adapter}:{messageId}` (the gateway passes SQS's MessageId, unique per send, so
//!   a re-created queue cannot re-use one); `receiveCount` is the delivery count (the pipeline
//!   dead-letters past `maxDeliveries`); attributes become headers. Each message of an answer
//!   is decoded on its own: one that does not follow the protocol (a body that is not base64,
//!   an attribute value that is not a string, no id) is delivered undecodable (poison, its
//!   JSON in the reason) and its neighbours are stored; one without a receipt handle is
//!   skipped (it comes back when its visibility expires). Only an answer whose envelope is not
//!   the protocol's fails the receive.
//! - **Acknowledge**: `DELETE /` per message, concurrently; 410 is a stale receipt.
//!   **Lease**: `PATCH /` (change visibility) to the visibility timeout.
//! - **Dead letters**: `POST /dlq` with the body unchanged (base64) and the SQS transport's
//!   `x-dlq-*` context as attributes; the original is deleted by the acknowledgement that
//!   follows, as for every broker. A letter the gateway refuses for what it carries (400, 413,
//!   422) is reported refused: the pipeline keeps it in PostgreSQL.
//! - **Queue health**: `GET /stats` (available, in flight, dead letters) and the age of the
//!   oldest message this worker holds.
//!
//! The gateway serves standard queues: there is no message group to keep in order.

mod breaker;
mod calls;
mod http;
mod token;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use futures::StreamExt as _;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{Value, json};
use switchboard_api::GatewaySource;
use switchboard_store::Dedup;

use self::breaker::CircuitBreaker;
use self::calls::{AuthCounters, CALL_TIMEOUT, Call, Gateway as Calls, LONG_POLL_MARGIN, Refused};
use self::http::{HttpClient, extra_ca};
use self::token::{TokenProvider, TokenSource};
use super::sqs::Receipt;
use super::sqs::dead_letter::{self, DEFAULT_MAX_MESSAGE_BYTES, WriteContext};
use super::sqs::delete_plan::BATCH_LIMIT;
use super::sqs::gather::gather;
use super::sqs::in_flight::InFlight;
use crate::health::now_ms;
use crate::metrics::{adapter_counter, adapter_gauge};
use crate::transport::{
    Acked, DeadLetter, ErrorKind, Message, QueueHealth, QueueProbe, Transport, TransportError,
};

/// The visibility timeout receives ask for when the spec does not say.
const DEFAULT_VISIBILITY_SECONDS: u32 = 30;
/// How often `maintain` (a stats call) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// Calls of one acknowledgement, lease extension or dead-letter write in flight at once.
const CONCURRENT_CALLS: usize = 16;

/// A message delivered through the gateway: an SQS message, its receipt handle without group.
pub type GatewayDelivery = Message<Receipt>;

/// Everything the gateway transport needs to know.
#[derive(Debug, Clone)]
pub struct GatewaySettings {
    /// `namespace/name` of the adapter.
    pub adapter: String,
    /// The pod name, recorded in dead letters.
    pub consumer: String,
    pub spec: GatewaySource,
}

/// The protocol's answer to a receive. Each message is decoded on its own (see [`convert`]):
/// one that does not follow the protocol is that message's poison, never the whole receive's.
#[derive(Debug, Deserialize)]
struct Receive {
    #[serde(default)]
    messages: Vec<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stats {
    #[serde(default)]
    available_messages: Option<u64>,
    #[serde(default)]
    in_flight_messages: Option<u64>,
    #[serde(default)]
    dead_letter_messages: Option<u64>,
}

/// How much of an undecodable message's JSON its dead letter's error quotes.
const MAX_QUOTED_JSON: usize = 1024;

/// Converts one message of `source` (`gateway:{adapter}`), as the protocol says it is:
/// `{messageId, receiptHandle, body (base64), attributes: {values: {name: text}},
/// receiveCount, sentTimestamp}`. `None` without a receipt handle (it can be neither
/// acknowledged nor dead-lettered; it comes back when its visibility expires). Whatever else
/// does not follow the protocol (a body that is not base64, an attribute value that is not a
/// string, a count that is not a number) makes the message undecodable: it is dead-lettered
/// with what could be read of it (the body decoded if it was base64, else as it came; each
/// attribute's value as the text it came as) and its JSON in the reason.
fn convert(source: &str, raw: &Value) -> Option<GatewayDelivery> {
    let handle = raw
        .get("receiptHandle")
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())?
        .to_owned();
    let mut problems = Vec::new();
    let body = match raw.get("body") {
        Some(Value::String(text)) => match STANDARD.decode(text) {
            Ok(body) => body,
            Err(err) => {
                problems.push(format!("a body that is not base64 ({err})"));
                text.clone().into_bytes()
            }
        },
        None | Some(Value::Null) => {
            problems.push("no body".to_owned());
            Vec::new()
        }
        Some(other) => {
            problems.push(format!("a body that is {}, not a string", kind(other)));
            other.to_string().into_bytes()
        }
    };
    let external_id = match raw.get("messageId") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        other => {
            problems.push(match other {
                None | Some(Value::Null) | Some(Value::String(_)) => "no messageId".to_owned(),
                Some(other) => format!("a messageId that is {}, not a string", kind(other)),
            });
            format!(
                "sha256:{}",
                hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body))
            )
        }
    };
    let headers = attributes(raw.get("attributes"), &mut problems);
    let mut count = |name: &str| match raw.get(name) {
        None | Some(Value::Null) => None,
        Some(value) => {
            let number = value.as_u64();
            if number.is_none() {
                problems.push(format!("a {name} that is not a count ({value})"));
            }
            number
        }
    };
    let delivery_count = count("receiveCount").unwrap_or(1).max(1);
    let enqueued_at_ms = count("sentTimestamp");
    let undecodable = (!problems.is_empty()).then(|| {
        // The receipt handle is a credential for the message: never quoted.
        let mut quoted = raw.clone();
        if let Some(fields) = quoted.as_object_mut() {
            fields.remove("receiptHandle");
        }
        format!(
            "the gateway's message does not follow the protocol: it has {}: {}",
            problems.join(" and "),
            crate::transport::truncate(&quoted.to_string(), MAX_QUOTED_JSON)
        )
    });
    Some(Message {
        receipt: Receipt {
            handle,
            group: None,
        },
        idempotency_key: format!("{source}:{external_id}"),
        external_id,
        body,
        headers,
        delivery_count,
        enqueued_at_ms,
        position: None,
        undecodable,
    })
}

/// The headers of a message's `attributes` (`{values: {name: text}}`): each value's text, or
/// for a value that is not a string (a problem) the JSON it came as.
fn attributes(raw: Option<&Value>, problems: &mut Vec<String>) -> Vec<(String, Vec<u8>)> {
    let values = match raw {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Object(attributes)) => match attributes.get("values") {
            None | Some(Value::Null) => return Vec::new(),
            Some(Value::Object(values)) => values,
            Some(other) => {
                problems.push(format!("attributes.values that is {}", kind(other)));
                return Vec::new();
            }
        },
        Some(other) => {
            problems.push(format!("attributes that are {}", kind(other)));
            return Vec::new();
        }
    };
    values
        .iter()
        .map(|(name, value)| {
            let text = match value {
                Value::String(text) => text.clone(),
                other => {
                    problems.push(format!(
                        "attribute {name:?} whose value is {} ({other}), not a string",
                        kind(other)
                    ));
                    other.to_string()
                }
            };
            (name.clone(), text.into_bytes())
        })
        .collect()
}

/// What a JSON value is, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The calls, the token provider and the circuit breaker of one adapter's gateway.
pub fn connect(
    spec: &GatewaySource,
    adapter: &str,
    registry: &mut Registry,
) -> Result<Calls, TransportError> {
    let http = HttpClient::new(extra_ca(spec.tls.is_some())?.as_deref())?;
    let source = TokenSource::from_spec(&spec.auth)?;
    let tokens = TokenProvider::new(
        source,
        http.clone(),
        adapter_counter(
            registry,
            "gateway_token_requests",
            "Requests to the OAuth2 token endpoint",
            adapter,
        ),
        adapter_counter(
            registry,
            "gateway_token_refreshes_forced",
            "Token requests made because the gateway refused the current token (401)",
            adapter,
        ),
    );
    let breaker = CircuitBreaker::new(
        adapter_gauge(
            registry,
            "gateway_circuit_state",
            "The gateway's circuit breaker: 0 closed, 1 open, 2 half-open",
            adapter,
        ),
        adapter_counter(
            registry,
            "gateway_circuit_opened",
            "Times the gateway's circuit breaker opened",
            adapter,
        ),
    );
    Ok(Calls::new(
        spec,
        http,
        Arc::new(tokens),
        Arc::new(breaker),
        AuthCounters {
            unauthorized: adapter_counter(
                registry,
                "gateway_unauthorized",
                "Gateway answers 401 (each followed by a retry, unless it is an auth failure)",
                adapter,
            ),
            failures: adapter_counter(
                registry,
                "gateway_auth_failures",
                "Gateway calls that failed with 401 after their retry with a new token",
                adapter,
            ),
        },
    ))
}

/// The protocol's answer to a send.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Sent {
    message_id: String,
}

/// Sends one message to the adapter's queue (the seed's `send_chunk`): the body base64,
/// `attributes` with the spec's `project`. Returns its messageId.
pub async fn send_message(
    spec: &GatewaySource,
    adapter: &str,
    body: &[u8],
    attributes: &[(String, String)],
) -> Result<String, TransportError> {
    let calls = connect(spec, adapter, &mut Registry::default())?;
    let mut values = serde_json::Map::new();
    if let Some(project) = calls.project() {
        values.insert("project".into(), project.into());
    }
    for (name, value) in attributes {
        values.insert(name.clone(), value.clone().into());
    }
    let request = json!({
        "messageBody": STANDARD.encode(body),
        "messageAttributes": {"values": values},
        "delaySeconds": 0,
    });
    let call = Call {
        name: "send",
        method: &::http::Method::POST,
        path: "/",
        timeout: CALL_TIMEOUT,
    };
    let sent: Sent = calls.call(call, &[], Some(&request)).await?;
    Ok(sent.message_id)
}

/// The gateway transport.
#[derive(Debug)]
pub struct GatewayTransport {
    settings: GatewaySettings,
    source: String,
    calls: Calls,
    held: InFlight,
}

impl GatewayTransport {
    /// Builds the client and the token provider (no network yet). Fails fatally when a secret
    /// the auth needs is not in the environment, or the CA is not PEM.
    pub fn new(settings: GatewaySettings, registry: &mut Registry) -> Result<Self, TransportError> {
        let calls = connect(&settings.spec, &settings.adapter, registry)?;
        Ok(Self {
            source: format!("gateway:{}", settings.adapter),
            settings,
            calls,
            held: InFlight::default(),
        })
    }

    fn visibility_seconds(&self) -> u32 {
        self.settings
            .spec
            .visibility_timeout_seconds
            .unwrap_or(DEFAULT_VISIBILITY_SECONDS)
    }

    /// One receive of up to `count` messages, waiting up to `wait` seconds.
    async fn receive_once(&self, count: usize, wait: u32) -> Result<Vec<Value>, TransportError> {
        let mut query = vec![
            (
                "maxNumberOfMessages",
                count.clamp(1, BATCH_LIMIT).to_string(),
            ),
            ("waitTimeSeconds", wait.to_string()),
            (
                "visibilityTimeoutSeconds",
                self.visibility_seconds().to_string(),
            ),
        ];
        if let Some(project) = self.calls.project() {
            query.push(("project", project.to_owned()));
        }
        let call = Call {
            name: "receive",
            method: &::http::Method::GET,
            path: "/",
            timeout: Duration::from_secs(u64::from(wait)) + LONG_POLL_MARGIN,
        };
        let answer: Receive = self.calls.call(call, &query, None).await?;
        Ok(answer.messages)
    }

    /// `call` of the protocol once per body, [`CONCURRENT_CALLS`] at a time; the outcomes in
    /// the order of `bodies`.
    async fn call_each(
        &self,
        call: Call<'_>,
        bodies: Vec<serde_json::Value>,
    ) -> Vec<Result<(), TransportError>> {
        futures::stream::iter(bodies.into_iter().map(|body| async move {
            self.calls
                .call::<serde::de::IgnoredAny>(call, &[], Some(&body))
                .await
                .map(drop)
        }))
        .buffered(CONCURRENT_CALLS)
        .collect()
        .await
    }
}

impl Transport for GatewayTransport {
    type Receipt = Receipt;
    type Probe = GatewayProbe;

    fn source(&self) -> &str {
        &self.source
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    async fn prepare(&mut self) -> Result<(), TransportError> {
        let health = Call {
            name: "health",
            method: &::http::Method::GET,
            path: "/health",
            timeout: CALL_TIMEOUT,
        };
        self.calls
            .call::<serde::de::IgnoredAny>(health, &[], None)
            .await?;
        let stats = stats(&self.calls).await?;
        tracing::info!(
            queue = self.calls.queue(),
            service = self.calls.service(),
            available = stats.available_messages,
            visibility_seconds = self.visibility_seconds(),
            "gateway queue ready"
        );
        self.calls.queue_found();
        Ok(())
    }

    async fn receive(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<GatewayDelivery>, TransportError> {
        let wait = if block {
            self.settings.spec.wait_time_seconds
        } else {
            0
        };
        let raw = gather(max, block, wait, |count, wait| {
            self.receive_once(count, wait)
        })
        .await?;
        let received = raw.len();
        let messages: Vec<GatewayDelivery> = raw
            .into_iter()
            .filter_map(|message| convert(&self.source, &message))
            .collect();
        if messages.len() < received {
            tracing::warn!(
                count = received - messages.len(),
                "the gateway delivered messages without a receipt handle; skipped (they return when their visibility expires)"
            );
        }
        if let Some(lease) = self.lease() {
            self.held.received(&messages, lease);
        }
        Ok(messages)
    }

    async fn write_dead_letters(
        &mut self,
        letters: &[DeadLetter<'_, Receipt>],
    ) -> Result<(), TransportError> {
        if letters.is_empty() {
            return Ok(());
        }
        let last_seen = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        let origin = format!("gateway queue {}", self.calls.queue());
        let context = WriteContext {
            origin: &origin,
            consumer: &self.settings.consumer,
            last_seen: &last_seen,
            fifo: false,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        };
        let call = Call {
            name: "send to DLQ",
            method: &::http::Method::POST,
            path: "/dlq",
            timeout: CALL_TIMEOUT,
        };
        let bodies = letters
            .iter()
            .map(|letter| {
                let message = letter.message;
                let built = dead_letter::letter(
                    message,
                    letter.reason,
                    &letter.error,
                    &letter.attempts,
                    context,
                );
                let values: serde_json::Map<String, serde_json::Value> = built
                    .attributes
                    .into_iter()
                    .map(|(name, _, value)| (name.to_owned(), value.into()))
                    .collect();
                json!({
                    "messageId": message.external_id,
                    "receiptHandle": message.receipt.handle,
                    "reason": letter.reason.as_str(),
                    "messageBody": STANDARD.encode(&message.body),
                    "messageAttributes": {"values": values},
                })
            })
            .collect();
        let results = self.call_each(call, bodies).await;
        let mut refused = Vec::new();
        let mut first_refusal = None;
        for (index, result) in results.into_iter().enumerate() {
            match result {
                Ok(()) => {}
                Err(err) if refused_for_good(&err) => {
                    refused.push(index);
                    first_refusal.get_or_insert(err);
                }
                // The pipeline writes them all again: a duplicate dead letter is acceptable,
                // a lost one is not.
                Err(err) => return Err(err),
            }
        }
        match first_refusal {
            None => Ok(()),
            Some(err) => Err(TransportError::dead_letters_refused(
                refused,
                "the gateway refused dead letters for good (it answered that the request itself is wrong: HTTP 400, 413 or 422)",
                Some(Box::new(err)),
            )),
        }
    }

    async fn ack(&mut self, messages: &[&GatewayDelivery]) -> Result<Acked, TransportError> {
        let call = Call {
            name: "delete",
            method: &::http::Method::DELETE,
            path: "/",
            timeout: CALL_TIMEOUT,
        };
        let bodies = messages
            .iter()
            .map(|message| json!({"receiptHandle": message.receipt.handle}))
            .collect();
        let results = self.call_each(call, bodies).await;
        let mut acked = Acked::all();
        let mut outage = None;
        for (index, result) in results.into_iter().enumerate() {
            match result {
                Ok(()) => {}
                Err(err) if err.is_fatal() => return Err(err),
                Err(err) if err.kind() == &ErrorKind::StaleReceipt => acked.stale.push(index),
                Err(err) => {
                    acked.retry.push(index);
                    outage.get_or_insert(err);
                }
            }
        }
        // Nothing taken at all: an outage, reported as such (the pipeline backs off).
        if let Some(err) = outage
            && acked.retry.len() == messages.len()
        {
            return Err(err);
        }
        self.held.settled(
            messages
                .iter()
                .enumerate()
                .filter(|(index, _)| !acked.retry.contains(index))
                .map(|(_, message)| message.external_id.as_str()),
        );
        Ok(acked)
    }

    fn lease(&self) -> Option<Duration> {
        Some(Duration::from_secs(u64::from(self.visibility_seconds())))
    }

    async fn extend_lease(&mut self, messages: &[&GatewayDelivery]) -> Result<(), TransportError> {
        let seconds = self.visibility_seconds();
        let call = Call {
            name: "change visibility",
            method: &::http::Method::PATCH,
            path: "/",
            timeout: CALL_TIMEOUT,
        };
        let bodies = messages
            .iter()
            .map(|message| {
                json!({"receiptHandle": message.receipt.handle, "visibilityTimeoutSeconds": seconds})
            })
            .collect();
        let results = self.call_each(call, bodies).await;
        for result in results {
            match result {
                // The message went back to the queue: it is redelivered and deduplicated.
                Err(err) if err.kind() == &ErrorKind::StaleReceipt => {}
                other => other?,
            }
        }
        if let Some(lease) = self.lease() {
            self.held.extended(messages, lease);
        }
        Ok(())
    }

    /// Checks the queue through the gateway (`GET /stats`): a gateway that refuses the token
    /// (403) keeps the worker degraded between batches too.
    async fn maintain(&mut self) -> Result<(), TransportError> {
        stats(&self.calls).await.map(drop)
    }

    fn maintenance_interval(&self) -> Duration {
        MAINTENANCE_INTERVAL
    }

    fn probe(&self) -> GatewayProbe {
        GatewayProbe {
            calls: self.calls.clone(),
            held: self.held.clone(),
        }
    }
}

/// Whether the gateway refused a call for what the request carries (400, 413, 422): sending it
/// again can never succeed.
fn refused_for_good(err: &TransportError) -> bool {
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<Refused>())
        .is_some_and(|refused| matches!(refused.status, 400 | 413 | 422))
}

/// `GET /stats` of the queue.
async fn stats(calls: &Calls) -> Result<Stats, TransportError> {
    let call = Call {
        name: "stats",
        method: &::http::Method::GET,
        path: "/stats",
        timeout: CALL_TIMEOUT,
    };
    let query: Vec<(&str, String)> = calls
        .project()
        .map(|project| ("project", project.to_owned()))
        .into_iter()
        .collect();
    calls.call(call, &query, None).await
}

/// Reads the queue's stats through the same gateway client (its tokens and circuit breaker).
#[derive(Debug, Clone)]
pub struct GatewayProbe {
    calls: Calls,
    held: InFlight,
}

impl QueueProbe for GatewayProbe {
    /// Backlog = `availableMessages`, pending = `inFlightMessages`, dead letters =
    /// `deadLetterMessages`; the oldest pending age is that of the oldest message this worker
    /// holds (the gateway's stats give only an average delay).
    async fn queue_health(&mut self) -> Result<QueueHealth, TransportError> {
        let stats = stats(&self.calls).await?;
        Ok(QueueHealth {
            backlog: stats.available_messages,
            pending: stats.in_flight_messages,
            oldest_pending_age: Some(self.held.oldest_age(now_ms())),
            dead_letters: stats.dead_letter_messages,
            oldest_dead_letter_age: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "gateway:shop/orders";

    #[test]
    fn gateway_message_becomes_a_message_with_its_attributes_as_headers() {
        let message = convert(
            SOURCE,
            &json!({
                "messageId": "d9f94e63",
                "receiptHandle": "AQEBxxxx",
                "body": STANDARD.encode(b"{\"id\":1}"),
                "attributes": {"values": {"project": "p", "chunk_id": "550e8400"}},
                "receiveCount": 3,
                "sentTimestamp": 1_700_000_000_123u64,
            }),
        )
        .expect("delivered");
        assert_eq!(message.idempotency_key, "gateway:shop/orders:d9f94e63");
        assert_eq!(message.body, b"{\"id\":1}");
        assert_eq!(message.delivery_count, 3);
        assert_eq!(message.enqueued_at_ms, Some(1_700_000_000_123));
        assert_eq!(message.undecodable, None);
        assert_eq!(message.receipt.handle, "AQEBxxxx");
        assert_eq!(
            message.headers,
            vec![
                ("chunk_id".to_owned(), b"550e8400".to_vec()),
                ("project".to_owned(), b"p".to_vec())
            ]
        );
    }

    #[test]
    fn a_body_that_is_not_base64_is_poison_and_no_receipt_is_skipped() {
        let message = convert(
            SOURCE,
            &json!({"messageId": "m1", "receiptHandle": "h", "body": "not base64!"}),
        )
        .expect("delivered");
        assert!(
            message
                .undecodable
                .as_deref()
                .is_some_and(|why| why.contains("not base64")),
            "{:?}",
            message.undecodable
        );
        assert_eq!(message.body, b"not base64!", "kept as it came");
        assert_eq!(message.delivery_count, 1);
        assert!(convert(SOURCE, &json!({"messageId": "m2", "body": ""})).is_none());
    }

    #[test]
    fn an_attribute_that_is_not_a_string_makes_only_its_message_undecodable() {
        let answer: Receive = serde_json::from_value(json!({"messages": [
            {"messageId": "good", "receiptHandle": "h1", "body": STANDARD.encode("{}"),
             "attributes": {"values": {"kind": "order"}}},
            {"messageId": "odd", "receiptHandle": "h2", "body": STANDARD.encode("{\"odd\":1}"),
             "attributes": {"values": {"kind": "order", "n": 5}}, "receiveCount": 1},
        ]}))
        .expect("the envelope decodes whatever its messages hold");
        let messages: Vec<GatewayDelivery> = answer
            .messages
            .iter()
            .filter_map(|raw| convert(SOURCE, raw))
            .collect();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].undecodable, None);
        let odd = &messages[1];
        let why = odd.undecodable.as_deref().expect("undecodable");
        assert!(
            why.contains("attribute \"n\" whose value is a number (5)"),
            "{why}"
        );
        assert!(
            why.contains(r#""n":5"#),
            "the message's JSON is quoted: {why}"
        );
        assert!(!why.contains("h2"), "without its receipt handle: {why}");
        assert_eq!(odd.body, b"{\"odd\":1}", "the body decoded, byte-identical");
        assert_eq!(odd.external_id, "odd");
        assert!(odd.headers.contains(&("n".to_owned(), b"5".to_vec())));
    }

    #[test]
    fn fields_of_the_wrong_type_are_problems_of_their_message() {
        for raw in [
            json!({"messageId": 7, "receiptHandle": "h", "body": ""}),
            json!({"messageId": "m", "receiptHandle": "h", "body": 5}),
            json!({"messageId": "m", "receiptHandle": "h", "body": "", "receiveCount": "2"}),
            json!({"messageId": "m", "receiptHandle": "h", "body": "", "attributes": []}),
            json!({"messageId": "m", "receiptHandle": "h", "body": "", "attributes": {"values": "x"}}),
        ] {
            let message = convert(SOURCE, &raw).expect("delivered");
            assert!(message.undecodable.is_some(), "{raw}");
        }
        assert!(convert(SOURCE, &json!({"receiptHandle": 5})).is_none());
        assert!(convert(SOURCE, &json!("not an object")).is_none());
    }
}
