//! `switchboard-worker dlq` for the gateway: the SQS dead-letter reader
//! ([`QueueReader`](crate::transport::sqs::reader::QueueReader)) over the gateway's calls, which
//! take any queue name. The dead-letter queue is the one `spec.source.gateway.deadLetter.queue`
//! names, as the gateway serves it; its letters are the ones `POST /dlq` wrote, with the SQS
//! transport's `x-dlq-*` attributes.
//!
//! - a page: one receive (`GET /`, at most 10, `waitTimeSeconds` 0, hidden for the reader's
//!   short hold) of the dead-letter queue; handed back with a change of visibility to 0
//!   (`PATCH /`);
//! - redrive: a send (`POST /`) of the body and the original attributes to the source queue,
//!   with the idempotency key attribute; once the gateway answered 200, a delete (`DELETE /`)
//!   of the letter;
//! - purge: a delete; count: the dead-letter queue's stats (`GET /stats`).
//!
//! Every call has a deadline ([`CALL_TIMEOUT`]). A token the gateway refuses (401 after a new
//! one) or a queue it does not allow the token (403) ends the command, naming the setting: an
//! operator's command does not wait for a grant to change.

use prometheus_client::registry::Registry;
use serde_json::json;
use switchboard_api::GatewaySource;

use super::calls::{CALL_TIMEOUT, Call, Gateway as Calls, Refused};
use super::connect::connect;
use super::decode::{Receive, convert};
use super::probe::stats;
use super::send::send;
use crate::transport::TransportError;
use crate::transport::reader::StoredLetter;
use crate::transport::sqs::reader::{LetterQueue, Received};

/// The setting that names the dead-letter queue.
const DEAD_LETTER_SETTING: &str = "spec.source.gateway.deadLetter.queue";

/// The dead-letter queue of a gateway adapter, and its source queue, through the gateway.
#[derive(Debug)]
pub struct GatewayLetters {
    source: Calls,
    letters: Calls,
    /// `gateway:{adapter}`: the scope of the source's idempotency keys.
    scope: String,
}

impl GatewayLetters {
    /// The adapter's queues through the gateway (no network yet); `None` when the spec names
    /// no dead-letter queue.
    pub fn new(spec: &GatewaySource, adapter: &str) -> Result<Option<Self>, TransportError> {
        let Some(dead_letter) = &spec.dead_letter else {
            return Ok(None);
        };
        let source = connect(spec, adapter, &mut Registry::default())?;
        Ok(Some(Self {
            letters: source.for_queue(&dead_letter.queue, DEAD_LETTER_SETTING),
            source,
            scope: format!("gateway:{adapter}"),
        }))
    }

    /// One call to the dead-letter queue.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        call: Call<'_>,
        query: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> Result<T, TransportError> {
        self.letters
            .call(call, query, body)
            .await
            .map_err(|err| for_good(err, DEAD_LETTER_SETTING))
    }

    /// A call about one letter's receipt handle (`DELETE /`, `PATCH /`).
    async fn receipt_call(
        &self,
        name: &'static str,
        method: &::http::Method,
        body: serde_json::Value,
    ) -> Result<(), TransportError> {
        let call = Call {
            name,
            method,
            path: "/",
            timeout: CALL_TIMEOUT,
        };
        self.call::<serde::de::IgnoredAny>(call, &[], Some(&body))
            .await
            .map(drop)
    }
}

/// `err`, fatal when the gateway refused the token (401, after a new one) or refused it the
/// queue of `setting` (403): the command ends, naming what to fix.
fn for_good(err: TransportError, setting: &'static str) -> TransportError {
    let status = std::error::Error::source(&err)
        .and_then(|source| source.downcast_ref::<Refused>())
        .map(|refused| refused.status);
    match status {
        Some(401) => TransportError::fatal("spec.source.gateway.auth", err.to_string(), None),
        Some(403) => TransportError::fatal(setting, err.to_string(), None),
        _ => err,
    }
}

impl LetterQueue for GatewayLetters {
    fn destination(&self) -> String {
        format!("gateway queue {}", self.letters.queue())
    }

    fn source(&self) -> String {
        format!("gateway queue {}", self.source.queue())
    }

    fn key_scope(&self) -> &str {
        &self.scope
    }

    /// The gateway transport writes `gateway queue {queue}`.
    fn origin(&self, written: &str) -> String {
        written.to_owned()
    }

    fn caveats(&self) -> Vec<String> {
        vec![
            "the gateway serves standard SQS queues, which keep no order: redriven letters are \
             delivered like new messages"
                .to_owned(),
        ]
    }

    async fn count(&self) -> Result<Option<u64>, TransportError> {
        let stats = stats(&self.letters)
            .await
            .map_err(|err| for_good(err, DEAD_LETTER_SETTING))?;
        Ok(stats
            .available_messages
            .map(|available| available + stats.in_flight_messages.unwrap_or(0)))
    }

    async fn receive(&self, max: usize, hold: i32) -> Result<Vec<Received>, TransportError> {
        let call = Call {
            name: "receive",
            method: &::http::Method::GET,
            path: "/",
            timeout: CALL_TIMEOUT,
        };
        let query = [
            ("maxNumberOfMessages", max.to_string()),
            ("waitTimeSeconds", "0".to_owned()),
            ("visibilityTimeoutSeconds", hold.to_string()),
        ];
        let answer: Receive = self.call(call, &query, None).await?;
        Ok(answer
            .messages
            .iter()
            .filter_map(|raw| convert(&self.scope, raw))
            .map(|message| Received {
                id: message.external_id,
                handle: message.receipt.handle,
                body: message.body,
                attributes: message.headers,
                sent_ms: message.enqueued_at_ms,
            })
            .collect())
    }

    async fn visibility(&self, handle: &str, seconds: i32) -> Result<(), TransportError> {
        let body = json!({"receiptHandle": handle, "visibilityTimeoutSeconds": seconds});
        self.receipt_call("change visibility", &::http::Method::PATCH, body)
            .await
    }

    async fn delete(&self, handle: &str) -> Result<(), TransportError> {
        let body = json!({"receiptHandle": handle});
        self.receipt_call("delete", &::http::Method::DELETE, body)
            .await
    }

    /// The gateway's attributes are text: an attribute value that is not UTF-8 (none the
    /// gateway delivered) is sent with its invalid bytes replaced.
    async fn send(
        &self,
        letter: &StoredLetter,
        attributes: Vec<(String, Vec<u8>)>,
        _key: &str,
    ) -> Result<(), TransportError> {
        let attributes = attributes
            .into_iter()
            .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned()));
        send(&self.source, &letter.body, attributes)
            .await
            .map(drop)
            .map_err(|err| for_good(err, "spec.source.gateway.queue"))
    }
}
