//! Decoding the gateway's answers to a receive: each message on its own, as the protocol says
//! it is (`{messageId, receiptHandle, body (base64), attributes: {values: {name: text}},
//! receiveCount, sentTimestamp}`). One that does not follow the protocol is that message's
//! poison, never the whole receive's; one without a receipt handle is skipped.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Deserialize;
use serde_json::Value;

use super::GatewayDelivery;
use crate::transport::Message;
use crate::transport::identity::{body_hash, body_id, idempotency_key};
use crate::transport::sqs::Receipt;

/// The protocol's answer to a receive. Each message is decoded on its own (see [`convert`]):
/// one that does not follow the protocol is that message's poison, never the whole receive's.
#[derive(Debug, Deserialize)]
pub struct Receive {
    #[serde(default)]
    pub messages: Vec<Value>,
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
pub fn convert(source: &str, raw: &Value) -> Option<GatewayDelivery> {
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
            body_id(&body_hash(&body))
        }
    };
    let mut headers = attributes(raw.get("attributes"), &mut problems);
    // A redriven copy of a letter at SQS's attribute limit (see `copy_attributes`).
    crate::transport::sqs::reader::unpack_redriven(&mut headers);
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

#[cfg(test)]
mod tests {
    use serde_json::json;

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
