//! Turning a message body into a todo payload (JSON text), or the reason it is poison.

use std::fmt;

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
    /// `payload.envelope` is set and the message does not fit it (a CloudEvent without `id`,
    /// a body that is not an SNS notification, …).
    Envelope,
}

impl PoisonReason {
    pub const ALL: [PoisonReason; 8] = [
        PoisonReason::InvalidJson,
        PoisonReason::Oversize,
        PoisonReason::NotUtf8,
        PoisonReason::NulCharacter,
        PoisonReason::Rejected,
        PoisonReason::MaxDeliveries,
        PoisonReason::Undecodable,
        PoisonReason::Envelope,
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
            PoisonReason::Envelope => "envelope",
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
    check_size(body, max_bytes)?;
    let json_error = match check_json(body) {
        Ok(text) => return Ok(text.to_owned()),
        Err(JsonError::Nul) => return Err(nul_poison()),
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

/// Fails when `body` is larger than `payload.maxBytes`.
pub fn check_size(body: &[u8], max_bytes: usize) -> Result<(), Poison> {
    if body.len() > max_bytes {
        return Err(Poison {
            reason: PoisonReason::Oversize,
            detail: format!(
                "body is {} bytes; payload.maxBytes is {max_bytes}",
                body.len()
            ),
        });
    }
    Ok(())
}

fn nul_poison() -> Poison {
    Poison {
        reason: PoisonReason::NulCharacter,
        detail: "body contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store"
            .into(),
    }
}

/// Why a body is not JSON that PostgreSQL's jsonb reads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum JsonError {
    /// A `\u0000` escape: valid JSON, but jsonb refuses it.
    Nul,
    NotUtf8(std::str::Utf8Error),
    Syntax {
        problem: &'static str,
        line: usize,
        column: usize,
    },
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::Nul => f.write_str("a string holds \\u0000"),
            JsonError::NotUtf8(err) => write!(f, "not UTF-8: {err}"),
            JsonError::Syntax {
                problem,
                line,
                column,
            } => write!(f, "{problem} at line {line} column {column}"),
        }
    }
}

/// Checks that `body` is one JSON text (RFC 8259, the grammar PostgreSQL's json parser reads)
/// without building values: numbers of any size and magnitude are accepted (jsonb stores them
/// as `numeric`, which decides what is too large), and nesting is followed on a heap stack, not
/// by recursion, so depth costs one byte per level. Returns the body as text (valid JSON is
/// valid UTF-8).
fn check_json(body: &[u8]) -> Result<&str, JsonError> {
    let text = std::str::from_utf8(body).map_err(JsonError::NotUtf8)?;
    let mut scanner = Scanner {
        bytes: text.as_bytes(),
        pos: 0,
    };
    // The open containers, innermost last: b'[' or b'{'.
    let mut open: Vec<u8> = Vec::new();
    'value: loop {
        scanner.skip_whitespace();
        match scanner.peek() {
            Some(b'{') => {
                scanner.pos += 1;
                scanner.skip_whitespace();
                if scanner.peek() == Some(b'}') {
                    scanner.pos += 1;
                } else {
                    open.push(b'{');
                    scanner.member_key()?;
                    continue 'value;
                }
            }
            Some(b'[') => {
                scanner.pos += 1;
                scanner.skip_whitespace();
                if scanner.peek() == Some(b']') {
                    scanner.pos += 1;
                } else {
                    open.push(b'[');
                    continue 'value;
                }
            }
            Some(b'"') => scanner.string()?,
            Some(b'-' | b'0'..=b'9') => scanner.number()?,
            Some(b't') => scanner.literal("true")?,
            Some(b'f') => scanner.literal("false")?,
            Some(b'n') => scanner.literal("null")?,
            Some(_) => return Err(scanner.error("expected a JSON value")),
            None => return Err(scanner.error("expected a JSON value, found the end")),
        }
        // A value is complete: close every container it completes.
        loop {
            scanner.skip_whitespace();
            let Some(&container) = open.last() else {
                return match scanner.peek() {
                    None => Ok(text),
                    Some(_) => Err(scanner.error("trailing characters after the JSON value")),
                };
            };
            let close = if container == b'[' { b']' } else { b'}' };
            match scanner.peek() {
                Some(b',') => {
                    scanner.pos += 1;
                    if container == b'{' {
                        scanner.skip_whitespace();
                        scanner.member_key()?;
                    }
                    continue 'value;
                }
                Some(byte) if byte == close => {
                    scanner.pos += 1;
                    open.pop();
                }
                _ if container == b'[' => return Err(scanner.error("expected ',' or ']'")),
                _ => return Err(scanner.error("expected ',' or '}'")),
            }
        }
    }
}

