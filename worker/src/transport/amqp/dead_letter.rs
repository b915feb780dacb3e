//! Dead letters as AMQP messages: the body byte-identical, the original properties (persistent),
//! the original headers plus the context as `x-switchboard-*` headers.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::delivery::{OWN_COUNT_HEADER, Original};
use crate::payload::PoisonReason;
use crate::transport::Attempts;

/// The error text kept in `x-switchboard-error`.
const MAX_ERROR_BYTES: usize = 2048;
/// `delivery-mode` of a persistent message.
pub const PERSISTENT: u8 = 2;

/// What every dead letter of one write shares.
#[derive(Debug, Clone, Copy)]
pub struct WriteContext<'a> {
    pub queue: &'a str,
    pub consumer: &'a str,
    /// RFC 3339, now.
    pub last_seen: &'a str,
}

/// What one dead letter says about its message.
#[derive(Debug, Clone, Copy)]
pub struct LetterContext<'a> {
    pub reason: PoisonReason,
    pub error: &'a str,
    pub delivery_count: u64,
    /// When the broker accepted the message (Unix ms), if the publisher said.
    pub first_seen_ms: Option<u64>,
    pub attempts: &'a Attempts,
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// At most `max` bytes of `text`, cut at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

fn rfc3339_ms(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

/// The properties of the dead letter of a message published as `original`.
pub fn properties(
    original: &Original,
    letter: LetterContext<'_>,
    context: WriteContext<'_>,
) -> BasicProperties {
    // The count travels as `x-switchboard-delivery-count`: a dead letter moved back to the
    // queue starts counting afresh.
    let mut headers: FieldTable = original
        .properties
        .headers()
        .iter()
        .flat_map(|table| table.inner())
        .filter(|(name, _)| name.as_str() != OWN_COUNT_HEADER)
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into();
    let mut set = |name: &str, value: AMQPValue| {
        headers.insert(name.into(), value);
    };
    set("x-switchboard-reason", text(letter.reason.as_str()));
    set(
        "x-switchboard-error",
        text(truncate(letter.error, MAX_ERROR_BYTES)),
    );
    set(
        "x-switchboard-delivery-count",
        AMQPValue::LongLongInt(i64::try_from(letter.delivery_count).unwrap_or(i64::MAX)),
    );
    if let Some(ms) = letter.first_seen_ms {
        set("x-switchboard-first-seen", text(&rfc3339_ms(ms)));
    }
    set("x-switchboard-last-seen", text(context.last_seen));
    set("x-switchboard-queue", text(context.queue));
    set("x-switchboard-consumer", text(context.consumer));
    set("x-switchboard-attempts", text(&letter.attempts.to_json()));
    set("x-switchboard-original-exchange", text(&original.exchange));
    set(
        "x-switchboard-original-routing-key",
        text(&original.routing_key),
    );
    original
        .properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(PERSISTENT)
}

/// The properties of a classic-queue redelivery published again with its delivery count.
pub fn recounted(original: &Original, next: u64) -> BasicProperties {
    let mut headers: FieldTable = original.properties.headers().clone().unwrap_or_default();
    headers.insert(
        OWN_COUNT_HEADER.into(),
        AMQPValue::LongLongInt(i64::try_from(next).unwrap_or(i64::MAX)),
    );
    original.properties.clone().with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_keeps_the_original_properties_and_adds_the_context() {
        let mut user = FieldTable::default();
        user.insert("tenant".into(), text("acme"));
        let original = Original {
            exchange: "shop".into(),
            routing_key: "orders.new".into(),
            properties: BasicProperties::default()
                .with_message_id("m-1".into())
                .with_content_type("application/json".into())
                .with_headers(user),
        };
        let letter = LetterContext {
            reason: PoisonReason::InvalidJson,
            error: &"x".repeat(5000),
            delivery_count: 3,
            first_seen_ms: Some(0),
            attempts: &Attempts::default(),
        };
        let context = WriteContext {
            queue: "orders",
            consumer: "worker-0",
            last_seen: "2026-12-01T00:00:00.000Z",
        };
        let props = properties(&original, letter, context);
        assert_eq!(props.message_id().as_ref().map(|m| m.as_str()), Some("m-1"));
        assert_eq!(*props.delivery_mode(), Some(PERSISTENT));
        let headers = props.headers().clone().expect("headers");
        let get = |name: &str| headers.inner().get(name).cloned();
        assert_eq!(get("tenant"), Some(text("acme")));
        assert_eq!(get("x-switchboard-reason"), Some(text("invalid_json")));
        assert_eq!(
            get("x-switchboard-delivery-count"),
            Some(AMQPValue::LongLongInt(3))
        );
        assert_eq!(
            get("x-switchboard-first-seen"),
            Some(text("1970-01-01T00:00:00.000Z"))
        );
        assert_eq!(
            get("x-switchboard-original-routing-key"),
            Some(text("orders.new"))
        );
        let Some(AMQPValue::LongString(error)) = get("x-switchboard-error") else {
            panic!("no error header");
        };
        assert_eq!(error.as_bytes().len(), MAX_ERROR_BYTES);
    }

    #[test]
    fn recount_sets_the_own_count_and_keeps_the_rest() {
        let original = Original {
            exchange: String::new(),
            routing_key: "orders".into(),
            properties: BasicProperties::default().with_app_id("shop".into()),
        };
        let props = recounted(&original, 3);
        assert_eq!(props.app_id().as_ref().map(|a| a.as_str()), Some("shop"));
        let headers = props.headers().clone().expect("headers");
        assert_eq!(
            headers.inner().get(OWN_COUNT_HEADER),
            Some(&AMQPValue::LongLongInt(3))
        );
    }
}
