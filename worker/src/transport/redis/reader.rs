//! The Redis dead-letter readers (`switchboard-worker dlq`): the dead-letter stream of stream
//! mode and the dead-letter lists of list and pub/sub modes.
//!
//! Redrive puts a letter back and removes it in one `MULTI`/`EXEC`: Redis runs both or neither,
//! so a redrive that is killed never leaves a letter both redriven and still dead. A pub/sub
//! letter is published and removed in one script, and removed only if `PUBLISH` reached a
//! subscriber (see [`PubSubReader`]). A stream
//! letter goes back as a new entry (the body in `bodyField`, the original fields, and
//! [`IDEMPOTENCY_KEY_HEADER`] = `redis:{adapter}:{original entry id}`); a list letter's body is
//! pushed back as producers push it (its key is its body's hash, so it needs no header).
//!
//! Both are read a page at a time (`XRANGE … COUNT`, `LRANGE` from the right end). `show ID`
//! of a stream letter is one `XRANGE ID ID`; a list has no index by id (a list letter's id is
//! its record's hash), so `show ID` reads the list page by page until it finds it: time grows
//! with the letters older than it, memory does not.

use redis::Value;
use sha2::{Digest, Sha256};
use switchboard_api::{QueueAdapter, RedisSource};

use super::stream::{parse_entries, parse_id};
use super::{CONTROL_TIMEOUT, Connection, NamedKey, array, open, protocol, record_time_ms};
use crate::transport::reader::{
    Cursor, DeadLetterReader, Page, StoredLetter, headers_from_json, redrive_key,
};
use crate::transport::{Attempts, IDEMPOTENCY_KEY_HEADER, TransportError};

/// Letters removed per command of a purge.
const CHUNK: usize = 500;