struct Scanner<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn error(&self, problem: &'static str) -> JsonError {
        let before = &self.bytes[..self.pos.min(self.bytes.len())];
        let line = 1 + before.iter().filter(|&&b| b == b'\n').count();
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        // Columns count characters, not bytes (the text is UTF-8).
        let column = 1 + before[line_start..]
            .iter()
            .filter(|&&b| b & 0xc0 != 0x80)
            .count();
        JsonError::Syntax {
            problem,
            line,
            column,
        }
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// An object member's key and its colon.
    fn member_key(&mut self) -> Result<(), JsonError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string as object key"));
        }
        self.string()?;
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return Err(self.error("expected ':' after object key"));
        }
        self.pos += 1;
        Ok(())
    }

    fn literal(&mut self, word: &'static str) -> Result<(), JsonError> {
        if self.bytes[self.pos..].starts_with(word.as_bytes()) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("expected a JSON value"))
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Result<(), JsonError> {
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.error("expected a digit")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return Err(self.error("expected a digit after the decimal point"));
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.error("expected a digit in the exponent"));
            }
        }
        Ok(())
    }

    /// A string from its opening quote: escapes must be valid, control characters escaped,
    /// surrogate escapes paired; `\u0000` is [`JsonError::Nul`].
    fn string(&mut self) -> Result<(), JsonError> {
        self.pos += 1;
        loop {
            match self.peek() {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(());
                }
                Some(b'\\') => {
                    self.pos += 1;
                    match self.peek() {
                        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                            self.pos += 1;
                        }
                        Some(b'u') => self.unicode_escape()?,
                        _ => return Err(self.error("invalid escape in string")),
                    }
                }
                Some(0x00..=0x1f) => {
                    return Err(self.error("control character in string must be escaped"));
                }
                Some(_) => self.pos += 1,
            }
        }
    }

    /// `uXXXX` after a backslash; a high surrogate must be followed by `\uXXXX` with a low one.
    fn unicode_escape(&mut self) -> Result<(), JsonError> {
        let unit = self.hex4()?;
        match unit {
            0 => Err(JsonError::Nul),
            0xd800..=0xdbff => {
                if self.bytes[self.pos..].starts_with(b"\\u") {
                    self.pos += 1;
                    if let 0xdc00..=0xdfff = self.hex4()? {
                        return Ok(());
                    }
                }
                Err(self.error("unpaired high surrogate in \\u escape"))
            }
            0xdc00..=0xdfff => Err(self.error("unpaired low surrogate in \\u escape")),
            _ => Ok(()),
        }
    }

    /// `u` and four hex digits: the UTF-16 code unit.
    fn hex4(&mut self) -> Result<u16, JsonError> {
        let digits = self
            .bytes
            .get(self.pos + 1..self.pos + 5)
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u16::from_str_radix(hex, 16).ok())
            .ok_or_else(|| self.error("expected four hex digits after \\u"))?;
        self.pos += 5;
        Ok(digits)
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
    fn numbers_beyond_f64_are_stored_as_json_in_both_formats() {
        let long_integer = format!("[{}]", "9".repeat(400));
        for body in [
            "1e400",
            "-1.5E+400",
            "1e-400",
            "[1e400, 2]",
            long_integer.as_str(),
        ] {
            for format in [PayloadFormat::Auto, PayloadFormat::Json] {
                let json = payload_json(body.as_bytes(), format, MIB).expect(body);
                assert_eq!(json, body, "{format:?}: stored verbatim, not as a string");
            }
        }
    }

    fn nested(depth: usize, open: &str, close: &str) -> String {
        format!("{}{}", open.repeat(depth), close.repeat(depth))
    }

    #[test]
    fn deeply_nested_json_is_stored_as_json_in_both_formats() {
        let arrays = nested(1000, "[", "]");
        let objects = format!("{}1{}", r#"{"a":"#.repeat(1000), "}".repeat(1000));
        for body in [&arrays, &objects] {
            for format in [PayloadFormat::Auto, PayloadFormat::Json] {
                let json = payload_json(body.as_bytes(), format, MIB).expect("valid");
                assert_eq!(&json, body, "{format:?}");
            }
        }
    }

    #[test]
    fn nesting_deeper_than_any_stack_is_checked_without_recursion() {
        // A recursive checker overflows the test thread's stack long before a million levels.
        let body = nested(1_000_000, "[", "]");
        assert!(payload_json(body.as_bytes(), PayloadFormat::Json, 4 * MIB).is_ok());
        let unclosed = "[".repeat(1_000_000);
        let poison =
            payload_json(unclosed.as_bytes(), PayloadFormat::Json, 4 * MIB).expect_err("open");
        assert_eq!(poison.reason, PoisonReason::InvalidJson);
    }

    const NOT_JSON: &[&str] = &[
        "",
        "  ",
        "[1,]",
        "[1 2]",
        "{\"a\" 1}",
        "{\"a\":1,}",
        "{a:1}",
        "{1:1}",
        "01",
        "1.",
        ".5",
        "-",
        "+1",
        "1e",
        "1e+",
        "NaN",
        "Infinity",
        "tru",
        "truex",
        "nul",
        "'a'",
        "\"unterminated",
        "\"bad \\x escape\"",
        "\"raw\nnewline\"",
        "\"tab\tinside\"",
        "\"\\ud800\"",
        "\"\\udc00\"",
        "\"\\ud800\\u0041\"",
        "\"\\u12\"",
        "[[]",
        "[]]",
        "{}}",
        "1 2",
        "\u{feff}1",
    ];

    #[test]
    fn malformed_json_is_invalid_under_json_and_a_string_under_auto() {
        for body in NOT_JSON {
            let poison = payload_json(body.as_bytes(), PayloadFormat::Json, MIB)
                .expect_err(&format!("{body:?} is not JSON"));
            assert_eq!(poison.reason, PoisonReason::InvalidJson, "{body:?}");
            let json = payload_json(body.as_bytes(), PayloadFormat::Auto, MIB).expect(body);
            assert_eq!(
                serde_json::from_str::<String>(&json).expect("a JSON string"),
                *body
            );
        }
    }

    #[test]
    fn valid_json_of_every_kind_is_kept_verbatim() {
        for body in [
            " {\"a\" : [ 1 , -0.5e-3 , true , false , null ] , \"b\" : { } }\r\n",
            "\"\\ud83d\\ude00 \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9\"",
            "\"raw é ✓ 😀\"",
            "[]",
            "0",
            "-0",
            "\"\"",
            "{\"dup\":1,\"dup\":2}",
        ] {
            assert_eq!(
                payload_json(body.as_bytes(), PayloadFormat::Json, MIB).as_deref(),
                Ok(body)
            );
        }
    }

    #[test]
    fn checker_agrees_with_serde_json_within_its_limits() {
        for body in NOT_JSON
            .iter()
            .chain(&["[1, {\"a\": [null]}]", "\"\\ud83d\\ude00\""])
        {
            assert_eq!(
                check_json(body.as_bytes()).is_ok(),
                serde_json::from_str::<serde_json::Value>(body).is_ok(),
                "{body:?}"
            );
        }
    }

    #[test]
    fn syntax_error_detail_gives_line_and_column() {
        let poison = payload_json(b"{\n  \"\xc3\xa9\": tru\n}", PayloadFormat::Json, MIB)
            .expect_err("poison");
        assert_eq!(
            poison.detail,
            "body is not valid JSON: expected a JSON value at line 2 column 8"
        );
    }

    #[test]
    fn nul_escape_is_poison_even_in_a_deep_array() {
        let body = format!("{}\"\\u0000\"{}", "[".repeat(500), "]".repeat(500));
        let poison = payload_json(body.as_bytes(), PayloadFormat::Auto, MIB).expect_err("poison");
        assert_eq!(poison.reason, PoisonReason::NulCharacter);
    }

    #[test]
    fn binary_is_poison_under_auto() {
        let poison = payload_json(&[0xff, 0xfe, 0x01], PayloadFormat::Auto, MIB).expect_err("bin");
        assert_eq!(poison.reason, PoisonReason::NotUtf8);
    }
}

