//! Dead letters through the gateway: `POST /dlq` with the body unchanged (base64) and the SQS
//! transport's `x-dlq-*` context as attributes. A letter the gateway refuses for what it
//! carries (400, 413, 422) is handed back refused: the pipeline keeps it in PostgreSQL.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Value, json};

use super::GatewayTransport;
use super::calls::{CALL_TIMEOUT, Call, Refused};
use crate::transport::sqs::Receipt;
use crate::transport::sqs::dead_letter::{self, DEFAULT_MAX_MESSAGE_BYTES, WriteContext};
use crate::transport::{DeadLetter, TransportError};

/// Whether the gateway refused a call for what the request carries (400, 413, 422): sending it
/// again can never succeed.
fn refused_for_good(err: &TransportError) -> bool {
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<Refused>())
        .is_some_and(|refused| matches!(refused.status, 400 | 413 | 422))
}

/// The request body of `letter`'s dead letter.
fn request(letter: &DeadLetter<'_, Receipt>, context: WriteContext<'_>) -> Value {
    let message = letter.message;
    let values: serde_json::Map<String, Value> = dead_letter::letter(letter, context)
        .attributes
        .into_iter()
        .map(|(name, _, value)| (name, value.into()))
        .collect();
    json!({
        "messageId": message.external_id,
        "receiptHandle": message.receipt.handle,
        "reason": letter.reason.as_str(),
        "messageBody": STANDARD.encode(&message.body),
        "messageAttributes": {"values": values},
    })
}

impl GatewayTransport {
    /// Sends `letters` to the queue's dead letters; those the gateway refuses for good are
    /// handed back once every other one is written.
    pub(super) async fn write_letters(
        &self,
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
            .map(|letter| request(letter, context))
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
}