/// An integer reply (`XLEN`, `LLEN`).
fn integer(reply: &Value) -> Option<u64> {
    match reply {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

/// The dead-letter stream of a stream-mode adapter.
#[derive(Debug)]
pub struct StreamReader {
    conn: Connection,
    stream: String,
    dead_letter_stream: String,
    body_field: String,
    source: String,
}

impl StreamReader {
    pub fn new(
        adapter: &QueueAdapter,
        redis: &RedisSource,
        url: &str,
    ) -> Result<Self, TransportError> {
        let stream = redis.stream.clone().unwrap_or_default();
        let dead_letter_stream = redis.dead_letter_key(&adapter.spec.delivery.dead_letter);
        let keys = vec![
            NamedKey::new(&stream, "spec.source.redis.stream", "stream"),
            NamedKey::new(
                &dead_letter_stream,
                "spec.delivery.deadLetter.stream",
                "stream",
            ),
        ];
        Ok(Self {
            conn: Connection::new(open(url)?, CONTROL_TIMEOUT).naming(keys),
            stream,
            dead_letter_stream,
            body_field: redis.body_field.clone(),
            source: format!("redis:{}", adapter.adapter_name()),
        })
    }

    /// The letters from `start` to `end` (`XRANGE` ids), at most `count`, and the id of the
    /// last entry read when there may be more.
    async fn range(
        &mut self,
        start: &str,
        end: &str,
        count: usize,
    ) -> Result<(Vec<StoredLetter>, Option<String>), TransportError> {
        let mut range = redis::cmd("XRANGE");
        range
            .arg(&self.dead_letter_stream)
            .arg(start)
            .arg(end)
            .arg("COUNT")
            .arg(count.max(1));
        let entries = parse_entries("XRANGE", self.conn.query("XRANGE", &range).await?)?;
        let last = (entries.len() >= count.max(1))
            .then(|| entries.last().map(|entry| entry.id.clone()))
            .flatten();
        let letters = entries
            .into_iter()
            .filter_map(|entry| Some(stream_letter(entry.id, entry.fields?)))
            .collect();
        Ok((letters, last))
    }
}

/// A dead-letter stream entry as a letter (see `RedisStream::write_dead_letters`).
fn stream_letter(id: String, fields: Vec<(Vec<u8>, Vec<u8>)>) -> StoredLetter {
    let field = |name: &str| {
        fields
            .iter()
            .find(|(field, _)| field == name.as_bytes())
            .map(|(_, value)| value.clone())
    };
    let text = |name: &str| field(name).map(|value| String::from_utf8_lossy(&value).into_owned());
    let original_id = text("origin_id");
    StoredLetter {
        dead_lettered_at_ms: parse_id(&id).map(|(ms, _)| ms),
        reason: text("reason"),
        delivery_count: text("delivery_count").and_then(|count| count.parse().ok()),
        last_error: text("last_error"),
        body: field("body").unwrap_or_default(),
        headers: text("headers")
            .map(|json| headers_from_json(&json))
            .unwrap_or_default(),
        attempts: text("attempts").and_then(|json| serde_json::from_str::<Attempts>(&json).ok()),
        origin: format!(
            "stream {}, entry {}",
            text("origin_stream").unwrap_or_default(),
            original_id.as_deref().unwrap_or("?")
        ),
        original_id,
        handle: id.clone(),
        id,
    }
}

impl DeadLetterReader for StreamReader {
    fn destination(&self) -> String {
        format!("Redis stream {}", self.dead_letter_stream)
    }

    fn source(&self) -> String {
        format!("Redis stream {}", self.stream)
    }

    fn caveats(&self) -> Vec<String> {
        vec![format!(
            "redriven letters (oldest first) are new entries at the end of {}: after what was added since they dead-lettered",
            self.stream
        )]
    }

    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        let mut length = redis::cmd("XLEN");
        length.arg(&self.dead_letter_stream);
        Ok(integer(&self.conn.query("XLEN", &length).await?))
    }

    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        let start = after.map_or_else(|| "-".to_owned(), |cursor| format!("({}", cursor.0));
        let (letters, last) = self.range(&start, "+", limit).await?;
        Ok(Page {
            letters,
            next: last.map(Cursor),
        })
    }

    /// One `XRANGE ID ID`: no scan.
    async fn letter(&mut self, id: &str) -> Result<Option<StoredLetter>, TransportError> {
        if parse_id(id).is_none() {
            return Ok(None);
        }
        let (letters, _) = self.range(id, id, 1).await?;
        Ok(letters.into_iter().next())
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let original = letter.original_id.as_deref().unwrap_or(&letter.id);
        let key = redrive_key(&letter.headers, &self.source, original);
        let mut pipe = redis::pipe();
        pipe.atomic();
        let add = pipe
            .cmd("XADD")
            .arg(&self.stream)
            .arg("*")
            .arg(&self.body_field)
            .arg(&letter.body);
        for (name, value) in &letter.headers {
            if name != IDEMPOTENCY_KEY_HEADER {
                add.arg(name).arg(value);
            }
        }
        add.arg(IDEMPOTENCY_KEY_HEADER).arg(&key).ignore();
        pipe.cmd("XDEL")
            .arg(&self.dead_letter_stream)
            .arg(&letter.handle)
            .ignore();
        self.conn.pipeline::<()>("XADD+XDEL", &pipe).await
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for chunk in letters.chunks(CHUNK) {
            let mut delete = redis::cmd("XDEL");
            delete.arg(&self.dead_letter_stream);
            for letter in chunk {
                delete.arg(&letter.handle);
            }
            self.conn.query("XDEL", &delete).await?;
        }
        Ok(())
    }
}

/// The dead-letter list of a list-mode adapter.
#[derive(Debug)]
pub struct ListReader {
    conn: Connection,
    list: String,
    dead_letter_list: String,
    /// Records this reader removed since its listing began (see `page`).
    removed: usize,
}

impl ListReader {
    pub fn new(
        adapter: &QueueAdapter,
        redis: &RedisSource,
        url: &str,
    ) -> Result<Self, TransportError> {
        let list = redis.list.clone().unwrap_or_default();
        let dead_letter_list = redis.dead_letter_key(&adapter.spec.delivery.dead_letter);
        let keys = vec![
            NamedKey::new(&list, "spec.source.redis.list", "list"),
            NamedKey::new(&dead_letter_list, "spec.delivery.deadLetter.list", "list"),
        ];
        Ok(Self {
            conn: Connection::new(open(url)?, CONTROL_TIMEOUT).naming(keys),
            list,
            dead_letter_list,
            removed: 0,
        })
    }
}

