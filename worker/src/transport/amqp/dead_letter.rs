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

use super::delivery::{OWN_COUNT_HEADER, Original, QUORUM_COUNT_HEADER, Receipt};
use crate::transport::DeadLetter;
use crate::transport::dead_letter::{Convention, DeadLetterContext};

/// `delivery-mode` of a persistent message.
pub const PERSISTENT: u8 = 2;
/// How AMQP dead letters name their context headers (`x-switchboard-*`).
const CONVENTION: Convention = Convention::Switchboard;

/// What every dead letter of one write shares.
#[derive(Debug, Clone, Copy)]
pub struct WriteContext<'a> {
    pub queue: &'a str,
    pub consumer: &'a str,
    /// RFC 3339, now.
    pub last_seen: &'a str,
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// Headers of the original a dead letter never copies: the delivery counters (RabbitMQ's and the
/// worker's own), and RabbitMQ's own dead-lettering history.
pub const COUNTER_HEADERS: [&str; 6] = [
    QUORUM_COUNT_HEADER,
    OWN_COUNT_HEADER,
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
];

/// The `x-switchboard-*` fields a dead letter adds to the original's headers: the common
/// context ([`DeadLetterContext::fields`]) and what only AMQP letters say.
pub const LETTER_FIELDS: [&str; 12] = [
    "reason",
    "error",
    "delivery-count",
    "first-seen",
    "attempts",
    "last-seen",
    "queue",
    "consumer",
    "original-exchange",
    "original-routing-key",
    "original-expiration",
    "original-user-id",
];

/// Whether header `name` is one a dead letter added ([`LETTER_FIELDS`]) or a broker counter
/// ([`COUNTER_HEADERS`]): not the original's.
pub fn added_header(name: &str) -> bool {
    COUNTER_HEADERS.contains(&name)
        || LETTER_FIELDS
            .iter()
            .any(|field| CONVENTION.name(field) == name)
}

/// The properties of `letter`'s dead letter: the original's properties and headers, and the
/// context as `x-switchboard-*` headers. Its `message-id` is the message's id within the
/// source (its `message-id`, else the body's hash).
pub fn properties(letter: &DeadLetter<'_, Receipt>, context: WriteContext<'_>) -> BasicProperties {
    let original = &letter.message.receipt.original;
    let mut headers = copied_headers(&original.properties);
    let common = DeadLetterContext::new(letter);
    for (name, value) in common.fields(CONVENTION) {
        headers.insert(name.into(), text(&value));
    }
    let mut set = |field: &str, value: AMQPValue| {
        headers.insert(CONVENTION.name(field).into(), value);
    };
    // The count travels as `x-switchboard-delivery-count`, a number (replacing its text): a
    // dead letter moved back to the queue starts counting afresh.
    let delivery_count = i64::try_from(common.delivery_count).unwrap_or(i64::MAX);
    set("delivery-count", AMQPValue::LongLongInt(delivery_count));
    set("last-seen", text(context.last_seen));
    set("queue", text(context.queue));
    set("consumer", text(context.consumer));
    set("original-exchange", text(&original.exchange));
    set("original-routing-key", text(&original.routing_key));
    let p = &original.properties;
    if let Some(expiration) = p.expiration() {
        set("original-expiration", text(expiration.as_str()));
    }
    if let Some(user_id) = p.user_id() {
        set("original-user-id", text(user_id.as_str()));
    }
    letter_properties(p, &letter.message.external_id, headers)
}

/// The original's headers but its delivery counters.
fn copied_headers(original: &BasicProperties) -> FieldTable {
    original
        .headers()
        .iter()
        .flat_map(|table| table.inner())
        .filter(|(name, _)| !COUNTER_HEADERS.contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into()
}

/// The letter's properties, built afresh from the original's `p`, so that a property added
/// here is a decision (not `expiration`, `user-id`).
fn letter_properties(
    p: &BasicProperties,
    message_id: &str,
    headers: FieldTable,
) -> BasicProperties {
    let mut letter_properties = BasicProperties::default()
        .with_message_id(message_id.into())
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
pub(super) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::payload::PoisonReason;
    use crate::transport::dead_letter::MAX_ERROR_BYTES;
    use crate::transport::{Attempts, Message};

    /// The message delivered as `original`, with its id within the source.
    pub(in crate::transport::amqp) fn message(
        original: Original,
        external_id: &str,
        delivery_count: u64,
    ) -> Message<Receipt> {
        Message {
            receipt: Receipt {
                channel: 1,
                tag: 1,
                original: Arc::new(original),
            },
            external_id: external_id.into(),
            idempotency_key: format!("amqp:shop/orders:orders:{external_id}"),
            body: b"{".to_vec(),
            headers: Vec::new(),
            delivery_count,
            enqueued_at_ms: None,
            position: None,
            undecodable: None,
        }
    }

    pub(in crate::transport::amqp) fn letter<'a>(
        message: &'a Message<Receipt>,
        error: &str,
    ) -> DeadLetter<'a, Receipt> {
        DeadLetter {
            message,
            reason: PoisonReason::InvalidJson,
            error: error.into(),
            attempts: Attempts::default(),
        }
    }

    pub(in crate::transport::amqp) const CONTEXT: WriteContext<'static> = WriteContext {
        queue: "orders",
        consumer: "worker-0",
        last_seen: "2026-12-01T00:00:00.000Z",
    };

    /// A message `m-1` (JSON) published to exchange `shop` with `headers`.
    pub(in crate::transport::amqp) fn published(headers: FieldTable) -> Original {
        Original {
            exchange: "shop".into(),
            routing_key: "orders.new".into(),
            properties: BasicProperties::default()
                .with_message_id("m-1".into())
                .with_content_type("application/json".into())
                .with_headers(headers),
        }
    }

    #[test]
    fn dead_letter_keeps_the_original_properties_and_adds_the_context() {
        let mut user = FieldTable::default();
        user.insert("tenant".into(), text("acme"));
        let mut message = message(published(user), "m-1", 3);
        message.enqueued_at_ms = Some(0);
        let props = properties(&letter(&message, &"x".repeat(5000)), CONTEXT);
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
        let message = message(original, "sha256:ab", 5);
        let props = properties(&letter(&message, "broken"), CONTEXT);
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
        // What the reader takes off to give the original back: every field written, nothing else.
        let added: Vec<&str> = headers
            .inner()
            .keys()
            .map(|name| name.as_str())
            .filter(|name| added_header(name))
            .collect();
        assert_eq!(added.len(), headers.inner().len() - 1, "{added:?}");
        assert!(!added_header("tenant"));
        assert!(!added_header(crate::transport::IDEMPOTENCY_KEY_HEADER));
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
