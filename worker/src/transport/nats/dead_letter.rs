//! Dead letters as JetStream messages: the body byte-identical, the original headers kept
//! (except the server's `Nats-*` ones), the context as `Switchboard-*` headers.

use async_nats::HeaderMap;

use super::NatsDelivery;
use crate::payload::PoisonReason;
use crate::transport::{Attempts, rfc3339_ms, truncate};

/// The error text kept in `Switchboard-Error`.
const MAX_ERROR_BYTES: usize = 2048;

/// What every dead letter of one write shares.
#[derive(Debug, Clone, Copy)]
pub struct WriteContext<'a> {
    pub stream: &'a str,
    /// The stream's incarnation (`Incarnation::tag`).
    pub incarnation: &'a str,
    pub consumer: &'a str,
    /// RFC 3339, now.
    pub last_seen: &'a str,
}

/// A header value: one line (NATS headers cannot hold CR or LF), other control characters
/// replaced.
fn header_text(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The headers of `message`'s dead letter. `Nats-Msg-Id` is derived from the original's
/// position in its stream's incarnation, so the dead-letter stream drops a letter written twice
/// (a retried write) within its duplicate window, never the letter of a re-created stream's
/// message at the same sequence.
pub fn headers(
    message: &NatsDelivery,
    reason: PoisonReason,
    error: &str,
    attempts: &Attempts,
    context: WriteContext<'_>,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in &message.headers {
        if !name.starts_with("Nats-") {
            headers.append(name.as_str(), String::from_utf8_lossy(value).into_owned());
        }
    }
    let seq = message.receipt.stream_sequence;
    headers.insert(
        "Nats-Msg-Id",
        format!(
            "switchboard-dlq:{}:{}:{seq}",
            context.stream, context.incarnation
        ),
    );
    headers.insert("Switchboard-Reason", reason.as_str());
    headers.insert(
        "Switchboard-Error",
        header_text(&truncate(error, MAX_ERROR_BYTES)),
    );
    headers.insert(
        "Switchboard-Delivery-Count",
        message.delivery_count.to_string(),
    );
    headers.insert("Switchboard-Stream", context.stream);
    headers.insert("Switchboard-Stream-Seq", seq.to_string());
    headers.insert("Switchboard-Stream-Incarnation", context.incarnation);
    headers.insert(
        "Switchboard-Subject",
        header_text(message.receipt.subject.as_str()),
    );
    if let Some(first_seen) = message.enqueued_at_ms.map(rfc3339_ms) {
        headers.insert("Switchboard-First-Seen", first_seen);
    }
    headers.insert("Switchboard-Last-Seen", context.last_seen);
    headers.insert("Switchboard-Consumer", header_text(context.consumer));
    headers.insert("Switchboard-Attempts", header_text(&attempts.to_json()));
    if let Some((_, id)) = message
        .headers
        .iter()
        .find(|(name, _)| name == "Nats-Msg-Id")
    {
        headers.insert(
            "Switchboard-Original-Msg-Id",
            header_text(&String::from_utf8_lossy(id)),
        );
    }
    headers
}

/// The subject a dead letter goes to: `deadLetter.subject`, else `<stream>.dlq.<subject>`.
pub fn subject(configured: Option<&str>, stream: &str, original: &str) -> String {
    match configured {
        Some(subject) => subject.to_owned(),
        None => format!("{stream}.dlq.{original}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Message;
    use crate::transport::nats::Receipt;

    fn message() -> NatsDelivery {
        Message {
            receipt: Receipt {
                reply: "$JS.ACK.ORDERS.workers.3.17.17.0.0".into(),
                stream_sequence: 17,
                subject: "orders.eu".into(),
            },
            external_id: "ORDERS:17".into(),
            idempotency_key: "nats:shop/orders:ORDERS:17".into(),
            body: b"{broken".to_vec(),
            headers: vec![
                ("Nats-Msg-Id".into(), b"order-17".to_vec()),
                ("tenant".into(), b"acme".to_vec()),
            ],
            delivery_count: 3,
            enqueued_at_ms: Some(1_764_608_400_000),
            position: None,
            undecodable: None,
        }
    }

    #[test]
    fn dead_letter_headers_carry_the_context_and_a_stable_message_id() {
        let context = WriteContext {
            stream: "ORDERS",
            incarnation: "1764608400000000000",
            consumer: "worker-0",
            last_seen: "2026-12-01T17:00:00.000Z",
        };
        let error = format!("line one\r\nline two {}", "x".repeat(5000));
        let headers = headers(
            &message(),
            PoisonReason::InvalidJson,
            &error,
            &Attempts::default(),
            context,
        );
        let get = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(get("Switchboard-Reason").as_deref(), Some("invalid_json"));
        assert_eq!(get("Switchboard-Delivery-Count").as_deref(), Some("3"));
        assert_eq!(get("Switchboard-Stream").as_deref(), Some("ORDERS"));
        assert_eq!(get("Switchboard-Stream-Seq").as_deref(), Some("17"));
        assert_eq!(get("Switchboard-Subject").as_deref(), Some("orders.eu"));
        assert_eq!(
            get("Switchboard-First-Seen").as_deref(),
            Some("2025-12-01T17:00:00.000Z")
        );
        assert_eq!(
            get("Switchboard-Last-Seen").as_deref(),
            Some("2026-12-01T17:00:00.000Z")
        );
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some("switchboard-dlq:ORDERS:1764608400000000000:17")
        );
        assert_eq!(
            get("Switchboard-Original-Msg-Id").as_deref(),
            Some("order-17")
        );
        assert_eq!(get("tenant").as_deref(), Some("acme"));
        let kept = get("Switchboard-Error").expect("error");
        assert!(kept.len() <= MAX_ERROR_BYTES, "{}", kept.len());
        assert!(kept.starts_with("line one  line two"), "{kept}");
    }

    #[test]
    fn default_subject_is_under_the_stream_dlq_prefix() {
        assert_eq!(subject(None, "ORDERS", "orders.eu"), "ORDERS.dlq.orders.eu");
        assert_eq!(
            subject(Some("dead.orders"), "ORDERS", "orders.eu"),
            "dead.orders"
        );
    }
}
