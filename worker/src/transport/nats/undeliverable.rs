//! Deliveries the client cannot decode. `async-nats` 0.51 reads a delivery's header block as
//! UTF-8 and parses each line into a header name and value (`Connection::try_read_op`); a block
//! that is not UTF-8 (a Go producer can publish any bytes) or a line it cannot parse is an I/O
//! error, and the client drops the whole connection for it: the message never reaches the
//! worker, and what followed it on the connection is lost with it (the server redelivers those
//! after AckWait). The library offers no hook to receive such a frame, so after each re-binding
//! the worker looks at the deliveries the server holds for the consumer (above its ack floor,
//! up to its last delivered sequence) that it never received, through the stream's JSON message
//! API (`STREAM.MSG.GET`, headers in base64, never a raw frame), and delivers each one the
//! client would refuse as undecodable: it is dead-lettered with its body byte-identical and its
//! raw header block in base64, then terminated by its stream sequence.

use std::collections::BTreeMap;
use std::str::FromStr as _;

use async_nats::Subject;
use async_nats::datetime::DateTime;
use async_nats::jetstream::{self, consumer};
use base64::Engine as _;
use serde::Deserialize;

use super::{Identity, NatsDelivery, Receipt};
use crate::transport::TransportError;

/// How many stream messages one look reads at most.
const MAX_READS: u64 = 1_000;
/// The header of the dead letter holding the raw header block, in base64.
pub const RAW_HEADERS: &str = "Switchboard-Raw-Headers-Base64";

#[derive(Debug, Deserialize)]
struct MessageReply {
    message: Option<StoredMessage>,
}

#[derive(Debug, Deserialize)]
struct StoredMessage {
    subject: String,
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
    /// RFC 3339.
    time: String,
}

/// Why `async-nats` would refuse a delivery with this header block (and drop its connection),
/// if it would: the same checks as its parser.
pub fn refusal(block: &[u8]) -> Option<String> {
    let Ok(text) = std::str::from_utf8(block) else {
        return Some("its header block is not UTF-8".to_owned());
    };
    let mut lines = text.lines();
    if !lines
        .next()
        .is_some_and(|line| line.starts_with("NATS/1.0"))
    {
        return Some("its header block does not begin with NATS/1.0".to_owned());
    }
    for line in lines.filter(|line| !line.is_empty()) {
        if line.starts_with(char::is_whitespace) {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else {
            return Some("a header line has no ':'".to_owned());
        };
        if async_nats::HeaderName::from_str(name).is_err() {
            return Some("a header name is not a valid header name".to_owned());
        }
    }
    None
}

/// The deliveries of the consumer `info` describes that the worker does not hold (`held`) and
/// the client would refuse.
pub async fn find(
    js: &jetstream::Context,
    spec: &switchboard_api::NatsSource,
    info: &consumer::Info,
    held: &BTreeMap<u64, Subject>,
    identity: &Identity<'_>,
) -> Result<Vec<NatsDelivery>, TransportError> {
    let last = info.delivered.stream_sequence;
    let mut seq = info.ack_floor.stream_sequence + 1;
    let mut found = Vec::new();
    let mut reads = 0;
    while seq <= last && reads < MAX_READS {
        reads += 1;
        let mut request = serde_json::json!({ "seq": seq });
        if let Some(filter) = &spec.filter_subject {
            request["next_by_subj"] = filter.clone().into();
        }
        let reply: serde_json::Value = js
            .request(format!("STREAM.MSG.GET.{}", spec.stream), &request)
            .await
            .map_err(|err| {
                TransportError::transient("could not read a message of the NATS stream", err)
            })?;
        let Some(message) = serde_json::from_value::<MessageReply>(reply)
            .ok()
            .and_then(|reply| reply.message)
        else {
            // No message at or after `seq` (deleted, or past the end).
            if spec.filter_subject.is_some() {
                break;
            }
            seq += 1;
            continue;
        };
        seq = message.seq + 1;
        if message.seq > last || held.contains_key(&message.seq) {
            continue;
        }
        let decode = |text: &Option<String>| {
            base64::engine::general_purpose::STANDARD
                .decode(text.as_deref().unwrap_or_default())
                .unwrap_or_default()
        };
        let block = decode(&message.hdrs);
        let Some(reason) = refusal(&block) else {
            continue;
        };
        // The server takes an acknowledgement by the stream sequence in its reply subject
        // (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`).
        let reply = format!(
            "$JS.ACK.{}.{}.1.{}.{}.0.0",
            spec.stream, spec.consumer, message.seq, message.seq
        );
        let mut delivery = identity.message(
            Receipt {
                reply: reply.into(),
                stream_sequence: message.seq,
                subject: message.subject.into(),
            },
            decode(&message.data),
            vec![(
                RAW_HEADERS.to_owned(),
                base64::engine::general_purpose::STANDARD
                    .encode(&block)
                    .into_bytes(),
            )],
            1,
            humantime::parse_rfc3339_weak(&message.time)
                .map_or_else(|_| DateTime::now_utc(), DateTime::from),
        );
        delivery.undecodable = Some(format!(
            "the NATS client cannot decode this delivery ({reason}; it drops the connection for it); raw header block in {RAW_HEADERS}"
        ));
        found.push(delivery);
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_the_client_would_refuse_is_named() {
        assert_eq!(refusal(b"NATS/1.0\r\ntenant: acme\r\n\r\n"), None);
        assert_eq!(
            refusal(b"NATS/1.0\r\ntrace: \xff\xfe\r\n\r\n").as_deref(),
            Some("its header block is not UTF-8")
        );
        assert!(refusal(b"NATS/1.0\r\nno colon here\r\n\r\n").is_some());
    }
}
