//! A producer's envelope around the payload (`spec.payload.envelope`): CloudEvents 1.0 and SNS
//! notifications. The event's own id becomes the key, so a producer that publishes the same
//! event twice (the broker gives each copy its own message id) still gets one todo.
//!
//! Everything here reads only a message's body and headers, so it works alike for every
//! transport: stream fields, SQS message attributes, Kafka, NATS and AMQP headers.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde_json::value::RawValue;
use switchboard_api::PayloadFormat;

use crate::payload::{Poison, PoisonReason, check_size, payload_json};

/// The longest event id (`ce:{source}:{id}`, `sns:{MessageId}`) taken as a key: PostgreSQL
/// indexes both the event id and the todo key, and an index row has a size limit.
const MAX_EVENT_ID_BYTES: usize = 1024;

/// What the store keeps of a message taken out of its envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unwrapped {
    /// The event's id within the source: `ce:{source}:{id}` or `sns:{MessageId}`.
    pub event_id: String,
    /// The payload as JSON text.
    pub payload: String,
    /// The message's headers with the envelope's attributes.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// How the payload is read: `payload.format` and `payload.maxBytes`.
#[derive(Debug, Clone, Copy)]
pub struct PayloadRules {
    pub format: PayloadFormat,
    pub max_bytes: usize,
}

fn poison(detail: impl Into<String>) -> Poison {
    Poison {
        reason: PoisonReason::Envelope,
        detail: detail.into(),
    }
}

/// The event id, unless it is too long to be a key.
fn event_id(id: String) -> Result<String, Poison> {
    if id.len() > MAX_EVENT_ID_BYTES {
        return Err(poison(format!(
            "the event id is {} bytes; at most {MAX_EVENT_ID_BYTES} make a key",
            id.len()
        )));
    }
    Ok(id)
}

/// The required context attributes of CloudEvents 1.0 (`type` is required by the spec too,
/// but not needed to identify or store an event).
const REQUIRED: [&str; 3] = ["id", "source", "specversion"];

/// Header prefixes of binary mode: `ce-` (HTTP, NATS; values percent-encoded), `ce_` (Kafka),
/// `cloudEvents_` and `cloudEvents:` (AMQP). Matched without regard to case.
const PREFIXES: [(&str, bool); 4] = [
    ("ce-", true),
    ("ce_", false),
    ("cloudevents_", false),
    ("cloudevents:", false),
];

/// The attribute a binary-mode header carries, and whether its value is percent-encoded.
fn attribute_of(header: &str) -> Option<(String, bool)> {
    PREFIXES.iter().find_map(|&(prefix, encoded)| {
        let head = header.get(..prefix.len())?;
        let name = &header[prefix.len()..];
        (head.eq_ignore_ascii_case(prefix) && !name.is_empty())
            .then(|| (name.to_ascii_lowercase(), encoded))
    })
}

fn is_content_type(header: &str) -> bool {
    header.eq_ignore_ascii_case("content-type") || header.eq_ignore_ascii_case("content_type")
}

/// The media type of a content type, lowercase, without parameters.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

fn is_json(content_type: &str) -> bool {
    let media = media_type(content_type);
    media == "application/json" || media == "text/json" || media.ends_with("+json")
}

/// Event data as a payload: JSON under a JSON `datacontenttype`, else read like a body under
/// `payload.format`.
fn data_payload(
    data: &[u8],
    content_type: Option<&str>,
    rules: PayloadRules,
) -> Result<String, Poison> {
    let format = match content_type {
        Some(content_type) if is_json(content_type) => PayloadFormat::Json,
        _ => rules.format,
    };
    payload_json(data, format, rules.max_bytes)
}

/// Decodes `%XX` escapes (the HTTP and NATS bindings percent-encode header values).
fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    if !bytes.contains(&b'%') {
        return Some(text.to_owned());
    }
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                decoded.push(byte);
                i += 3;
            }
            None => {
                decoded.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8(decoded).ok()
}

