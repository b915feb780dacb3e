//! Turning a message body into a todo payload (JSON text), or the reason it is poison.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use switchboard_api::PayloadFormat;

/// Why a message can never be stored. Poison is dead-lettered at once, never retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoisonReason {
    /// `payload.format: json` and the body is not valid JSON.
    InvalidJson,
    /// The body is larger than `payload.maxBytes`.
    Oversize,
    /// `payload.format: auto`, the body is neither JSON nor UTF-8 text.
    NotUtf8,
    /// The body holds a NUL character, which PostgreSQL cannot store in jsonb.
    NulCharacter,
    /// PostgreSQL refused the row.
    Rejected,
    /// Delivered more than `delivery.maxDeliveries` times without being stored.
    MaxDeliveries,
    /// The transport could not decode the message the broker delivered.
    Undecodable,
}

impl PoisonReason {
    pub const ALL: [PoisonReason; 7] = [
        PoisonReason::InvalidJson,
        PoisonReason::Oversize,
        PoisonReason::NotUtf8,
        PoisonReason::NulCharacter,
        PoisonReason::Rejected,
        PoisonReason::MaxDeliveries,
        PoisonReason::Undecodable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PoisonReason::InvalidJson => "invalid_json",
            PoisonReason::Oversize => "oversize",
            PoisonReason::NotUtf8 => "not_utf8",
            PoisonReason::NulCharacter => "nul_character",
            PoisonReason::Rejected => "rejected",
            PoisonReason::MaxDeliveries => "max_deliveries",
            PoisonReason::Undecodable => "undecodable",
        }
    }
}

/// A poison verdict with a human-readable explanation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    pub reason: PoisonReason,
    pub detail: String,
}

impl fmt::Display for Poison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.as_str(), self.detail)
    }
}

/// Returns the body as JSON text ready for a jsonb column.
pub fn payload_json(
    body: &[u8],
    format: PayloadFormat,
    max_bytes: usize,
) -> Result<String, Poison> {
    if body.len() > max_bytes {
        return Err(Poison {
            reason: PoisonReason::Oversize,
            detail: format!(
                "body is {} bytes; payload.maxBytes is {max_bytes}",
                body.len()
            ),
        });
    }
    let json_error = match serde_json::from_slice::<NulFreeJson>(body) {
        // Valid JSON is valid UTF-8.
        Ok(NulFreeJson) => return Ok(String::from_utf8_lossy(body).into_owned()),
        Err(err) if err.to_string().starts_with(NUL_MARKER) => return Err(nul_poison()),
        Err(err) => err,
    };
    if format == PayloadFormat::Json {
        return Err(Poison {
            reason: PoisonReason::InvalidJson,
            detail: format!("body is not valid JSON: {json_error}"),
        });
    }
    let text = std::str::from_utf8(body).map_err(|err| Poison {
        reason: PoisonReason::NotUtf8,
        detail: format!("body is neither JSON nor UTF-8 text: {err}"),
    })?;
    if text.contains('\0') {
        return Err(nul_poison());
    }
    Ok(serde_json::Value::String(text.to_owned()).to_string())
}

const NUL_MARKER: &str = "NUL character";

fn nul_poison() -> Poison {
    Poison {
        reason: PoisonReason::NulCharacter,
        detail: "body contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store"
            .into(),
    }
}

/// Validates JSON without building a tree, rejecting strings that contain NUL.
struct NulFreeJson;

impl<'de> Deserialize<'de> for NulFreeJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NulFreeVisitor)
    }
}

struct NulFreeVisitor;

impl NulFreeVisitor {
    fn check<E: de::Error>(text: &str) -> Result<NulFreeJson, E> {
        if text.contains('\0') {
            Err(E::custom(NUL_MARKER))
        } else {
            Ok(NulFreeJson)
        }
    }
}

