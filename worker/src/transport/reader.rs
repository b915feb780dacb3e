//! What every transport's dead-letter destination offers `switchboard-worker dlq` (which sits
//! above the transports and filters, prints and paces what their readers find): one letter as a
//! reader found it, the reader trait, and the helpers readers share.

use super::identity::{id_in_scope, idempotency_key};
use super::{Attempts, TransportError};

/// One dead letter as a reader found it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredLetter {
    /// The letter's id in its destination: a stream entry id, an SQS message id, the first 16
    /// hex digits of a list record's SHA-256.
    pub id: String,
    /// When it was dead-lettered (Unix ms), where known.
    pub dead_lettered_at_ms: Option<u64>,
    pub reason: Option<String>,
    pub delivery_count: Option<u64>,
    pub last_error: Option<String>,
    /// The original body, byte-for-byte.
    pub body: Vec<u8>,
    /// The original message's fields, attributes or headers, byte-for-byte.
    pub headers: Vec<(String, Vec<u8>)>,
    pub attempts: Option<Attempts>,
    /// Where it came from, for people (`stream orders, entry 1764…-0`).
    pub origin: String,
    /// The original message's id where the broker has native ids: its redriven copy carries
    /// the key made from it.
    pub original_id: Option<String>,
    /// What the reader needs to redrive or remove it (never printed).
    pub(crate) handle: String,
}

/// Where the next page of a listing starts; what it holds is the reader's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor(pub(crate) String);

/// Some dead letters, oldest first, and where the next page starts (`None`: none is left).
/// A page may be shorter than asked for, even empty, while `next` is `Some`.
#[derive(Debug, Default)]
pub struct Page {
    pub letters: Vec<StoredLetter>,
    pub next: Option<Cursor>,
}

/// What every transport's dead-letter destination can do. The commands read it a page at a
/// time, so what they hold is a page, whatever the destination's size.
#[allow(async_fn_in_trait)]
pub trait DeadLetterReader {
    /// The dead-letter destination, for people (`Redis stream orders.dlq`).
    fn destination(&self) -> String;
    /// Where redrive puts letters back, for people.
    fn source(&self) -> String;
    /// What to know before redriving (ordering, FIFO groups).
    fn caveats(&self) -> Vec<String>;
    /// How many letters the destination holds, where the broker says so without handing them
    /// out (SQS: approximately); `None` where it cannot.
    async fn count(&mut self) -> Result<Option<u64>, TransportError>;
    /// At most `limit` letters after `after` (from the oldest when `None`).
    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError>;
    /// The letter `id`, if the destination holds it. By default it is looked for page by page
    /// (the time grows with the letters before it, the memory does not), handing back each
    /// page that does not hold it; a reader whose broker can look a letter up by its id does.
    async fn letter(&mut self, id: &str) -> Result<Option<StoredLetter>, TransportError> {
        let mut after = None;
        loop {
            let Page { letters, next } = self.page(after.as_ref(), SCAN_PAGE).await?;
            let (found, others): (Vec<StoredLetter>, Vec<StoredLetter>) =
                letters.into_iter().partition(|letter| letter.id == id);
            self.release(&others).await?;
            if let Some(letter) = found.into_iter().next() {
                return Ok(Some(letter));
            }
            match next {
                Some(cursor) => after = Some(cursor),
                None => return Ok(None),
            }
        }
    }
    /// Publishes `letter` to the source, waits for the broker's confirmation, and only then
    /// removes it from the destination.
    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError>;
    /// Removes `letters` from the destination.
    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError>;
    /// Hands back letters read and neither redriven nor removed (SQS hides what it hands out).
    async fn release(&mut self, _letters: &[StoredLetter]) -> Result<(), TransportError> {
        Ok(())
    }
}

/// Letters per page when a reader looks for one letter page by page.
pub const SCAN_PAGE: usize = 100;

/// The idempotency key a redriven copy carries: the one the letter's original already carried
/// (it was itself a redriven copy), else the key of its original id.
pub fn redrive_key(headers: &[(String, Vec<u8>)], source: &str, original_id: &str) -> String {
    headers
        .iter()
        .find(|(name, _)| name == super::IDEMPOTENCY_KEY_HEADER)
        .and_then(|(_, value)| std::str::from_utf8(value).ok())
        .filter(|key| id_in_scope(key, source).is_some())
        .map_or_else(|| idempotency_key(source, original_id), str::to_owned)
}

/// Headers from their JSON form in a dead letter (`{"name": "text" | {"base64": …}}`, as
/// [`crate::payload::fields_json`] writes them).
pub fn headers_from_json(text: &str) -> Vec<(String, Vec<u8>)> {
    use base64::Engine as _;
    let Ok(serde_json::Value::Object(object)) = serde_json::from_str(text) else {
        return Vec::new();
    };
    object
        .into_iter()
        .filter_map(|(name, value)| {
            let bytes = match value {
                serde_json::Value::String(text) => text.into_bytes(),
                serde_json::Value::Object(encoded) => base64::engine::general_purpose::STANDARD
                    .decode(encoded.get("base64")?.as_str()?)
                    .ok()?,
                _ => return None,
            };
            Some((original_name(name), bytes))
        })
        .collect()
}

/// A header name as [`crate::payload::fields_json`] wrote it, back as it was: a name holding
/// NUL was written in base64 after a prefix.
fn original_name(name: String) -> String {
    use base64::Engine as _;
    name.strip_prefix(crate::payload::BASE64_NAME_PREFIX)
        .and_then(|encoded| {
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .ok()
        })
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .filter(|decoded| decoded.contains('\0'))
        .unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redriven_key_is_kept_and_a_foreign_one_ignored() {
        let source = "redis:shop/orders";
        assert_eq!(redrive_key(&[], source, "1-0"), "redis:shop/orders:1-0");
        let own = vec![(
            crate::transport::IDEMPOTENCY_KEY_HEADER.to_owned(),
            b"redis:shop/orders:0-1".to_vec(),
        )];
        assert_eq!(redrive_key(&own, source, "1-0"), "redis:shop/orders:0-1");
        let foreign = vec![(
            crate::transport::IDEMPOTENCY_KEY_HEADER.to_owned(),
            b"redis:shop/ordersX:0-1".to_vec(),
        )];
        assert_eq!(
            redrive_key(&foreign, source, "1-0"),
            "redis:shop/orders:1-0"
        );
    }

    #[test]
    fn headers_round_trip_through_their_json_form() {
        let headers = vec![
            ("kind".to_owned(), b"order".to_vec()),
            ("raw".to_owned(), vec![0xff, 0x00]),
            ("nul".to_owned(), b"a\0b".to_vec()),
            ("name\0with nul".to_owned(), b"v".to_vec()),
            ("base64:bm8gbnVs".to_owned(), b"a real name".to_vec()),
        ];
        let json = crate::payload::fields_json(&headers);
        let mut back = headers_from_json(&json);
        back.sort();
        let mut headers = headers;
        headers.sort();
        assert_eq!(back, headers);
    }
}