/// Puts `body` into a JSON object losslessly: as `body` when it is UTF-8, else as `body_base64`.
pub fn insert_body(object: &mut serde_json::Value, body: &[u8]) {
    use base64::Engine as _;
    match std::str::from_utf8(body) {
        Ok(text) => object["body"] = text.into(),
        Err(_) => {
            object["body_base64"] = base64::engine::general_purpose::STANDARD
                .encode(body)
                .into();
        }
    }
}

/// The prefix of a field name that PostgreSQL cannot hold as it is (it contains NUL), followed
/// by the name's bytes in base64 (see [`fields_json`]).
pub const BASE64_NAME_PREFIX: &str = "base64:";

/// Encodes message fields as a JSON object's text that PostgreSQL's jsonb accepts, losslessly:
/// values that are UTF-8 without NUL as strings, others as `{"base64": "…"}`; a name holding
/// NUL (jsonb refuses `\u0000`) as `base64:` and the name's bytes in base64.
pub fn fields_json(fields: &[(String, Vec<u8>)]) -> String {
    use base64::Engine as _;
    let base64 = &base64::engine::general_purpose::STANDARD;
    let names: Vec<std::borrow::Cow<'_, str>> = fields
        .iter()
        .map(|(name, _)| {
            if name.contains('\0') {
                format!("{BASE64_NAME_PREFIX}{}", base64.encode(name)).into()
            } else {
                name.as_str().into()
            }
        })
        .collect();
    // The object a JSON map of them would be, written directly: names in order, the last of
    // equal names kept (a stable sort keeps equal names in their order).
    let mut sorted: Vec<(&str, &[u8])> = names
        .iter()
        .zip(fields)
        .map(|(name, (_, value))| (name.as_ref(), value.as_slice()))
        .collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = Vec::with_capacity(
        2 + fields
            .iter()
            .map(|(name, value)| name.len() + value.len() + 6)
            .sum::<usize>(),
    );
    out.push(b'{');
    for (index, (name, value)) in sorted.iter().enumerate() {
        if sorted.get(index + 1).is_some_and(|next| next.0 == *name) {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        write_json_string(&mut out, name);
        out.push(b':');
        match std::str::from_utf8(value) {
            Ok(text) if !text.contains('\0') => write_json_string(&mut out, text),
            _ => {
                out.extend_from_slice(br#"{"base64":"#);
                write_json_string(&mut out, &base64.encode(value));
                out.push(b'}');
            }
        }
    }
    out.push(b'}');
    String::from_utf8(out).unwrap_or_default()
}

/// `text` as PostgreSQL's `text` can hold it: unchanged unless it contains NUL, which no text
/// column takes; then `base64:` and its bytes in base64 (an id or key with NUL, from a binary
/// Kafka key or a producer's header, is stored under that form, the same at every delivery).
pub fn storable_text(text: &str) -> std::borrow::Cow<'_, str> {
    use base64::Engine as _;
    if text.contains('\0') {
        format!(
            "{BASE64_NAME_PREFIX}{}",
            base64::engine::general_purpose::STANDARD.encode(text)
        )
        .into()
    } else {
        text.into()
    }
}

/// Appends `text` as a JSON string (quoted and escaped).
fn write_json_string(out: &mut Vec<u8>, text: &str) {
    // Writing a `str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(out, text);
}

#[cfg(test)]
mod fields_tests {
    use super::{fields_json, storable_text};

    #[test]
    fn nul_in_a_value_or_a_name_is_encoded_not_refused() {
        let fields = vec![
            ("trace".to_owned(), b"a\0b".to_vec()),
            ("bad\0name".to_owned(), b"v".to_vec()),
        ];
        let json = fields_json(&fields);
        assert!(!json.contains("\\u0000"), "jsonb refuses \\u0000: {json}");
        let object: serde_json::Value = serde_json::from_str(&json).expect("json");
        assert_eq!(object["trace"]["base64"], "YQBi");
        assert_eq!(object["base64:YmFkAG5hbWU="], "v");
    }

    #[test]
    fn text_with_nul_is_stored_in_base64_and_other_text_unchanged() {
        assert_eq!(storable_text("kafka:a/b:0:17"), "kafka:a/b:0:17");
        assert_eq!(storable_text("k\0"), "base64:awA=");
        assert_eq!(
            storable_text("k\0"),
            storable_text("k\0"),
            "the same at every delivery"
        );
    }

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

    #[test]
    fn fields_are_written_as_a_json_map_would_write_them() {
        let fields = vec![
            ("z".to_owned(), b"last".to_vec()),
            (
                "a \"quoted\"\n".to_owned(),
                "caf\u{e9} \u{1}".as_bytes().to_vec(),
            ),
            ("dup".to_owned(), b"first".to_vec()),
            ("b".to_owned(), vec![0xc3]),
            ("dup".to_owned(), b"second".to_vec()),
        ];
        let map: serde_json::Map<String, serde_json::Value> = fields
            .iter()
            .map(|(name, value)| {
                let value = match std::str::from_utf8(value) {
                    Ok(text) => serde_json::Value::from(text),
                    Err(_) => serde_json::json!({ "base64": "ww==" }),
                };
                (name.clone(), value)
            })
            .collect();
        assert_eq!(
            fields_json(&fields),
            serde_json::Value::Object(map).to_string()
        );
        assert_eq!(fields_json(&[]), "{}");
    }
}