/// `%` and `:` of an id percent-encoded, so that a key splits at its last colon: source
/// `urn:a` with id `b:c` and source `urn:a:b` with id `c` stay two events.
fn key_part(id: &str) -> String {
    id.replace('%', "%25").replace(':', "%3A")
}

/// Fails naming each required attribute that is not `present`.
fn require(mode: &str, present: impl Fn(&str) -> bool) -> Result<(), Poison> {
    let missing: Vec<String> = REQUIRED
        .iter()
        .filter(|name| !present(name))
        .map(|name| format!("`{name}`"))
        .collect();
    match missing.len() {
        0 => Ok(()),
        1 => Err(poison(format!(
            "CloudEvent ({mode} mode) lacks the required attribute {}",
            missing[0]
        ))),
        _ => Err(poison(format!(
            "CloudEvent ({mode} mode) lacks the required attributes {}",
            missing.join(", ")
        ))),
    }
}

/// A CloudEvent, structured (the body is the event in the JSON format) or binary (the
/// attributes are headers, the body is the data).
pub fn cloud_event(
    body: &[u8],
    headers: &[(String, Vec<u8>)],
    rules: PayloadRules,
) -> Result<Unwrapped, Poison> {
    check_size(body, rules.max_bytes)?;
    let content_type = headers
        .iter()
        .find(|(name, _)| is_content_type(name))
        .and_then(|(_, value)| std::str::from_utf8(value).ok());
    let structured_type = content_type.map(media_type);
    if let Some(media) = &structured_type
        && media.starts_with("application/cloudevents-batch")
    {
        return Err(poison(format!(
            "a batch of CloudEvents ({media}) is not supported: publish one event per message"
        )));
    }
    let structured = structured_type
        .is_some_and(|media| media.starts_with("application/cloudevents"))
        || !headers.iter().any(|(name, _)| attribute_of(name).is_some());
    if structured {
        structured_event(body, headers, rules)
    } else {
        binary_event(body, headers, content_type, rules)
    }
}

fn binary_event(
    body: &[u8],
    headers: &[(String, Vec<u8>)],
    content_type: Option<&str>,
    rules: PayloadRules,
) -> Result<Unwrapped, Poison> {
    let mut attributes: BTreeMap<String, String> = BTreeMap::new();
    let mut others = Vec::with_capacity(headers.len());
    for (name, value) in headers {
        let Some((attribute, encoded)) = attribute_of(name) else {
            others.push((name.clone(), value.clone()));
            continue;
        };
        let text = std::str::from_utf8(value)
            .ok()
            .and_then(|text| {
                if encoded {
                    percent_decoded(text)
                } else {
                    Some(text.to_owned())
                }
            })
            .ok_or_else(|| poison(format!("CloudEvent attribute `{attribute}` is not UTF-8")))?;
        attributes.insert(attribute, text);
    }
    require("binary", |name| {
        attributes.get(name).is_some_and(|v| !v.is_empty())
    })?;
    let content_type = attributes
        .get("datacontenttype")
        .map(String::as_str)
        .or(content_type);
    let payload = data_payload(body, content_type, rules)?;
    let event_id = event_id(format!(
        "ce:{}:{}",
        attributes["source"],
        key_part(&attributes["id"])
    ))?;
    let mut headers: Vec<(String, Vec<u8>)> = attributes
        .into_iter()
        .map(|(name, value)| (format!("ce-{name}"), value.into_bytes()))
        .collect();
    headers.extend(others);
    Ok(Unwrapped {
        event_id,
        payload,
        headers,
    })
}

