//! The reader of an SQS dead-letter queue (`switchboard-worker dlq`), reached through the AWS
//! API ([`Sqs`], `letter_queue.rs`) or through the gateway in front of SQS
//! (`gateway/reader.rs`): both implement [`LetterQueue`], the calls the reader makes.
//!
//! SQS has no way to look at a queue without receiving from it: the reader receives letters
//! one `ReceiveMessage` (10 letters) per page with a short visibility timeout ([`HOLD`]), and
//! the commands hand back at once what they do not redrive or delete (`ChangeMessageVisibility`
//! 0). A listing is one pass: it stops on an empty receive or when a letter it already read
//! comes back, and `list --limit N` stops after N letters (and one page more, to say whether it
//! was cut). A command that is killed leaves the page it held hidden until [`HOLD`] expires.
//! SQS cannot look a letter up by id either: `show ID` (and redrive or purge by id) read the
//! queue page by page until they find it, so their time grows with the queue, their memory
//! does not (the reader keeps the message ids of one pass, not the letters). Letters come in
//! the order SQS hands them out; a page is sorted by the time its letters were dead-lettered.
//!
//! A letter the worker wrote carries its context as `x-dlq-*` attributes and the original
//! attributes in `x-dlq-attributes`; a letter SQS moved itself (the source queue's
//! `RedrivePolicy`) is the original message: its attempts are the ones the worker recorded in
//! PostgreSQL (read when `DATABASE_URL` is set). Redrive sends the body and the original message
//! attributes to the source queue with [`IDEMPOTENCY_KEY_HEADER`] = `sqs:{adapter}:{original
//! MessageId}`, waits for SQS to accept it, then deletes the letter; to a FIFO source with a
//! `MessageDeduplicationId` made from that key and the letter's own id (`deduplication_id`,
//! `letter_queue.rs`).
//!
//! When a letter was dead-lettered: for a letter the worker wrote, `x-dlq-last-seen` (the time
//! it wrote it), else its `SentTimestamp` (the same write). For a letter SQS moved, unknown:
//! SQS keeps a moved message's enqueue time (its `SentTimestamp`) from the original send on a
//! standard queue and documents a FIFO queue's reset only as the retention clock; no system
//! attribute is documented as the time of the move (`ApproximateFirstReceiveTimestamp` is a
//! receive, `DeadLetterQueueSourceArn` says where from, not when). Such a letter is listed
//! with its age unknown, and `--older-than` never selects it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::MessageSystemAttributeName;
use switchboard_api::QueueAdapter;
use switchboard_store::Store;

use super::Sqs;
use crate::transport::identity::idempotency_key;
use crate::transport::reader::{
    Cursor, DeadLetterReader, Page, StoredLetter, headers_from_json, redrive_key,
};
use crate::transport::{Attempt, Attempts, IDEMPOTENCY_KEY_HEADER, TransportError};

/// How long a letter read by a command stays hidden from other readers (seconds).
const HOLD: i32 = 20;
/// A letter read longer ago than this is hidden afresh before it is deleted.
const REFRESH_AFTER: Duration = Duration::from_secs(10);
/// SQS's limit on message attributes per message.
pub(crate) const MAX_ATTRIBUTES: usize = 10;
/// SQS's limit on the messages of one receive.
const RECEIVE_LIMIT: usize = 10;
/// The reason shown for a letter SQS moved itself.
pub const REDRIVE_POLICY_REASON: &str = "redrive_policy";

/// System attributes the worker keeps among a message's headers: not sent back as message
/// attributes on redrive.
fn is_system_attribute(name: &str) -> bool {
    MessageSystemAttributeName::values().contains(&name)
}

/// One message received from a dead-letter queue, whoever served it.
#[derive(Debug)]
pub struct Received {
    pub id: String,
    pub handle: String,
    /// The body as it was sent to the source.
    pub body: Vec<u8>,
    /// Its message attributes, by name.
    pub attributes: Vec<(String, Vec<u8>)>,
    /// When it was sent to the dead-letter queue (Unix ms): SQS's `SentTimestamp`.
    pub sent_ms: Option<u64>,
}

