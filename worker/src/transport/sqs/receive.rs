//! From SQS's `Message` to the pipeline's [`Message`], and the FIFO rule at receive time.

use std::collections::HashSet;
use std::fmt;

use aws_sdk_sqs::types::{Message as SqsMessage, MessageSystemAttributeName};

use crate::transport::Message;
use crate::transport::identity::{body_hash, body_id, idempotency_key};

/// What SQS needs to delete (or extend) one delivery, and what FIFO ordering needs.
#[derive(Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The receipt handle of this delivery (never logged).
    pub handle: String,
    /// The `MessageGroupId`, on a FIFO queue only (a standard queue's group, if the sender
    /// set one, orders nothing).
    pub group: Option<String>,
}

impl fmt::Debug for Receipt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receipt")
            .field("handle", &format_args!("<{} bytes>", self.handle.len()))
            .field("group", &self.group)
            .finish()
    }
}

pub type SqsDelivery = Message<Receipt>;

/// System attributes that describe one delivery rather than the message: not copied into
/// the headers (the delivery count is [`Message::delivery_count`]).
fn is_delivery_attribute(name: &MessageSystemAttributeName) -> bool {
    matches!(
        name,
        MessageSystemAttributeName::ApproximateReceiveCount
            | MessageSystemAttributeName::ApproximateFirstReceiveTimestamp
    )
}

/// One received SQS message, converted.
#[derive(Debug)]
pub enum Received {
    /// Deliverable to the pipeline (possibly as undecodable poison).
    Message(SqsDelivery),
    /// No receipt handle: it can be neither stored-then-deleted nor dead-lettered. Skipped; SQS
    /// redelivers it when its visibility timeout expires.
    NoReceipt {
        message_id: Option<String>,
        group: Option<String>,
    },
}

/// Converts one message of `source` (`sqs:{adapter}`). `fifo` says whether the queue is a
/// FIFO queue (the receipt then carries the `MessageGroupId`).
pub fn convert(source: &str, fifo: bool, raw: SqsMessage) -> Received {
    let SqsMessage {
        message_id,
        receipt_handle,
        body,
        attributes,
        message_attributes,
        ..
    } = raw;
    let system = attributes.unwrap_or_default();
    let group = fifo
        .then(|| {
            system
                .get(&MessageSystemAttributeName::MessageGroupId)
                .cloned()
        })
        .flatten();
    let Some(handle) = receipt_handle.filter(|h| !h.is_empty()) else {
        return Received::NoReceipt { message_id, group };
    };

    let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
    let mut user: Vec<_> = message_attributes.unwrap_or_default().into_iter().collect();
    user.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, value) in user {
        let bytes = match (value.string_value, value.binary_value) {
            (Some(text), _) => text.into_bytes(),
            (None, Some(blob)) => blob.into_inner(),
            // List values are reserved by SQS and never sent; nothing to keep.
            (None, None) => continue,
        };
        headers.push((name, bytes));
    }
    super::reader::unpack_redriven(&mut headers);
    let mut described: Vec<_> = system
        .iter()
        .filter(|(name, _)| !is_delivery_attribute(name))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    described.sort_by(|a, b| a.0.cmp(&b.0));
    headers.extend(described);

    let delivery_count = system
        .get(&MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|count| count.parse::<u64>().ok())
        .unwrap_or(1)
        .max(1);
    let enqueued_at_ms = system
        .get(&MessageSystemAttributeName::SentTimestamp)
        .and_then(|sent| sent.parse::<u64>().ok());

    let mut problems = Vec::new();
    if message_id.as_deref().is_none_or(str::is_empty) {
        problems.push("no MessageId");
    }
    if body.is_none() {
        problems.push("no Body");
    }
    let body = body.map(String::into_bytes).unwrap_or_default();
    let external_id = match message_id.filter(|id| !id.is_empty()) {
        Some(id) => id,
        // Never stored (it is dead-lettered as undecodable); an id for the logs and the
        // dead letter only.
        None => body_id(&body_hash(&body)),
    };
    let undecodable =
        (!problems.is_empty()).then(|| format!("the SQS message has {}", problems.join(" and ")));
    Received::Message(Message {
        receipt: Receipt { handle, group },
        idempotency_key: idempotency_key(source, &external_id),
        external_id,
        body,
        headers,
        delivery_count,
        enqueued_at_ms,
        position: None,
        undecodable,
    })
}