/// A dead-letter list record (see `dead_letter_record`) as a letter; `None` if it is not one.
fn list_letter(record: &[u8]) -> Option<StoredLetter> {
    use base64::Engine as _;
    let handle = String::from_utf8(record.to_vec()).ok()?;
    let json: serde_json::Value = serde_json::from_slice(record).ok()?;
    let text = |name: &str| json.get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let body = match (text("body"), text("body_base64")) {
        (Some(body), _) => body.into_bytes(),
        (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .ok()?,
        (None, None) => return None,
    };
    let origin = match (text("origin_list"), text("origin_channel")) {
        (Some(list), _) => format!("list {list}"),
        (None, Some(channel)) => format!("channel {channel}"),
        (None, None) => "?".to_owned(),
    };
    Some(StoredLetter {
        id: hex::encode(&Sha256::digest(record)[..8]),
        dead_lettered_at_ms: record_time_ms(record),
        reason: text("reason"),
        delivery_count: json.get("delivery_count").and_then(|v| v.as_u64()),
        last_error: text("last_error"),
        body,
        headers: json
            .get("headers")
            .map(|headers| headers_from_json(&headers.to_string()))
            .unwrap_or_default(),
        attempts: json
            .get("attempts")
            .and_then(|attempts| serde_json::from_value::<Attempts>(attempts.clone()).ok()),
        origin,
        original_id: None,
        handle,
    })
}

impl DeadLetterReader for ListReader {
    fn destination(&self) -> String {
        format!("Redis list {}", self.dead_letter_list)
    }

    fn source(&self) -> String {
        format!("Redis list {}", self.list)
    }

    fn caveats(&self) -> Vec<String> {
        vec![format!(
            "redriven letters (oldest first) are pushed onto {} as producers push: after what waits there now",
            self.list
        )]
    }

    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        let mut length = redis::cmd("LLEN");
        length.arg(&self.dead_letter_list);
        Ok(integer(&self.conn.query("LLEN", &length).await?))
    }

    /// Letters are pushed on the left: the oldest is the rightmost, and a page is counted from
    /// the right. A cursor is how many records the listing passed; those this reader removed
    /// since are subtracted (they no longer stand between the right end and the next page).
    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        let passed = match after {
            None => {
                self.removed = 0;
                0
            }
            Some(cursor) => cursor.0.parse::<usize>().unwrap_or(0),
        };
        let limit = limit.max(1);
        let from_right = passed.saturating_sub(self.removed);
        let mut range = redis::cmd("LRANGE");
        range
            .arg(&self.dead_letter_list)
            .arg(-i64::try_from(from_right + limit).unwrap_or(i64::MAX))
            .arg(-i64::try_from(from_right + 1).unwrap_or(i64::MAX));
        let reply = self.conn.query("LRANGE", &range).await?;
        let records = array(&reply).unwrap_or_default();
        let next = (records.len() >= limit).then(|| Cursor((passed + records.len()).to_string()));
        let letters = records
            .iter()
            .rev()
            .filter_map(|value| match value {
                Value::BulkString(record) => list_letter(record),
                _ => None,
            })
            .collect();
        Ok(Page { letters, next })
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let mut pipe = redis::pipe();
        pipe.atomic();
        pipe.cmd("LPUSH").arg(&self.list).arg(&letter.body).ignore();
        pipe.cmd("LREM")
            .arg(&self.dead_letter_list)
            .arg(-1)
            .arg(&letter.handle);
        let (removed,): (usize,) = self.conn.pipeline("LPUSH+LREM", &pipe).await?;
        self.removed += removed;
        Ok(())
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for chunk in letters.chunks(CHUNK) {
            let mut pipe = redis::pipe();
            for letter in chunk {
                pipe.cmd("LREM")
                    .arg(&self.dead_letter_list)
                    .arg(-1)
                    .arg(&letter.handle);
            }
            let removed: Vec<usize> = self.conn.pipeline("LREM", &pipe).await?;
            self.removed += removed.iter().sum::<usize>();
        }
        Ok(())
    }
}

/// Publishes a letter (`ARGV[2]`) to its channel (`ARGV[1]`) and, only if a subscriber received
/// it, removes its record (`ARGV[3]`) from the dead-letter list (`KEYS[1]`); one script, so
/// Redis runs it whole. Returns the subscribers that received it, or -1 (nothing published)
/// when the record is no longer in the list.
const PUBLISH_THEN_REMOVE: &str = "if not redis.call('LPOS', KEYS[1], ARGV[3], 'RANK', -1) then
  return -1