/// The calls a reader of an SQS dead-letter queue makes, to SQS or to a gateway in front of it.
#[allow(async_fn_in_trait)]
pub trait LetterQueue {
    /// The dead-letter queue, for people.
    fn destination(&self) -> String;
    /// The source queue, for people.
    fn source(&self) -> String;
    /// The scope of the source's idempotency keys (`sqs:{adapter}`).
    fn key_scope(&self) -> &str;
    /// Where a letter the worker wrote came from, for people, from its `x-dlq-origin`.
    fn origin(&self, written: &str) -> String;
    fn caveats(&self) -> Vec<String>;
    async fn count(&self) -> Result<Option<u64>, TransportError>;
    /// One receive of at most `max` (≤ 10) letters, hidden for `hold` seconds.
    async fn receive(&self, max: usize, hold: i32) -> Result<Vec<Received>, TransportError>;
    async fn visibility(&self, handle: &str, seconds: i32) -> Result<(), TransportError>;
    async fn delete(&self, handle: &str) -> Result<(), TransportError>;
    /// Sends a copy of `letter` with `attributes` (its key among them) to the source queue and
    /// returns once the queue accepted it.
    async fn send(
        &self,
        letter: &StoredLetter,
        attributes: Vec<(String, Vec<u8>)>,
        key: &str,
    ) -> Result<(), TransportError>;
}

/// The dead-letter queue of an SQS adapter.
pub type SqsReader = QueueReader<Sqs>;

/// An SQS dead-letter queue, read through `Q`.
#[derive(Debug)]
pub struct QueueReader<Q> {
    queue: Q,
    /// Where the attempts of letters SQS moved itself are recorded, if `DATABASE_URL` is set.
    store: Option<Store>,
    /// When each letter this command holds was received, by receipt handle.
    read_at: HashMap<String, Instant>,
    /// The message ids of the letters read in this pass (see `page`).
    seen: HashSet<String>,
}

fn text(attributes: &[(String, Vec<u8>)], name: &str) -> Option<String> {
    attributes
        .iter()
        .find(|(key, _)| key == name)
        .and_then(|(_, value)| String::from_utf8(value.clone()).ok())
}

