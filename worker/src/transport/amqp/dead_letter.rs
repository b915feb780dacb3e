//! Dead letters as AMQP messages: the body byte-identical, persistent, the original properties
//! and headers plus the context as `x-switchboard-*` headers — but never what would make the
//! letter behave unlike a letter: the per-message TTL (`expiration`, which would expire the
//! letter), the `user-id` (RabbitMQ refuses a publish whose `user-id` is not the publishing
//! user's, 406), or the broker's delivery counters (`x-delivery-count`, `x-death`: a letter moved
//! back would count from where the original stopped). The removed `expiration` and `user-id` are
//! kept as `x-switchboard-original-*` headers. The letter's `message-id` is the original's, else
//! the body's hash (the message's id within the source): a letter published twice (a confirm
//! lost with its connection) is recognisable as one.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};

use super::delivery::{OWN_COUNT_HEADER, Original, QUORUM_COUNT_HEADER};
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
    /// The message's id within the source (its `message-id`, else the body's hash).
    pub message_id: &'a str,
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

/// Headers of the original a dead letter never copies: the delivery counters (RabbitMQ's and the
/// worker's own), and RabbitMQ's own dead-lettering history.
const COUNTER_HEADERS: [&str; 6] = [
    QUORUM_COUNT_HEADER,
    OWN_COUNT_HEADER,
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
];

/// The properties of the dead letter of a message published as `original`.
pub fn properties(
    original: &Original,
    letter: LetterContext<'_>,
    context: WriteContext<'_>,
) -> BasicProperties {
    // The count travels as `x-switchboard-delivery-count`: a dead letter moved back to the
    // queue starts counting afresh.
    let p = &original.properties;
    let mut headers: FieldTable = p
        .headers()
        .iter()
        .flat_map(|table| table.inner())
        .filter(|(name, _)| !COUNTER_HEADERS.contains(&name.as_str()))
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
    if let Some(expiration) = p.expiration() {
        set(
            "x-switchboard-original-expiration",
            text(expiration.as_str()),
        );
    }
    if let Some(user_id) = p.user_id() {
        set("x-switchboard-original-user-id", text(user_id.as_str()));
    }
    // Built afresh, so that a property added here is a decision (not `expiration`, `user-id`).
    let mut letter_properties = BasicProperties::default()
        .with_message_id(letter.message_id.into())
        .with_delivery_mode(PERSISTENT)
        .with_headers(headers);
    let copies = [
        (
            p.content_type(),
            BasicProperties::with_content_type as fn(_, _) -> _,
        ),
        (p.content_encoding(), BasicProperties::with_content_encoding),
        (p.correlation_id(), BasicProperties::with_correlation_id),
        (p.reply_to(), BasicProperties::with_reply_to),
        (p.kind(), BasicProperties::with_type),
        (p.app_id(), BasicProperties::with_app_id),
        (p.cluster_id(), BasicProperties::with_cluster_id),
    ];
    for (value, with) in copies {
        if let Some(value) = value {
            letter_properties = with(letter_properties, value.clone());
        }
    }
    if let Some(priority) = p.priority() {
        letter_properties = letter_properties.with_priority(*priority);
    }
    if let Some(timestamp) = p.timestamp() {
        letter_properties = letter_properties.with_timestamp(*timestamp);
    }
    letter_properties
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
            message_id: "m-1",
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
    fn dead_letter_drops_the_ttl_the_user_id_and_the_broker_counters() {
        let mut headers = FieldTable::default();
        headers.insert(QUORUM_COUNT_HEADER.into(), AMQPValue::LongLongInt(4));
        headers.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        headers.insert("x-first-death-queue".into(), text("orders"));
        headers.insert("tenant".into(), text("acme"));
        let original = Original {
            exchange: String::new(),
            routing_key: "orders".into(),
            properties: BasicProperties::default()
                .with_expiration("20000".into())
                .with_user_id("producer".into())
                .with_app_id("shop".into())
                .with_headers(headers),
        };
        let letter = LetterContext {
            message_id: "sha256:ab",
            reason: PoisonReason::InvalidJson,
            error: "broken",
            delivery_count: 5,
            first_seen_ms: None,
            attempts: &Attempts::default(),
        };
        let context = WriteContext {
            queue: "orders",
            consumer: "worker-0",
            last_seen: "2026-12-01T00:00:00.000Z",
        };
        let props = properties(&original, letter, context);
        assert_eq!(*props.expiration(), None);
        assert_eq!(*props.user_id(), None);
        assert_eq!(props.app_id().as_ref().map(|a| a.as_str()), Some("shop"));
        assert_eq!(
            props.message_id().as_ref().map(|m| m.as_str()),
            Some("sha256:ab")
        );
        let headers = props.headers().clone().expect("headers");
        let get = |name: &str| headers.inner().get(name).cloned();
        for counter in COUNTER_HEADERS {
            assert_eq!(get(counter), None, "{counter}");
        }
        assert_eq!(get("tenant"), Some(text("acme")));
        assert_eq!(
            get("x-switchboard-original-expiration"),
            Some(text("20000"))
        );
        assert_eq!(
            get("x-switchboard-original-user-id"),
            Some(text("producer"))
        );
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