/// The outcome of one receive after the FIFO rule.
#[derive(Debug, Default)]
pub struct Sorted {
    /// Delivered to the pipeline, in receive order.
    pub messages: Vec<SqsDelivery>,
    /// FIFO messages behind a skipped message of their group: made visible again (not
    /// stored out of order), in receive order.
    pub released: Vec<Receipt>,
    /// Messages without a receipt handle (their ids, if any), skipped.
    pub skipped: Vec<Option<String>>,
}

/// Applies the FIFO rule at receive time: once a message of a group is skipped (it has no
/// receipt handle, so it comes back only when its visibility expires), the group's later
/// messages of this receive are released instead of being stored before it. Messages
/// without a group (a standard queue) are independent of each other.
pub fn sort_received(received: Vec<Received>) -> Sorted {
    let mut sorted = Sorted::default();
    let mut broken: HashSet<String> = HashSet::new();
    for item in received {
        match item {
            Received::NoReceipt { message_id, group } => {
                if let Some(group) = group {
                    broken.insert(group);
                }
                sorted.skipped.push(message_id);
            }
            Received::Message(message) => match &message.receipt.group {
                Some(group) if broken.contains(group) => sorted.released.push(message.receipt),
                _ => sorted.messages.push(message),
            },
        }
    }
    sorted
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::primitives::Blob;
    use aws_sdk_sqs::types::MessageAttributeValue;

    const SOURCE: &str = "sqs:shop/orders";

    fn attribute(data_type: &str, text: &str) -> MessageAttributeValue {
        MessageAttributeValue::builder()
            .data_type(data_type)
            .string_value(text)
            .build()
            .expect("attribute")
    }

    fn fifo_message(id: &str, group: &str) -> SqsMessage {
        SqsMessage::builder()
            .message_id(id)
            .receipt_handle(format!("handle-{id}"))
            .body("{}")
            .attributes(MessageSystemAttributeName::MessageGroupId, group)
            .build()
    }

    fn delivered(received: Received) -> SqsDelivery {
        match received {
            Received::Message(message) => message,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    #[test]
    fn sqs_message_becomes_a_message_with_attributes_as_headers() {
        let raw = SqsMessage::builder()
            .message_id("0b5e1c1e-7d4e-4c47-9d1f-6c7a2a8f0b11")
            .receipt_handle("AQEB-handle")
            .body("{\"id\":1}")
            .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "3")
            .attributes(MessageSystemAttributeName::SentTimestamp, "1700000000123")
            .attributes(MessageSystemAttributeName::MessageGroupId, "customer-7")
            .attributes(
                MessageSystemAttributeName::MessageDeduplicationId,
                "dedup-1",
            )
            .attributes(MessageSystemAttributeName::SequenceNumber, "18849")
            .attributes(
                MessageSystemAttributeName::ApproximateFirstReceiveTimestamp,
                "1700000000200",
            )
            .message_attributes("kind", attribute("String", "order"))
            .message_attributes("amount", attribute("Number", "12.5"))
            .message_attributes(
                "raw",
                MessageAttributeValue::builder()
                    .data_type("Binary")
                    .binary_value(Blob::new(vec![0xff, 0x00]))
                    .build()
                    .expect("attribute"),
            )
            .build();
        let message = delivered(convert(SOURCE, true, raw));
        assert_eq!(message.external_id, "0b5e1c1e-7d4e-4c47-9d1f-6c7a2a8f0b11");
        assert_eq!(
            message.idempotency_key,
            "sqs:shop/orders:0b5e1c1e-7d4e-4c47-9d1f-6c7a2a8f0b11"
        );
        assert_eq!(message.body, b"{\"id\":1}");
        assert_eq!(message.delivery_count, 3);
        assert_eq!(message.enqueued_at_ms, Some(1_700_000_000_123));
        assert_eq!(message.position, None);
        assert_eq!(message.undecodable, None);
        assert_eq!(
            message.receipt,
            Receipt {
                handle: "AQEB-handle".into(),
                group: Some("customer-7".into())
            }
        );
        let headers: Vec<(&str, &[u8])> = message
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_slice()))
            .collect();
        assert_eq!(
            headers,
            vec![
                ("amount", &b"12.5"[..]),
                ("kind", b"order"),
                ("raw", &[0xff, 0x00]),
                ("MessageDeduplicationId", b"dedup-1"),
                ("MessageGroupId", b"customer-7"),
                ("SentTimestamp", b"1700000000123"),
                ("SequenceNumber", b"18849"),
            ]
        );
    }

    #[test]
    fn standard_queue_receipts_carry_no_group() {
        let message = delivered(convert(SOURCE, false, fifo_message("m1", "g")));
        assert_eq!(message.receipt.group, None);
        assert_eq!(
            message.delivery_count, 1,
            "a missing receive count is the first delivery"
        );
    }

    #[test]
    fn message_without_body_or_id_is_undecodable_but_deliverable() {
        let raw = SqsMessage::builder().receipt_handle("h").build();
        let message = delivered(convert(SOURCE, false, raw));
        assert_eq!(
            message.undecodable.as_deref(),
            Some("the SQS message has no MessageId and no Body")
        );
        assert!(message.external_id.starts_with("sha256:"));
    }

    #[test]
    fn message_without_receipt_is_skipped() {
        let raw = SqsMessage::builder().message_id("m1").body("x").build();
        assert!(matches!(
            convert(SOURCE, false, raw),
            Received::NoReceipt { message_id: Some(id), group: None } if id == "m1"
        ));
    }

    #[test]
    fn receipt_debug_hides_the_handle() {
        let receipt = Receipt {
            handle: "secret-handle".into(),
            group: None,
        };
        assert!(!format!("{receipt:?}").contains("secret-handle"));
    }

    #[test]
    fn fifo_group_behind_a_skipped_message_is_released_and_others_are_kept() {
        let mut no_receipt = fifo_message("a1", "a");
        no_receipt.receipt_handle = None;
        let received = vec![
            convert(SOURCE, true, no_receipt),
            convert(SOURCE, true, fifo_message("b1", "b")),
            convert(SOURCE, true, fifo_message("a2", "a")),
            convert(SOURCE, true, fifo_message("b2", "b")),
            convert(SOURCE, true, fifo_message("a3", "a")),
        ];
        let sorted = sort_received(received);
        let kept: Vec<&str> = sorted
            .messages
            .iter()
            .map(|m| m.external_id.as_str())
            .collect();
        assert_eq!(kept, ["b1", "b2"]);
        let released: Vec<&str> = sorted.released.iter().map(|r| r.handle.as_str()).collect();
        assert_eq!(released, ["handle-a2", "handle-a3"]);
        assert_eq!(sorted.skipped, [Some("a1".to_owned())]);
    }

    #[test]
    fn standard_messages_behind_a_skipped_one_are_kept() {
        let mut no_receipt = fifo_message("m1", "g");
        no_receipt.receipt_handle = None;
        let sorted = sort_received(vec![
            convert(SOURCE, false, no_receipt),
            convert(SOURCE, false, fifo_message("m2", "g")),
        ]);
        assert_eq!(sorted.messages.len(), 1);
        assert!(sorted.released.is_empty());
    }
}