impl<'de> Visitor<'de> for NulFreeVisitor {
    type Value = NulFreeJson;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<NulFreeJson, E> {
        Ok(NulFreeJson)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<NulFreeJson, E> {
        Ok(NulFreeJson)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<NulFreeJson, E> {
        Ok(NulFreeJson)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<NulFreeJson, E> {
        Ok(NulFreeJson)
    }
    fn visit_unit<E: de::Error>(self) -> Result<NulFreeJson, E> {
        Ok(NulFreeJson)
    }
    fn visit_str<E: de::Error>(self, text: &str) -> Result<NulFreeJson, E> {
        Self::check(text)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NulFreeJson, A::Error> {
        while seq.next_element::<NulFreeJson>()?.is_some() {}
        Ok(NulFreeJson)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NulFreeJson, A::Error> {
        while map.next_entry::<NulFreeJson, NulFreeJson>()?.is_some() {}
        Ok(NulFreeJson)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    #[test]
    fn json_body_is_kept_verbatim() {
        let body = br#"{"order": 7, "items": [1, 2.5, null, true]}"#;
        let json = payload_json(body, PayloadFormat::Json, MIB).expect("valid");
        assert_eq!(json.as_bytes(), body);
    }

    #[test]
    fn auto_wraps_plain_text_as_a_json_string() {
        let json = payload_json(b"hello \"world\"", PayloadFormat::Auto, MIB).expect("text");
        assert_eq!(json, r#""hello \"world\"""#);
    }

    #[test]
    fn strict_json_rejects_text() {
        let poison = payload_json(b"{not json", PayloadFormat::Json, MIB).expect_err("poison");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
    }

    #[test]
    fn escaped_nul_in_json_is_poison_in_both_formats() {
        for format in [PayloadFormat::Auto, PayloadFormat::Json] {
            let poison = payload_json(br#"{"a": "x\u0000y"}"#, format, MIB).expect_err("poison");
            assert_eq!(poison.reason, PoisonReason::NulCharacter);
        }
        let poison = payload_json(br#"{"a\u0000": 1}"#, PayloadFormat::Json, MIB).expect_err("key");
        assert_eq!(poison.reason, PoisonReason::NulCharacter);
    }

    #[test]
    fn escaped_backslash_before_u0000_is_not_nul() {
        let body = br#"{"a": "\\u0000"}"#;
        assert!(payload_json(body, PayloadFormat::Json, MIB).is_ok());
    }

    #[test]
    fn raw_nul_in_text_is_poison() {
        let poison = payload_json(b"a\0b", PayloadFormat::Auto, MIB).expect_err("poison");
        assert_eq!(poison.reason, PoisonReason::NulCharacter);
    }

    #[test]
    fn oversize_is_poison() {
        let poison = payload_json(b"12345", PayloadFormat::Auto, 4).expect_err("poison");
        assert_eq!(poison.reason, PoisonReason::Oversize);
    }

    #[test]
    fn binary_is_poison_under_auto() {
        let poison = payload_json(&[0xff, 0xfe, 0x01], PayloadFormat::Auto, MIB).expect_err("bin");
        assert_eq!(poison.reason, PoisonReason::NotUtf8);
    }
}

/// Encodes message fields as a JSON object's text: UTF-8 values as strings, others as
/// `{"base64": "…"}` so that nothing is lost.
pub fn fields_json(fields: &[(String, Vec<u8>)]) -> String {
    use base64::Engine as _;
    if fields.is_empty() {
        return "{}".to_owned();
    }
    let object: serde_json::Map<String, serde_json::Value> = fields
        .iter()
        .map(|(name, value)| {
            let value = match std::str::from_utf8(value) {
                Ok(text) => serde_json::Value::String(text.to_owned()),
                Err(_) => serde_json::json!({
                    "base64": base64::engine::general_purpose::STANDARD.encode(value)
                }),
            };
            (name.clone(), value)
        })
        .collect();
    serde_json::Value::Object(object).to_string()
}

#[cfg(test)]
mod fields_tests {
    use super::fields_json;

    #[test]
    fn fields_become_a_json_object_losslessly() {
        let fields = vec![
            ("kind".to_owned(), b"order".to_vec()),
            ("raw".to_owned(), vec![0xff, 0x00]),
        ];
        let json: serde_json::Value = serde_json::from_str(&fields_json(&fields)).expect("json");
        assert_eq!(json["kind"], "order");
        assert_eq!(json["raw"]["base64"], "/wA=");
    }
}