end
local receivers = redis.call('PUBLISH', ARGV[1], ARGV[2])
if receivers > 0 then redis.call('LREM', KEYS[1], -1, ARGV[3]) end
return receivers";

/// The dead-letter list of a pub/sub adapter: listed, shown and purged as list mode's is.
///
/// A channel keeps nothing, so a letter is redriven by publishing it and removing it in one
/// script that removes it only if `PUBLISH` reached at least one subscriber: with none the
/// letter stays (the redrive counts it failed and says so), and a redrive killed at any point
/// has published and removed a letter both or neither. What a subscriber receives is then
/// under pub/sub's own guarantee: the worker stores it unless it dies first (at-most-once), and
/// any client subscribed to the channel counts as a receiver, not only the worker.
#[derive(Debug)]
pub struct PubSubReader {
    letters: ListReader,
    channel: String,
    pattern: bool,
}

impl PubSubReader {
    pub fn new(
        adapter: &QueueAdapter,
        redis: &RedisSource,
        url: &str,
    ) -> Result<Self, TransportError> {
        let dead_letter_list = redis.dead_letter_key(&adapter.spec.delivery.dead_letter);
        let keys = vec![NamedKey::new(
            &dead_letter_list,
            "spec.delivery.deadLetter.list",
            "list",
        )];
        Ok(Self {
            letters: ListReader {
                conn: Connection::new(open(url)?, CONTROL_TIMEOUT).naming(keys),
                // List mode's source list: none here (this reader names its own source).
                list: String::new(),
                dead_letter_list,
                removed: 0,
            },
            channel: redis.channel.clone().unwrap_or_default(),
            pattern: redis.pattern,
        })
    }

    /// The channel `letter` was published on: its `channel` header (every pub/sub message
    /// carries it), else the adapter's channel when that is not a pattern.
    fn channel_of(&self, letter: &StoredLetter) -> Option<String> {
        letter
            .headers
            .iter()
            .find(|(name, _)| name == "channel")
            .and_then(|(_, channel)| String::from_utf8(channel.clone()).ok())
            .or_else(|| (!self.pattern).then(|| self.channel.clone()))
    }
}

impl DeadLetterReader for PubSubReader {
    fn destination(&self) -> String {
        self.letters.destination()
    }

    fn source(&self) -> String {
        if self.pattern {
            format!("Redis channels matching {}", self.channel)
        } else {
            format!("Redis channel {}", self.channel)
        }
    }

    fn caveats(&self) -> Vec<String> {
        vec![
            "pub/sub is at-most-once: a letter is removed only if PUBLISH reached a subscriber \
             (else it stays and counts as failed), and a worker that dies before storing it \
             loses it; any client subscribed to the channel counts as a subscriber"
                .to_owned(),
            "redriven letters (oldest first) are published like new messages".to_owned(),
        ]
    }

    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        self.letters.count().await
    }

    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        self.letters.page(after, limit).await
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let Some(channel) = self.channel_of(letter) else {
            return Err(TransportError::protocol(format!(
                "letter {} does not say which channel matching {} it came from",
                letter.id, self.channel
            )));
        };
        let list = &self.letters.dead_letter_list;
        let mut script = redis::cmd("EVAL");
        script
            .arg(PUBLISH_THEN_REMOVE)
            .arg(1)
            .arg(list)
            .arg(&channel)
            .arg(&letter.body)
            .arg(&letter.handle);
        match self.letters.conn.query("PUBLISH+LREM", &script).await? {
            Value::Int(receivers) if receivers > 0 => {
                self.letters.removed += 1;
                Ok(())
            }
            Value::Int(0) => Err(TransportError::protocol(format!(
                "no subscriber on channel {channel}: the letter stays in {list}; start the \
                 worker and run the redrive again once it is subscribed"
            ))),
            Value::Int(_) => Err(TransportError::protocol(format!(
                "letter {} is no longer in {list} (another command took it): not published",
                letter.id
            ))),
            other => Err(protocol("PUBLISH+LREM", format!("{other:?}"))),
        }
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        self.letters.remove(letters).await
    }
}