fn rfc3339_to_ms(text: &str) -> Option<u64> {
    let at = humantime::parse_rfc3339(text).ok()?;
    u64::try_from(at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

impl SqsReader {
    /// Connects with the adapter's settings and checks the queues as the worker does.
    pub async fn new(adapter: &QueueAdapter) -> Result<Self, TransportError> {
        let sqs = Sqs::for_command(adapter, "switchboard-worker-dlq").await?;
        Self::over(sqs).await
    }
}

impl<Q: LetterQueue> QueueReader<Q> {
    /// A reader of `queue`, with the store of `DATABASE_URL` if it is set.
    pub(crate) async fn over(queue: Q) -> Result<Self, TransportError> {
        let store = match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Some(
                Store::connect(&url, 1, "switchboard-worker/dlq")
                    .await
                    .map_err(|err| TransportError::database("cannot use DATABASE_URL", err))?,
            ),
            _ => None,
        };
        Ok(Self {
            queue,
            store,
            read_at: HashMap::new(),
            seen: HashSet::new(),
        })
    }

    fn letter(&mut self, message: Received) -> StoredLetter {
        let Received {
            id,
            handle,
            body,
            mut attributes,
            sent_ms,
        } = message;
        self.read_at.insert(handle.clone(), Instant::now());
        let Some(reason) = text(&attributes, "x-dlq-reason") else {
            // Moved by SQS itself: the original message, its attributes its own.
            attributes.sort();
            return StoredLetter {
                original_id: Some(id.clone()),
                id,
                // Unknown: SQS records no time of the move (see the module).
                dead_lettered_at_ms: None,
                reason: Some(REDRIVE_POLICY_REASON.to_owned()),
                delivery_count: None,
                last_error: Some(
                    "moved by SQS: received more often than the queue's RedrivePolicy allows"
                        .to_owned(),
                ),
                body,
                headers: attributes,
                attempts: None,
                origin: format!("{} (RedrivePolicy)", self.queue.source()),
                handle,
            };
        };
        let origin = text(&attributes, "x-dlq-origin").unwrap_or_default();
        let original_id = text(&attributes, "x-dlq-message-id");
        StoredLetter {
            dead_lettered_at_ms: text(&attributes, "x-dlq-last-seen")
                .and_then(|at| rfc3339_to_ms(&at))
                .or(sent_ms),
            reason: Some(reason),
            delivery_count: text(&attributes, "x-dlq-delivery-count")
                .and_then(|count| count.parse().ok()),
            last_error: text(&attributes, "x-dlq-error"),
            body,
            headers: text(&attributes, "x-dlq-attributes")
                .map(|json| headers_from_json(&json))
                .unwrap_or_default(),
            attempts: text(&attributes, "x-dlq-attempts")
                .and_then(|json| serde_json::from_str::<Attempts>(&json).ok()),
            origin: format!(
                "{}, message {}",
                self.queue.origin(&origin),
                original_id.as_deref().unwrap_or("?")
            ),
            original_id,
            id,
            handle,
        }
    }

    /// The attempts the worker recorded of letters SQS moved itself (they carry none).
    async fn recorded_attempts(&self, letters: &mut [StoredLetter]) -> Result<(), TransportError> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let source = self.queue.key_scope();
        let keys: Vec<String> = letters
            .iter()
            .filter(|letter| letter.attempts.is_none())
            .map(|letter| idempotency_key(source, &letter.id))
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let recorded = store
            .attempts(source, &keys)
            .await
            .map_err(|err| TransportError::database("cannot read the recorded attempts", err))?;
        for letter in letters
            .iter_mut()
            .filter(|letter| letter.attempts.is_none())
        {
            let Some(json) = recorded.get(&idempotency_key(source, &letter.id)) else {
                continue;
            };
            let recent: Vec<Attempt> = serde_json::from_str(json).unwrap_or_default();
            letter.delivery_count = recent.iter().map(|attempt| attempt.delivery).max();
            letter.attempts = Some(Attempts {
                total: letter.delivery_count.unwrap_or_default(),
                recent,
            });
        }
        Ok(())
    }

    /// Hides `letter` for another [`HOLD`] if it was read long ago, so its receipt handle is
    /// still the valid one when it is deleted.
    async fn refresh(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let fresh = self
            .read_at
            .get(&letter.handle)
            .is_some_and(|at| at.elapsed() < REFRESH_AFTER);
        if fresh {
            return Ok(());
        }
        self.queue.visibility(&letter.handle, HOLD).await?;
        self.read_at.insert(letter.handle.clone(), Instant::now());
        Ok(())
    }

    async fn delete(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        self.refresh(letter).await?;
        self.queue.delete(&letter.handle).await?;
        self.read_at.remove(&letter.handle);
        Ok(())
    }
}

/// The attribute of a redriven copy that holds its key, and the original attributes there was
/// no room for, when the original had SQS's maximum ([`MAX_ATTRIBUTES`]): their JSON form
/// (`{"name": "text" | {"base64": …}}`).
pub(super) const PACKED_ATTRIBUTE: &str = "x-switchboard-redriven";

/// The message attributes of a letter's redriven copy: the original ones (not the system
/// attributes kept among the headers, not an older key) and [`IDEMPOTENCY_KEY_HEADER`] =
/// `key`. An original at SQS's maximum of attributes leaves no room for the key: its last
/// attribute then travels with the key in [`PACKED_ATTRIBUTE`], which the transport unpacks
/// when it receives the copy ([`unpack_redriven`]), so the copy is stored with every original
/// attribute and its original key.
pub(crate) fn copy_attributes(headers: &[(String, Vec<u8>)], key: &str) -> Vec<(String, Vec<u8>)> {
    let mut attributes: Vec<(String, Vec<u8>)> = headers
        .iter()
        .filter(|(name, _)| !is_system_attribute(name) && name != IDEMPOTENCY_KEY_HEADER)
        .cloned()
        .collect();
    let key = (IDEMPOTENCY_KEY_HEADER.to_owned(), key.as_bytes().to_vec());
    if attributes.len() < MAX_ATTRIBUTES {
        attributes.push(key);
        return attributes;
    }
    let mut packed = attributes.split_off(MAX_ATTRIBUTES - 1);
    packed.insert(0, key);
    attributes.push((
        PACKED_ATTRIBUTE.to_owned(),
        crate::payload::fields_json(&packed).into_bytes(),
    ));
    attributes
}

