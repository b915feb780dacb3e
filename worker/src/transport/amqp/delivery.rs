//! From a lapin `Delivery` to the pipeline's [`Message`]: the key, the headers, and the
//! delivery count.

use std::sync::Arc;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};

use crate::transport::Message;
use crate::transport::identity::{body_hash, body_id, idempotency_key};

/// The header quorum queues count deliveries in (absent on the first delivery).
pub const QUORUM_COUNT_HEADER: &str = "x-delivery-count";
/// The header the worker counts deliveries of classic-queue messages in: a redelivered message
/// without [`QUORUM_COUNT_HEADER`] is published again with this header one higher (see
/// [`Count::Recount`]).
pub const OWN_COUNT_HEADER: &str = "x-switchboard-deliveries";

/// What RabbitMQ needs to acknowledge one delivery, and what a dead letter copies.
#[derive(Debug, Clone)]
pub struct Receipt {
    /// The channel the delivery came on: tags of an earlier channel are stale.
    pub channel: u64,
    pub tag: u64,
    pub original: Arc<Original>,
}

/// Where a message was published and its properties, as delivered.
#[derive(Debug, PartialEq)]
pub struct Original {
    pub exchange: String,
    pub routing_key: String,
    pub properties: BasicProperties,
}

pub type AmqpDelivery = Message<Receipt>;

/// How often a message has been delivered, as far as the headers tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// This delivery's count.
    Known(u64),
    /// A classic-queue redelivery: RabbitMQ only says *redelivered*. The worker publishes the
    /// message again with [`OWN_COUNT_HEADER`] = `next` (and acknowledges this delivery once
    /// that is confirmed), so that the count survives worker crashes.
    Recount { next: u64 },
}

/// An integer header value, whatever integer type the publisher chose.
fn integer(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongString(v) => std::str::from_utf8(v.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(v) => v.as_str().parse().ok(),
        _ => None,
    }
}

fn header<'a>(headers: Option<&'a FieldTable>, name: &str) -> Option<&'a AMQPValue> {
    headers?.inner().get(name)
}

/// The delivery count: `x-delivery-count` + 1 where the queue counts (quorum queues; a missing
/// header on a first delivery is 0), else the worker's own header (1 when absent), and a
/// redelivery without either count is recounted.
pub fn count(redelivered: bool, headers: Option<&FieldTable>) -> Count {
    if let Some(quorum) = header(headers, QUORUM_COUNT_HEADER).and_then(integer) {
        return Count::Known(quorum.saturating_add(1));
    }
    let own = header(headers, OWN_COUNT_HEADER)
        .and_then(integer)
        .unwrap_or(1)
        .max(1);
    if redelivered {
        Count::Recount {
            next: own.saturating_add(1),
        }
    } else {
        Count::Known(own)
    }
}

/// A header value as bytes: strings as they are, numbers and booleans as text, anything else
/// as JSON.
fn value_bytes(value: &AMQPValue) -> Vec<u8> {
    match value {
        AMQPValue::LongString(v) => v.as_bytes().to_vec(),
        AMQPValue::ShortString(v) => v.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(v) => v.as_slice().to_vec(),
        AMQPValue::Boolean(v) => v.to_string().into_bytes(),
        AMQPValue::Float(v) => v.to_string().into_bytes(),
        AMQPValue::Double(v) => v.to_string().into_bytes(),
        AMQPValue::Timestamp(v) => v.to_string().into_bytes(),
        other => match integer(other) {
            Some(n) => n.to_string().into_bytes(),
            None => serde_json::to_vec(other).unwrap_or_default(),
        },
    }
}