fn structured_event(
    body: &[u8],
    headers: &[(String, Vec<u8>)],
    rules: PayloadRules,
) -> Result<Unwrapped, Poison> {
    let members: BTreeMap<String, &RawValue> = std::str::from_utf8(body)
        .map_err(|err| err.to_string())
        .and_then(|text| serde_json::from_str(text).map_err(|err| err.to_string()))
        .map_err(|err| {
            poison(format!(
                "not a CloudEvent: no header carries CloudEvents attributes (ce-*, ce_*, \
                 cloudEvents_*) and the body is not a JSON object ({err})"
            ))
        })?;
    let mut attributes: BTreeMap<&str, String> = BTreeMap::new();
    for (name, raw) in &members {
        if name == "data" || name == "data_base64" {
            continue;
        }
        let text = raw.get();
        let value = match serde_json::from_str::<Option<String>>(text) {
            Ok(Some(value)) => value,
            // A null attribute is an absent one.
            Ok(None) => continue,
            Err(_) if REQUIRED.contains(&name.as_str()) => {
                return Err(poison(format!(
                    "CloudEvent attribute `{name}` must be a string, got {text}"
                )));
            }
            // Extension attributes may be numbers or booleans.
            Err(_) => text.to_owned(),
        };
        attributes.insert(name, value);
    }
    require("structured", |name| {
        attributes.get(name).is_some_and(|v| !v.is_empty())
    })?;
    let content_type = attributes.get("datacontenttype").map(String::as_str);
    let payload = match (members.get("data"), members.get("data_base64")) {
        (Some(_), Some(_)) => {
            return Err(poison(
                "CloudEvent has both `data` and `data_base64`; it may have one",
            ));
        }
        // JSON data is stored as the producer wrote it, digit for digit.
        (Some(data), None) => {
            payload_json(data.get().as_bytes(), PayloadFormat::Json, rules.max_bytes)?
        }
        (None, Some(encoded)) => {
            let encoded: String = serde_json::from_str(encoded.get())
                .map_err(|_| poison("CloudEvent attribute `data_base64` must be a string"))?;
            let data = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .map_err(|err| poison(format!("CloudEvent `data_base64` is not base64: {err}")))?;
            data_payload(&data, content_type, rules)?
        }
        (None, None) => "null".to_owned(),
    };
    let event_id = event_id(format!(
        "ce:{}:{}",
        attributes["source"],
        key_part(&attributes["id"])
    ))?;
    let mut unwrapped_headers = headers.to_vec();
    unwrapped_headers.extend(
        attributes
            .into_iter()
            .map(|(name, value)| (format!("ce-{name}"), value.into_bytes())),
    );
    Ok(Unwrapped {
        event_id,
        payload,
        headers: unwrapped_headers,
    })
}

/// An SNS notification as SQS receives it from a topic without raw message delivery: the
/// payload is its `Message`, its `MessageAttributes` become headers under their own names (as
/// raw delivery would make them), every other field an `sns-{Field}` header.
pub fn sns_notification(
    body: &[u8],
    headers: &[(String, Vec<u8>)],
    rules: PayloadRules,
) -> Result<Unwrapped, Poison> {
    check_size(body, rules.max_bytes)?;
    let mut fields: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|err| {
            poison(format!(
                "not an SNS notification: the body is not a JSON object ({err})"
            ))
        })?;
    let text = |fields: &BTreeMap<String, serde_json::Value>, name: &str| {
        fields
            .get(name)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    match text(&fields, "Type").as_deref() {
        Some("Notification") => {}
        Some(kind) => {
            return Err(poison(format!(
                "an SNS {kind} message, not a Notification{}",
                if kind == "SubscriptionConfirmation" {
                    " (confirm the subscription by visiting its SubscribeURL)"
                } else {
                    ""
                }
            )));
        }
        None => return Err(poison("not an SNS notification: it lacks `Type`")),
    }
    let message_id = text(&fields, "MessageId")
        .filter(|id| !id.is_empty())
        .ok_or_else(|| poison("SNS notification lacks `MessageId`"))?;
    let message = text(&fields, "Message")
        .ok_or_else(|| poison("SNS notification lacks `Message` (a string)"))?;
    fields.remove("Message");
    let payload = payload_json(message.as_bytes(), rules.format, rules.max_bytes)?;

    let mut unwrapped_headers = headers.to_vec();
    if let Some(attributes) = fields.remove("MessageAttributes") {
        let attributes: BTreeMap<String, SnsAttribute> = serde_json::from_value(attributes)
            .map_err(|err| {
                poison(format!(
                    "SNS notification's `MessageAttributes` are not name → {{Type, Value}}: {err}"
                ))
            })?;
        for (name, attribute) in attributes {
            let value = if attribute.kind == "Binary" {
                base64::engine::general_purpose::STANDARD
                    .decode(&attribute.value)
                    .map_err(|err| {
                        poison(format!(
                            "SNS message attribute `{name}` (Binary) is not base64: {err}"
                        ))
                    })?
            } else {
                attribute.value.into_bytes()
            };
            unwrapped_headers.push((name, value));
        }
    }
    unwrapped_headers.extend(fields.into_iter().map(|(name, value)| {
        let value = match value {
            serde_json::Value::String(text) => text,
            other => other.to_string(),
        };
        (format!("sns-{name}"), value.into_bytes())
    }));
    Ok(Unwrapped {
        event_id: event_id(format!("sns:{message_id}"))?,
        payload,
        headers: unwrapped_headers,
    })
}

