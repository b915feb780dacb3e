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
//!   422) is reported refused: the pipeline keeps it in PostgreSQL. `switchboard-worker dlq`
//!   reads the dead-letter queue with the same calls, by the name
//!   `spec.source.gateway.deadLetter.queue` gives (`reader.rs`); without it, it cannot
//!   ([`DEAD_LETTER_QUEUE_UNSET`]).
//! - **Queue health**: `GET /stats` (available, in flight, dead letters) and the age of the
//!   oldest message this worker holds.
//!
//! The gateway serves standard queues: there is no message group to keep in order.

mod breaker;
mod calls;
mod connect;
mod dead_letter;
mod decode;
mod http;
mod probe;
mod reader;
mod send;
mod token;

use std::time::Duration;

use futures::StreamExt as _;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use switchboard_api::GatewaySource;
use switchboard_store::Dedup;

use self::calls::{CALL_TIMEOUT, Call, Gateway as Calls, LONG_POLL_MARGIN};
pub use self::connect::connect;
use self::decode::{Receive, convert};
pub use self::probe::GatewayProbe;
use self::probe::stats;
pub use self::reader::GatewayLetters;
pub use self::send::send_message;
use super::sqs::Receipt;
use super::sqs::delete_plan::BATCH_LIMIT;
use super::sqs::gather::gather;
use super::sqs::in_flight::InFlight;
use crate::transport::{Acked, DeadLetter, ErrorKind, Message, Transport, TransportError};

/// The visibility timeout receives ask for when the spec does not say.
const DEFAULT_VISIBILITY_SECONDS: u32 = 30;
/// How often `maintain` (a stats call) and the queue-health probe run.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// Calls of one acknowledgement, lease extension or dead-letter write in flight at once.
const CONCURRENT_CALLS: usize = 16;

/// Why `switchboard-worker dlq` cannot read the gateway's dead letters without
/// `spec.source.gateway.deadLetter.queue`, and what to do.
pub const DEAD_LETTER_QUEUE_UNSET: &str = "spec.source.gateway.deadLetter.queue is not set: \
    `switchboard-worker dlq` reads the gateway's dead-letter queue through the gateway by the \
    name the gateway serves it under (`POST /dlq` writes the letters there; `GET /stats` counts \
    them as `deadLetterMessages`, the switchboard_dead_letter_messages gauge). Set it (for \
    example `orders-dlq`; ask the gateway's operators) to list, show, redrive and purge them. \
    Until then `switchboard-worker dlq` reads only the letters the gateway refused, kept in \
    PostgreSQL (DATABASE_URL set)";

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

    fn endpoint(&self) -> String {
        crate::transport::endpoint::endpoints(&self.settings.spec.url)
    }

    fn dedup(&self) -> Dedup {
        Dedup::NativeId
    }

    fn stable_enqueue_time(&self) -> bool {
        true
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
        self.write_letters(letters).await
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
        self.new_probe()
    }
}
