//! Stream replies taken apart: entry ids, XREADGROUP/XRANGE/XAUTOCLAIM entries with their raw
//! field bytes, field names decoded (or kept raw for a dead letter) and flat XINFO maps.

use std::collections::HashMap;

use redis::Value;

use super::super::{array, protocol, text};
use crate::transport::TransportError;

/// One stream entry as Redis returned it, field names and values as raw bytes (Redis allows any
/// bytes in both); `fields` is `None` for an entry deleted from the stream while it was pending.
#[derive(Debug)]
pub(in crate::transport::redis) struct RawEntry {
    pub(in crate::transport::redis) id: String,
    pub(in crate::transport::redis) fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

/// `ms-seq` → (ms, seq).
pub(in crate::transport::redis) fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

pub(super) fn into_array(value: Value) -> Option<Vec<Value>> {
    match value {
        Value::Array(items) => Some(items),
        _ => None,
    }
}

fn into_bytes(value: Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.into_bytes()),
        _ => None,
    }
}

pub(super) fn into_text(value: Value) -> Option<String> {
    into_bytes(value).and_then(|bytes| String::from_utf8(bytes).ok())
}

/// Stream entries, taken out of the reply without copying their bytes.
pub(in crate::transport::redis) fn parse_entries(
    command: &'static str,
    value: Value,
) -> Result<Vec<RawEntry>, TransportError> {
    let items = into_array(value).ok_or_else(|| protocol(command, "entries are not an array"))?;
    items
        .into_iter()
        .map(|entry| {
            let mut parts = into_array(entry)
                .ok_or_else(|| protocol(command, "entry is not an array"))?
                .into_iter();
            let id = parts
                .next()
                .and_then(into_text)
                .ok_or_else(|| protocol(command, "entry has no id"))?;
            let fields = match parts.next() {
                None | Some(Value::Nil) => None,
                Some(value) => {
                    let mut flat = into_array(value)
                        .ok_or_else(|| protocol(command, "fields are not an array"))?
                        .into_iter();
                    let mut pairs = Vec::with_capacity(flat.len() / 2);
                    while let (Some(name), Some(value)) = (flat.next(), flat.next()) {
                        let name =
                            into_bytes(name).ok_or_else(|| protocol(command, "field name"))?;
                        let value =
                            into_bytes(value).ok_or_else(|| protocol(command, "field value"))?;
                        pairs.push((name, value));
                    }
                    Some(pairs)
                }
            };
            Ok(RawEntry { id, fields })
        })
        .collect()
}

/// XREADGROUP's reply: nil on timeout, else `[[stream, entries]]`.
pub(super) fn parse_read_reply(value: Value) -> Result<Vec<RawEntry>, TransportError> {
    const COMMAND: &str = "XREADGROUP";
    match value {
        Value::Nil => Ok(Vec::new()),
        Value::Array(streams) => match streams.into_iter().next() {
            None => Ok(Vec::new()),
            Some(stream) => {
                let entries = into_array(stream)
                    .and_then(|parts| parts.into_iter().nth(1))
                    .ok_or_else(|| protocol(COMMAND, "no entries"))?;
                parse_entries(COMMAND, entries)
            }
        },
        _ => Err(protocol(COMMAND, "unexpected reply type")),
    }
}

/// Field names as text. An entry with a name that is not UTF-8 cannot become headers (nor
/// a body found by `bodyField`): its raw fields come back with the reason, for its dead letter.
#[allow(clippy::type_complexity)]
pub(super) fn decode_fields(
    fields: Vec<(Vec<u8>, Vec<u8>)>,
) -> Result<Vec<(String, Vec<u8>)>, (Vec<(Vec<u8>, Vec<u8>)>, String)> {
    if let Some(index) = fields
        .iter()
        .position(|(name, _)| std::str::from_utf8(name).is_err())
    {
        let reason = format!(
            "stream entry field name #{} is not valid UTF-8; the entry's fields are kept in the dead letter's body \
             (`{{\"fields\": [[name, value], …]}}`, non-UTF-8 names and values as `{{\"base64\": …}}`)",
            index + 1
        );
        return Err((fields, reason));
    }
    Ok(fields
        .into_iter()
        .map(|(name, value)| {
            let name = String::from_utf8(name).unwrap_or_default();
            (name, value)
        })
        .collect())
}

/// An undecodable entry's fields as a JSON document: `{"fields": [[name, value], …]}` in stream
/// order (names may repeat), each name and value a string when UTF-8, else `{"base64": …}`.
pub(super) fn raw_fields_json(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    use base64::Engine as _;
    let part = |bytes: &[u8]| match std::str::from_utf8(bytes) {
        Ok(text) => serde_json::Value::String(text.to_owned()),
        Err(_) => serde_json::json!({
            "base64": base64::engine::general_purpose::STANDARD.encode(bytes)
        }),
    };
    let pairs: Vec<serde_json::Value> = fields
        .iter()
        .map(|(name, value)| serde_json::json!([part(name), part(value)]))
        .collect();
    serde_json::json!({ "fields": pairs })
        .to_string()
        .into_bytes()
}

/// A flat `[name, value, name, value, …]` reply (XINFO) as a map.
pub(super) fn flat_map(value: &Value) -> HashMap<String, &Value> {
    array(value)
        .unwrap_or_default()
        .chunks_exact(2)
        .filter_map(|pair| Some((text(&pair[0])?, &pair[1])))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn read_reply_with_a_deleted_entry_parses() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![
                Value::Array(vec![
                    bulk("1-0"),
                    Value::Array(vec![bulk("body"), bulk("{}")]),
                ]),
                Value::Array(vec![bulk("2-0"), Value::Nil]),
            ]),
        ])]);
        let entries = parse_read_reply(reply).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(
            entries[0].fields.as_deref(),
            Some(&[(b"body".to_vec(), b"{}".to_vec())][..])
        );
        assert!(entries[1].fields.is_none());
    }

    #[test]
    fn a_field_name_that_is_not_utf8_is_kept_raw_not_a_protocol_error() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![
                    bulk("body"),
                    bulk("{}"),
                    Value::BulkString(vec![0xff, 0xfe]),
                    bulk("v"),
                ]),
            ])]),
        ])]);
        let mut entries = parse_read_reply(reply).expect("parses");
        let fields = entries.remove(0).fields.expect("fields");
        let (raw, reason) = decode_fields(fields).expect_err("undecodable");
        assert!(reason.contains("#2"), "{reason}");
        let json: serde_json::Value = serde_json::from_slice(&raw_fields_json(&raw)).expect("json");
        assert_eq!(
            json,
            serde_json::json!({"fields": [["body", "{}"], [{"base64": "//4="}, "v"]]})
        );
    }

    #[test]
    fn a_structurally_broken_reply_stays_a_protocol_error() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![Value::Array(vec![bulk("1-0"), Value::Int(3)])]),
        ])]);
        assert!(parse_read_reply(reply).is_err());
    }

    #[test]
    fn timeout_reply_is_empty() {
        assert!(parse_read_reply(Value::Nil).expect("nil").is_empty());
    }

    #[test]
    fn ids_parse_into_ms_and_seq() {
        assert_eq!(parse_id("1700000000000-7"), Some((1_700_000_000_000, 7)));
        assert_eq!(parse_id("garbage"), None);
    }
}