/// Every property that is set, then every header but the delivery counts, as event headers.
pub fn headers(original: &Original) -> Vec<(String, Vec<u8>)> {
    let p = &original.properties;
    let text = |name: &str, value: &Option<lapin::types::ShortString>| {
        value
            .as_ref()
            .map(|v| (name.to_owned(), v.as_str().as_bytes().to_vec()))
    };
    let number = |name: &str, value: Option<u64>| {
        value.map(|v| (name.to_owned(), v.to_string().into_bytes()))
    };
    let mut fields: Vec<(String, Vec<u8>)> = [
        Some(("exchange".to_owned(), original.exchange.as_bytes().to_vec())),
        Some((
            "routing-key".to_owned(),
            original.routing_key.as_bytes().to_vec(),
        )),
        text("content-type", p.content_type()),
        text("content-encoding", p.content_encoding()),
        number("delivery-mode", p.delivery_mode().map(u64::from)),
        number("priority", p.priority().map(u64::from)),
        text("correlation-id", p.correlation_id()),
        text("reply-to", p.reply_to()),
        text("expiration", p.expiration()),
        text("message-id", p.message_id()),
        number("timestamp", *p.timestamp()),
        text("type", p.kind()),
        text("user-id", p.user_id()),
        text("app-id", p.app_id()),
        text("cluster-id", p.cluster_id()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if let Some(table) = p.headers() {
        fields.extend(
            table
                .inner()
                .iter()
                .filter(|(name, _)| {
                    name.as_str() != QUORUM_COUNT_HEADER && name.as_str() != OWN_COUNT_HEADER
                })
                .map(|(name, value)| (name.as_str().to_owned(), value_bytes(value))),
        );
    }
    fields
}

/// The message's id within the source: its `message-id` property, else the body's hash (two
/// messages with the same body and no `message-id` are then one message).
pub fn external_id(properties: &BasicProperties, body: &[u8]) -> String {
    match properties
        .message_id()
        .as_ref()
        .filter(|id| !id.as_str().is_empty())
    {
        Some(id) => id.as_str().to_owned(),
        None => body_id(&body_hash(body)),
    }
}

/// What [`convert`] needs to know about the source.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    /// `amqp:{adapter}:{queue}` ([`crate::transport::Transport::key_scope`]).
    pub key_scope: &'a str,
    /// The channel generation the deliveries came on.
    pub channel: u64,
}

/// Converts one delivery whose count is known.
pub fn convert(
    origin: Origin<'_>,
    tag: u64,
    original: Original,
    body: Vec<u8>,
    delivery_count: u64,
) -> AmqpDelivery {
    let external_id = external_id(&original.properties, &body);
    let enqueued_at_ms = original
        .properties
        .timestamp()
        .and_then(|seconds| seconds.checked_mul(1000));
    let headers = headers(&original);
    Message {
        receipt: Receipt {
            channel: origin.channel,
            tag,
            original: Arc::new(original),
        },
        idempotency_key: idempotency_key(origin.key_scope, &external_id),
        external_id,
        body,
        headers,
        delivery_count,
        enqueued_at_ms,
        position: None,
        undecodable: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: &[(&str, AMQPValue)]) -> FieldTable {
        let mut table = FieldTable::default();
        for (name, value) in entries {
            table.insert((*name).into(), value.clone());
        }
        table
    }

    #[test]
    fn quorum_count_header_is_deliveries_before_this_one() {
        assert_eq!(count(false, None), Count::Known(1), "missing header = 0");
        let headers = table(&[(QUORUM_COUNT_HEADER, AMQPValue::LongLongInt(2))]);
        assert_eq!(count(true, Some(&headers)), Count::Known(3));
    }

    #[test]
    fn classic_redelivery_without_a_count_is_recounted_from_the_own_header() {
        assert_eq!(count(true, None), Count::Recount { next: 2 });
        let headers = table(&[(OWN_COUNT_HEADER, AMQPValue::LongLongInt(4))]);
        assert_eq!(count(false, Some(&headers)), Count::Known(4));
        assert_eq!(count(true, Some(&headers)), Count::Recount { next: 5 });
    }

    #[test]
    fn message_id_names_the_message_else_the_body_hash_does() {
        let origin = Origin {
            key_scope: "amqp:shop/orders:orders",
            channel: 1,
        };
        let original = |id: Option<&str>| Original {
            exchange: "shop".into(),
            routing_key: "orders.new".into(),
            properties: match id {
                Some(id) => BasicProperties::default().with_message_id(id.into()),
                None => BasicProperties::default(),
            },
        };
        let with_id = convert(origin, 7, original(Some("m-1")), b"{}".to_vec(), 1);
        assert_eq!(with_id.idempotency_key, "amqp:shop/orders:orders:m-1");
        let without = convert(origin, 8, original(None), b"abc".to_vec(), 1);
        assert_eq!(
            without.external_id,
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn properties_and_headers_become_event_headers_without_the_counts() {
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_timestamp(1_700_000_000)
            .with_headers(table(&[
                ("tenant", AMQPValue::LongString("acme".into())),
                ("attempt", AMQPValue::LongInt(3)),
                (QUORUM_COUNT_HEADER, AMQPValue::LongLongInt(1)),
                (OWN_COUNT_HEADER, AMQPValue::LongLongInt(2)),
            ]));
        let original = Original {
            exchange: String::new(),
            routing_key: "orders".into(),
            properties,
        };
        let fields = headers(&original);
        let get = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        assert_eq!(get("content-type").as_deref(), Some("application/json"));
        assert_eq!(get("timestamp").as_deref(), Some("1700000000"));
        assert_eq!(get("tenant").as_deref(), Some("acme"));
        assert_eq!(get("attempt").as_deref(), Some("3"));
        assert_eq!(get("routing-key").as_deref(), Some("orders"));
        assert_eq!(get(QUORUM_COUNT_HEADER), None);
        assert_eq!(get(OWN_COUNT_HEADER), None);
    }
}