/// The headers of a received message with [`PACKED_ATTRIBUTE`] opened: the key and the
/// attributes it holds in its place (see [`copy_attributes`]).
pub(crate) fn unpack_redriven(headers: &mut Vec<(String, Vec<u8>)>) {
    let Some(index) = headers
        .iter()
        .position(|(name, _)| name == PACKED_ATTRIBUTE)
    else {
        return;
    };
    let (_, packed) = headers.remove(index);
    headers.extend(headers_from_json(&String::from_utf8_lossy(&packed)));
    headers.sort_by(|a, b| a.0.cmp(&b.0));
}

impl<Q: LetterQueue> DeadLetterReader for QueueReader<Q> {
    fn destination(&self) -> String {
        self.queue.destination()
    }

    fn source(&self) -> String {
        self.queue.source()
    }

    fn caveats(&self) -> Vec<String> {
        self.queue.caveats()
    }

    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        self.queue.count().await
    }

    /// One receive (at most 10 letters, hidden for [`HOLD`]). A listing is one pass over the
    /// queue: it ends on an empty receive or when a letter it already read comes back (handed
    /// back at once); `after: None` starts a new pass.
    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        if after.is_none() {
            self.seen.clear();
        }
        let messages = self
            .queue
            .receive(limit.clamp(1, RECEIVE_LIMIT), HOLD)
            .await?;
        let mut next = (!messages.is_empty()).then(|| Cursor(String::new()));
        let (mut letters, mut again) = (Vec::new(), Vec::new());
        for message in messages {
            let first = self.seen.insert(message.id.clone());
            let letter = self.letter(message);
            if first {
                letters.push(letter);
            } else {
                again.push(letter);
                next = None;
            }
        }
        self.release(&again).await?;
        letters.sort_by_key(|letter| letter.dead_lettered_at_ms);
        self.recorded_attempts(&mut letters).await?;
        Ok(Page { letters, next })
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        self.refresh(letter).await?;
        let original = letter.original_id.as_deref().unwrap_or(&letter.id);
        let key = redrive_key(&letter.headers, self.queue.key_scope(), original);
        self.queue
            .send(letter, copy_attributes(&letter.headers, &key), &key)
            .await?;
        self.delete(letter).await
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for letter in letters {
            self.delete(letter).await?;
        }
        Ok(())
    }

    async fn release(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for letter in letters {
            // Best effort: a letter not handed back reappears when its visibility expires.
            if let Err(err) = self.queue.visibility(&letter.handle, 0).await {
                tracing::debug!(error = %err, "could not hand a dead letter back");
            }
            self.read_at.remove(&letter.handle);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_of_a_letter_at_the_attribute_limit_packs_its_key_and_unpacks_as_the_original() {
        let originals: Vec<(String, Vec<u8>)> = (0..MAX_ATTRIBUTES)
            .map(|n| (format!("a{n}"), format!("v{n}").into_bytes()))
            .collect();
        let mut headers = originals.clone();
        headers.push(("SentTimestamp".to_owned(), b"1".to_vec()));
        let copy = copy_attributes(&headers, "sqs:shop/orders:m-1");
        assert_eq!(copy.len(), MAX_ATTRIBUTES);
        assert!(copy.iter().all(|(name, _)| name != IDEMPOTENCY_KEY_HEADER));
        let mut received = copy;
        unpack_redriven(&mut received);
        let mut expected = originals;
        expected.push((
            IDEMPOTENCY_KEY_HEADER.to_owned(),
            b"sqs:shop/orders:m-1".to_vec(),
        ));
        expected.sort();
        assert_eq!(received, expected);

        let few = copy_attributes(&expected[..2], "k");
        assert_eq!(few.len(), 3);
        assert!(
            few.iter()
                .any(|(name, value)| name == IDEMPOTENCY_KEY_HEADER && value == b"k")
        );
    }
}