/// One of an SNS notification's `MessageAttributes`.
#[derive(Debug, serde::Deserialize)]
struct SnsAttribute {
    /// `String`, `String.Array`, `Number` or `Binary` (base64 `Value`).
    #[serde(rename = "Type")]
    kind: String,
    #[serde(rename = "Value")]
    value: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: PayloadRules = PayloadRules {
        format: PayloadFormat::Auto,
        max_bytes: 1024 * 1024,
    };

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(name, value)| ((*name).to_owned(), value.as_bytes().to_vec()))
            .collect()
    }

    fn header<'a>(unwrapped: &'a Unwrapped, name: &str) -> Option<&'a str> {
        unwrapped
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| std::str::from_utf8(v).expect("utf-8"))
    }

    fn envelope_poison(result: Result<Unwrapped, Poison>) -> String {
        let poison = result.expect_err("poison");
        assert_eq!(poison.reason, PoisonReason::Envelope, "{poison}");
        poison.detail
    }

    const STRUCTURED: &str = r#"{"specversion": "1.0", "id": "A-1", "source": "https://shop.example/orders",
        "type": "order.created", "subject": "7", "time": "2026-12-01T10:00:00Z", "priority": 3,
        "datacontenttype": "application/json", "data": {"order": 7, "total": 1e400}}"#;

    #[test]
    fn structured_event_is_keyed_by_source_and_id_with_its_data_as_the_payload() {
        let event =
            cloud_event(STRUCTURED.as_bytes(), &headers(&[("kind", "x")]), RULES).expect("event");
        assert_eq!(event.event_id, "ce:https://shop.example/orders:A-1");
        assert_eq!(event.payload, r#"{"order": 7, "total": 1e400}"#, "verbatim");
        for (name, value) in [
            ("ce-type", "order.created"),
            ("ce-source", "https://shop.example/orders"),
            ("ce-subject", "7"),
            ("ce-time", "2026-12-01T10:00:00Z"),
            ("ce-id", "A-1"),
            ("ce-specversion", "1.0"),
            ("ce-priority", "3"),
            ("kind", "x"),
        ] {
            assert_eq!(header(&event, name), Some(value), "{name}");
        }
        assert_eq!(header(&event, "ce-data"), None);
    }

    #[test]
    fn structured_event_without_data_has_a_null_payload() {
        let body = br#"{"specversion":"1.0","id":"1","source":"s","type":"t"}"#;
        assert_eq!(
            cloud_event(body, &[], RULES).expect("event").payload,
            "null"
        );
    }

    #[test]
    fn data_base64_is_decoded_per_datacontenttype() {
        let event = |content_type: &str, encoded: &str, rules: PayloadRules| {
            let body = format!(
                r#"{{"specversion":"1.0","id":"1","source":"s","datacontenttype":"{content_type}","data_base64":"{encoded}"}}"#
            );
            cloud_event(body.as_bytes(), &[], rules)
        };
        // {"a":1}
        let json = event("application/json; charset=utf-8", "eyJhIjoxfQ==", RULES);
        assert_eq!(json.expect("json").payload, r#"{"a":1}"#);
        // hello
        let text = event("text/plain", "aGVsbG8=", RULES);
        assert_eq!(text.expect("text").payload, r#""hello""#);
        // "hello" declared JSON is not JSON: poison whatever payload.format says.
        let poison = event("application/vnd.x+json", "aGVsbG8=", RULES).expect_err("not json");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
        let strict = PayloadRules {
            format: PayloadFormat::Json,
            ..RULES
        };
        let poison = event("text/plain", "aGVsbG8=", strict).expect_err("strict");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
        let detail = envelope_poison(event("text/plain", "not base64!", RULES));
        assert!(detail.contains("`data_base64` is not base64"), "{detail}");
    }

    #[test]
    fn data_and_data_base64_together_are_poison() {
        let body = br#"{"specversion":"1.0","id":"1","source":"s","data":1,"data_base64":"MQ=="}"#;
        let detail = envelope_poison(cloud_event(body, &[], RULES));
        assert!(detail.contains("both `data` and `data_base64`"), "{detail}");
    }

    #[test]
    fn missing_required_attributes_are_named() {
        let body = br#"{"specversion":"1.0","source":"s","data":{}}"#;
        assert_eq!(
            envelope_poison(cloud_event(body, &[], RULES)),
            "CloudEvent (structured mode) lacks the required attribute `id`"
        );
        let body = br#"{"id":"","data":{}}"#;
        assert_eq!(
            envelope_poison(cloud_event(body, &[], RULES)),
            "CloudEvent (structured mode) lacks the required attributes `id`, `source`, `specversion`"
        );
        let binary = headers(&[("ce-id", "1"), ("ce-specversion", "1.0")]);
        assert_eq!(
            envelope_poison(cloud_event(b"{}", &binary, RULES)),
            "CloudEvent (binary mode) lacks the required attribute `source`"
        );
    }

    #[test]
    fn required_attributes_must_be_strings() {
        let body = br#"{"specversion":"1.0","id":7,"source":"s"}"#;
        let detail = envelope_poison(cloud_event(body, &[], RULES));
        assert!(detail.contains("`id` must be a string, got 7"), "{detail}");
    }

    #[test]
    fn a_body_that_is_no_json_object_without_ce_headers_is_poison() {
        for body in [&b"hello"[..], b"[1]", b"\xff"] {
            let detail = envelope_poison(cloud_event(body, &headers(&[("kind", "x")]), RULES));
            assert!(
                detail.starts_with("not a CloudEvent: no header"),
                "{detail}"
            );
        }
    }

    #[test]
    fn binary_mode_reads_ce_dash_and_ce_underscore_headers_alike() {
        let body = br#"{"order": 7}"#;
        // HTTP and NATS: `ce-`, values percent-encoded.
        let dash = headers(&[
            ("ce-specversion", "1.0"),
            ("ce-id", "A%201"),
            ("ce-source", "urn:shop"),
            ("ce-type", "order.created"),
            ("content-type", "application/json"),
            ("traceparent", "00-abc"),
        ]);
        // Kafka: `ce_`, any case.
        let underscore = headers(&[
            ("CE_SPECVERSION", "1.0"),
            ("ce_id", "A 1"),
            ("ce_Source", "urn:shop"),
            ("ce_type", "order.created"),
        ]);
        // AMQP: `cloudEvents_` and the older `cloudEvents:`.
        let amqp = headers(&[
            ("cloudEvents_specversion", "1.0"),
            ("cloudEvents:id", "A 1"),
            ("cloudEvents_source", "urn:shop"),
        ]);
        let events: Vec<Unwrapped> = [dash, underscore, amqp]
            .iter()
            .map(|h| cloud_event(body, h, RULES).expect("binary event"))
            .collect();
        for event in &events {
            assert_eq!(event.event_id, "ce:urn:shop:A 1");
            assert_eq!(event.payload, r#"{"order": 7}"#);
            assert_eq!(header(event, "ce-id"), Some("A 1"));
            assert_eq!(
                header(event, "ce_id"),
                None,
                "attributes are renamed to ce-*"
            );
        }
        assert_eq!(header(&events[0], "ce-type"), Some("order.created"));
        assert_eq!(header(&events[0], "traceparent"), Some("00-abc"));
        assert_eq!(header(&events[0], "content-type"), Some("application/json"));
    }

    #[test]
    fn binary_mode_content_type_decides_whether_the_data_must_be_json() {
        let attributes = [
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "s"),
        ];
        let with = |extra: &[(&str, &str)]| {
            let mut all = headers(&attributes);
            all.extend(headers(extra));
            all
        };
        let poison = cloud_event(
            b"hello",
            &with(&[("content-type", "application/json")]),
            RULES,
        )
        .expect_err("declared json");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
        let poison = cloud_event(
            b"hello",
            &with(&[("ce-datacontenttype", "text/json")]),
            RULES,
        )
        .expect_err("declared json");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
        let text = cloud_event(b"hello", &with(&[("content-type", "text/plain")]), RULES);
        assert_eq!(text.expect("text").payload, r#""hello""#);
    }

    #[test]
    fn structured_content_type_wins_over_ce_headers() {
        let stray = headers(&[
            (
                "content-type",
                "application/cloudevents+json; charset=utf-8",
            ),
            ("ce-id", "from-header"),
        ]);
        let event = cloud_event(STRUCTURED.as_bytes(), &stray, RULES).expect("structured");
        assert_eq!(event.event_id, "ce:https://shop.example/orders:A-1");
        let batch = headers(&[("content-type", "application/cloudevents-batch+json")]);
        let detail = envelope_poison(cloud_event(b"[]", &batch, RULES));
        assert!(detail.contains("publish one event per message"), "{detail}");
    }

    #[test]
    fn colons_in_the_id_cannot_make_two_events_one_key() {
        let key = |source: &str, id: &str| {
            let body = format!(r#"{{"specversion":"1.0","id":"{id}","source":"{source}"}}"#);
            cloud_event(body.as_bytes(), &[], RULES)
                .expect("event")
                .event_id
        };
        assert_eq!(key("urn:a", "b:c"), "ce:urn:a:b%3Ac");
        assert_ne!(key("urn:a", "b:c"), key("urn:a:b", "c"));
        assert_ne!(key("s", "1%3A2"), key("s", "1:2"));
    }

    #[test]
    fn an_event_id_too_long_for_a_key_is_poison() {
        let body = format!(
            r#"{{"specversion":"1.0","id":"{}","source":"s"}}"#,
            "x".repeat(MAX_EVENT_ID_BYTES)
        );
        let detail = envelope_poison(cloud_event(body.as_bytes(), &[], RULES));
        assert!(detail.contains("at most 1024 make a key"), "{detail}");
    }

    #[test]
    fn oversize_envelope_is_poison_before_it_is_parsed() {
        let rules = PayloadRules {
            max_bytes: 10,
            ..RULES
        };
        for result in [
            cloud_event(STRUCTURED.as_bytes(), &[], rules),
            sns_notification(SNS.as_bytes(), &[], rules),
        ] {
            assert_eq!(result.expect_err("oversize").reason, PoisonReason::Oversize);
        }
    }

    /// As SQS receives it from a topic without raw message delivery.
    const SNS: &str = r#"{
  "Type" : "Notification",
  "MessageId" : "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
  "TopicArn" : "arn:aws:sns:us-east-1:123456789012:orders",
  "Subject" : "order",
  "Message" : "{\"order\": 7}",
  "Timestamp" : "2026-12-01T10:00:00.000Z",
  "SignatureVersion" : "1",
  "Signature" : "EXAMPLEpH+...",
  "SigningCertURL" : "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0000.pem",
  "UnsubscribeURL" : "https://sns.us-east-1.amazonaws.com/?Action=Unsubscribe",
  "MessageAttributes" : {
    "tenant" : {"Type":"String","Value":"acme"},
    "weight" : {"Type":"Number","Value":"2.5"},
    "blob" : {"Type":"Binary","Value":"/wA="}
  }
}"#;

    #[test]
    fn sns_notification_unwraps_its_message_and_attributes() {
        let delivery = headers(&[("SenderId", "AIDAEXAMPLE")]);
        let event = sns_notification(SNS.as_bytes(), &delivery, RULES).expect("notification");
        assert_eq!(event.event_id, "sns:22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324");
        assert_eq!(event.payload, r#"{"order": 7}"#);
        for (name, value) in [
            ("SenderId", "AIDAEXAMPLE"),
            ("tenant", "acme"),
            ("weight", "2.5"),
            ("sns-TopicArn", "arn:aws:sns:us-east-1:123456789012:orders"),
            ("sns-Timestamp", "2026-12-01T10:00:00.000Z"),
            ("sns-Subject", "order"),
            ("sns-Type", "Notification"),
            ("sns-MessageId", "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324"),
            ("sns-SignatureVersion", "1"),
            ("sns-Signature", "EXAMPLEpH+..."),
            (
                "sns-SigningCertURL",
                "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0000.pem",
            ),
        ] {
            assert_eq!(header(&event, name), Some(value), "{name}");
        }
        let blob = event
            .headers
            .iter()
            .find(|(n, _)| n == "blob")
            .expect("blob");
        assert_eq!(blob.1, vec![0xff, 0x00], "Binary attributes are decoded");
        assert!(event.headers.iter().all(|(n, _)| n != "sns-Message"));
        assert!(
            event
                .headers
                .iter()
                .all(|(n, _)| n != "sns-MessageAttributes")
        );
    }

    #[test]
    fn sns_text_message_follows_payload_format() {
        let body = SNS.replace(r#""{\"order\": 7}""#, r#""plain text""#);
        let event = sns_notification(body.as_bytes(), &[], RULES).expect("auto");
        assert_eq!(event.payload, r#""plain text""#);
        let strict = PayloadRules {
            format: PayloadFormat::Json,
            ..RULES
        };
        let poison = sns_notification(body.as_bytes(), &[], strict).expect_err("strict");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
    }

    #[test]
    fn what_is_not_an_sns_notification_is_poison_naming_why() {
        let confirmation = SNS.replace("\"Notification\"", "\"SubscriptionConfirmation\"");
        let detail = envelope_poison(sns_notification(confirmation.as_bytes(), &[], RULES));
        assert!(detail.contains("SubscribeURL"), "{detail}");
        let no_id = SNS.replace("\"MessageId\"", "\"Id\"");
        let detail = envelope_poison(sns_notification(no_id.as_bytes(), &[], RULES));
        assert_eq!(detail, "SNS notification lacks `MessageId`");
        let no_message = SNS.replace("\"Message\" :", "\"Body\" :");
        let detail = envelope_poison(sns_notification(no_message.as_bytes(), &[], RULES));
        assert!(detail.contains("lacks `Message`"), "{detail}");
        let detail = envelope_poison(sns_notification(br#"{"order": 7}"#, &[], RULES));
        assert_eq!(detail, "not an SNS notification: it lacks `Type`");
        let detail = envelope_poison(sns_notification(b"hello", &[], RULES));
        assert!(detail.starts_with("not an SNS notification"), "{detail}");
        let bad = SNS.replace("\"/wA=\"", "\"***\"");
        let detail = envelope_poison(sns_notification(bad.as_bytes(), &[], RULES));
        assert!(detail.contains("`blob` (Binary) is not base64"), "{detail}");
    }
}
