//! The RabbitMQ dead-letter reader (`switchboard-worker dlq`): the default dead-letter queue
//! (`<queue>.dlq`, or `deadLetter.routingKey` on the default exchange), quorum or classic as the
//! worker declared it.
//!
//! AMQP 0-9-1 has no way to look at a queue without taking messages from it, so the reader
//! **gets and gives back**: `basic.get` without acknowledgement, one letter per round trip.
//! A letter read stays delivered to the reader (unacknowledged) while the listing goes on, so
//! the next `basic.get` hands out the next letter; RabbitMQ puts every letter the reader holds
//! back when the reader starts a listing over (`basic.nack requeue`, letter by letter), when its
//! channel or connection closes, or when the command is killed. Nothing is removed but by
//! `basic.ack`, after a redrive's copy is confirmed or for a purge. Where a letter given back
//! goes: a classic queue puts it back in its place; a quorum queue (3.10) hands a letter given
//! back by `basic.nack` out after the ready ones, and one given back by a closed connection in
//! its place once the queue has taken it back (a command starting at once may read the others
//! first). A walk reads until the queue has nothing ready, so it reads every letter either way;
//! only the order differs.
//!
//! - **Cost**: a page deep in the queue holds every letter before it unacknowledged until the
//!   command ends: RabbitMQ keeps them as unacknowledged on the reader's channel (it counts them
//!   in `messages_unacknowledged`, not in the ready count the worker's depth gauge reads), and
//!   a second `dlq` command running at the same time sees only the letters the first does not
//!   hold. The reader itself keeps only the delivery tags of the letters it passed (8 bytes a
//!   letter) and the properties of the page in hand. RabbitMQ's `consumer_timeout` (30 min by
//!   default) also applies to what `basic.get` handed out: a command holding letters longer
//!   has its channel closed and the letters put back (nothing is lost; the command fails).
//! - **Every read is a delivery**: a letter put back is redelivered (`redelivered` set) and, on
//!   a quorum queue, its `x-delivery-count` grows by one per listing that read it. Up to
//!   RabbitMQ 3.13 a quorum queue has no delivery limit unless one is set; RabbitMQ 4.0–4.2
//!   default it to 20 and count every return against it, so there a dead-letter queue without
//!   `x-delivery-limit` (or a `delivery-limit` policy) of -1 would drop a letter after about 20
//!   listings (4.3 counts only failed deliveries; `basic.nack` is not one). See
//!   docs/brokers/rabbitmq.md.
//! - **Ids**: a letter's id is the first 16 hex digits of the SHA-256 of its `message-id`, its
//!   dead-lettering time and its body: the same whatever position the letter has, as long as it
//!   is in the queue. `show ID` reads the queue page by page until it finds it.
//! - **Redrive**: publishes the body and the original properties and headers (not the letter's
//!   `x-switchboard-*` fields, not RabbitMQ's counters) to the source queue through the default
//!   exchange, mandatory and persistent, with [`IDEMPOTENCY_KEY_HEADER`] =
//!   `amqp:{adapter}:{queue}:{original message-id}`; waits for the publisher confirm (an
//!   unroutable copy is an error naming `spec.source.amqp.queue`, not a silent drop), and only
//!   then acknowledges (removes) the letter. A redrive killed in between leaves the letter and a
//!   copy: run again, the second copy carries the same key and makes no second todo.

use std::collections::HashMap;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use sha2::{Digest, Sha256};
use switchboard_api::{AmqpSource, QueueAdapter};

use super::arguments::integer;
use super::classify::{Addressed, Names};
use super::connection::{call, check_url, connect, declare_passive, open_channel, queue_exists};
use super::dead_letter::added_header;
use super::dead_letter_route;
use super::delivery::{Original, QUORUM_COUNT_HEADER, external_id, headers};
use super::frame::fits_one_frame;
use crate::transport::dead_letter::Convention;
use crate::transport::reader::{Cursor, DeadLetterReader, Page, StoredLetter, redrive_key};
use crate::transport::{Attempts, IDEMPOTENCY_KEY_HEADER, TransportError};

/// The dead-letter queue of an AMQP adapter.
pub struct AmqpReader {
    names: Names,
    connection: Connection,
    /// The channel letters are read (`basic.get`) and removed (`basic.ack`) on; `None` when the
    /// dead-letter queue does not exist (no letter was ever written).
    reading: Option<Channel>,
    /// The confirm-mode channel redriven copies are published on, opened on first use.
    publishing: Option<Channel>,
    /// The dead-letter queue.
    queue: String,
    /// `amqp:{adapter}:{queue}`: the key scope of the source.
    key_scope: String,
    /// Letters read and handed back: held unacknowledged so that the listing moves on, put back
    /// when a listing starts over. Only their delivery tags.
    passed: Vec<u64>,
    /// The properties of the letters handed out and not handed back, by delivery tag.
    out: HashMap<u64, BasicProperties>,
    /// Whether a letter read [`WORN_READS`] times or more was noted.
    noted_reads: bool,
}

/// How often a letter may be given back before a command says so: half of RabbitMQ 4.0–4.2's
/// default delivery limit of quorum queues (20), which counts every return.
const WORN_READS: u64 = 10;

impl std::fmt::Debug for AmqpReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpReader")
            .field("queue", &self.queue)
            .field("passed", &self.passed.len())
            .field("out", &self.out.len())
            .finish_non_exhaustive()
    }
}

impl AmqpReader {
    /// Connects to `url` (never echoed) and opens the adapter's dead-letter queue. A dead-letter
    /// exchange is refused: where its letters go is the exchange's bindings' business.
    pub async fn new(
        adapter: &QueueAdapter,
        amqp: &AmqpSource,
        url: &str,
    ) -> Result<Self, TransportError> {
        check_url(url)?;
        let dead_letter = &adapter.spec.delivery.dead_letter;
        let (exchange, queue, names) = dead_letter_route(
            &amqp.queue,
            dead_letter.exchange.as_deref(),
            dead_letter.routing_key.as_deref(),
        );
        if !exchange.is_empty() {
            return Err(TransportError::fatal(
                names.dead_letter_setting,
                format!(
                    "dead letters go to exchange {exchange:?}: `switchboard-worker dlq` reads the default dead-letter queue only; read the queue bound to {exchange:?} with your RabbitMQ tools"
                ),
                None,
            ));
        }
        let connection = connect(&names, url, "switchboard-worker-dlq").await?;
        let reading = match queue_exists(&names, &connection, &queue, Addressed::DeadLetter).await?
        {
            true => Some(open_channel(&names, &connection).await?),
            false => None,
        };
        Ok(Self {
            key_scope: format!("amqp:{}:{}", adapter.adapter_name(), amqp.queue),
            names,
            connection,
            reading,
            publishing: None,
            queue,
            passed: Vec::new(),
            out: HashMap::new(),
            noted_reads: false,
        })
    }

    /// Puts back every letter passed (the letters handed out stay held).
    async fn start_over(&mut self) -> Result<(), TransportError> {
        let Some(channel) = &self.reading else {
            return Ok(());
        };
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        for tag in std::mem::take(&mut self.passed) {
            call(
                &self.names,
                "dead letter put back (basic.nack)",
                Addressed::DeadLetter,
                channel.basic_nack(tag, requeue),
            )
            .await?;
        }
        Ok(())
    }

    /// The next letter, held; `None` when no letter is ready.
    async fn next_letter(&mut self) -> Result<Option<StoredLetter>, TransportError> {
        let Some(channel) = &self.reading else {
            return Ok(None);
        };
        let got = call(
            &self.names,
            "dead letter read (basic.get)",
            Addressed::DeadLetter,
            channel.basic_get(
                self.queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            ),
        )
        .await?;
        Ok(got.map(|message| {
            let delivery = message.delivery;
            let letter = stored_letter(
                &self.queue,
                delivery.delivery_tag,
                &delivery.properties,
                delivery.data,
            );
            self.note_reads(&letter.id, &delivery.properties);
            self.out.insert(delivery.delivery_tag, delivery.properties);
            letter
        }))
    }

    /// Says once per command, on standard error, when a letter has been given back
    /// [`WORN_READS`] times or more (its `x-delivery-count` in a quorum queue).
    fn note_reads(&mut self, id: &str, properties: &BasicProperties) {
        let reads = header_text(properties.headers().as_ref(), QUORUM_COUNT_HEADER)
            .and_then(|count| count.parse::<u64>().ok())
            .unwrap_or(0);
        if reads >= WORN_READS && !self.noted_reads {
            self.noted_reads = true;
            eprintln!(
                "note: dead letter {id} has been read and given back {reads} times (x-delivery-count of queue {}); RabbitMQ 4.0 to 4.2 drop a letter of a quorum queue at its delivery limit (20 by default) unless it is disabled (delivery-limit -1): see docs/brokers/rabbitmq.md",
                self.queue
            );
        }
    }

    /// Removes the letter held under `tag`.
    async fn acknowledge(&mut self, tag: u64) -> Result<(), TransportError> {
        let Some(channel) = &self.reading else {
            return Ok(());
        };
        call(
            &self.names,
            "dead letter removal (basic.ack)",
            Addressed::DeadLetter,
            channel.basic_ack(tag, BasicAckOptions::default()),
        )
        .await?;
        self.out.remove(&tag);
        Ok(())
    }

    /// The confirm-mode channel to publish redriven copies on.
    async fn publishing(&mut self) -> Result<Channel, TransportError> {
        if let Some(channel) = self.publishing.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = open_channel(&self.names, &self.connection).await?;
        call(
            &self.names,
            "confirm select",
            Addressed::Connection,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        self.publishing = Some(channel.clone());
        Ok(channel)
    }

    /// Publishes `body` with `properties` to the source queue (mandatory) and waits for the
    /// confirm.
    pub(crate) async fn publish_copy(
        &mut self,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), TransportError> {
        const WHAT: &str = "redriven letter publish";
        let channel = self.publishing().await?;
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = call(
            &self.names,
            WHAT,
            Addressed::Queue,
            channel.basic_publish(
                "".into(),
                self.names.queue.as_str().into(),
                mandatory,
                body,
                properties,
            ),
        )
        .await?;
        match call(&self.names, WHAT, Addressed::Queue, confirm).await? {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(self.names.unroutable(
                WHAT,
                Addressed::Queue,
                returned.reply_code,
                returned.reply_text.as_str(),
            )),
            Confirmation::Nack(_) => Err(TransportError::protocol(format!(
                "RabbitMQ refused the redriven letter (nack) for queue {:?}: is it full, with x-overflow reject-publish?",
                self.names.queue
            ))),
            Confirmation::NotRequested => Err(TransportError::protocol(
                "the redrive channel is not in confirm mode",
            )),
        }
    }
}

/// A header's value as text (numbers as digits); `None` without it.
fn header_text(table: Option<&FieldTable>, name: &str) -> Option<String> {
    match table?.inner().get(name)? {
        AMQPValue::LongString(value) => Some(String::from_utf8_lossy(value.as_bytes()).into()),
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        other => integer(other).map(|number| number.to_string()),
    }
}

/// The original's headers of a letter: its own without what the dead letter added and
/// RabbitMQ's counters.
fn original_headers(letter: &BasicProperties) -> FieldTable {
    letter
        .headers()
        .iter()
        .flat_map(|table| table.inner())
        .filter(|(name, _)| !added_header(name.as_str()))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into()
}

/// The letter delivered under `tag` with `properties` and `body`.
fn stored_letter(
    queue: &str,
    tag: u64,
    properties: &BasicProperties,
    body: Vec<u8>,
) -> StoredLetter {
    let table = properties.headers().as_ref();
    let field = |name: &str| header_text(table, &Convention::Switchboard.name(name));
    let message_id = external_id(properties, &body);
    let last_seen = field("last-seen");
    let moved = moved_by_rabbitmq(table);
    let original = Original {
        exchange: field("original-exchange").unwrap_or_default(),
        routing_key: field("original-routing-key").unwrap_or_default(),
        properties: properties
            .clone()
            .with_headers(original_headers(properties)),
    };
    let mut digest = Sha256::new();
    for part in [
        message_id.as_bytes(),
        last_seen.as_deref().unwrap_or("").as_bytes(),
    ] {
        digest.update(part);
        digest.update(b"\n");
    }
    digest.update(&body);
    StoredLetter {
        id: hex::encode(digest.finalize())[..16].to_owned(),
        dead_lettered_at_ms: dead_lettered_at_ms(properties),
        reason: field("reason").or_else(|| moved.map(|(reason, _)| reason)),
        delivery_count: field("delivery-count").and_then(|count| count.parse().ok()),
        last_error: field("error"),
        headers: headers(&original),
        attempts: field("attempts").and_then(|json| serde_json::from_str::<Attempts>(&json).ok()),
        origin: format!(
            "queue {}, message-id {message_id} (dead-letter queue {queue})",
            field("queue").unwrap_or_else(|| "?".to_owned())
        ),
        original_id: Some(message_id),
        handle: tag.to_string(),
        body,
    }
}

/// When the letter with `properties` was dead-lettered (Unix ms): the worker's `last-seen`
/// field, else the time of RabbitMQ's newest `x-death` entry (whole seconds).
pub(super) fn dead_lettered_at_ms(properties: &BasicProperties) -> Option<u64> {
    let table = properties.headers().as_ref();
    header_text(table, &Convention::Switchboard.name("last-seen"))
        .as_deref()
        .and_then(rfc3339_ms)
        .or_else(|| moved_by_rabbitmq(table).and_then(|(_, at)| at))
}

/// Why and when RabbitMQ itself last dead-lettered the message (the newest `x-death` entry,
/// set when a queue's own dead-lettering moved it here): its `reason` (`rejected`, `expired`,
/// `maxlen`, `delivery_limit`) and `time` (Unix ms).
fn moved_by_rabbitmq(table: Option<&FieldTable>) -> Option<(String, Option<u64>)> {
    let AMQPValue::FieldArray(deaths) = table?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
        return None;
    };
    let at = match newest.inner().get("time") {
        Some(AMQPValue::Timestamp(seconds)) => seconds.checked_mul(1000),
        _ => None,
    };
    Some((header_text(Some(newest), "reason")?, at))
}

fn rfc3339_ms(text: &str) -> Option<u64> {
    let at = humantime::parse_rfc3339(text).ok()?;
    u64::try_from(at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

/// The properties of a letter's redriven copy: the letter's (which are the original's, its
/// `message-id` included) with the original's headers and the idempotency `key`.
fn copy_properties(letter: &BasicProperties, key: &str) -> BasicProperties {
    let mut headers = original_headers(letter);
    headers.insert(
        IDEMPOTENCY_KEY_HEADER.into(),
        AMQPValue::LongString(LongString::from(key.as_bytes().to_vec())),
    );
    letter.clone().with_headers(headers)
}

/// The delivery tag a letter is held under.
fn tag_of(letter: &StoredLetter) -> Result<u64, TransportError> {
    letter
        .handle
        .parse()
        .map_err(|_| TransportError::protocol(format!("letter {} has no delivery tag", letter.id)))
}

impl DeadLetterReader for AmqpReader {
    fn destination(&self) -> String {
        match self.reading {
            Some(_) => format!("RabbitMQ queue {}", self.queue),
            None => format!("RabbitMQ queue {} (not declared yet)", self.queue),
        }
    }

    fn source(&self) -> String {
        format!("RabbitMQ queue {}", self.names.queue)
    }

    fn caveats(&self) -> Vec<String> {
        vec![format!(
            "redriven letters (in the order the dead-letter queue hands them out: oldest first, but a quorum queue may hand out letters an earlier command gave back after the others) are new messages at the tail of queue {}, published through the default exchange (not their original exchange and routing key), without their original expiration",
            self.names.queue
        )]
    }

    /// The queue's ready letters and those this reader holds.
    async fn count(&mut self) -> Result<Option<u64>, TransportError> {
        if self.reading.is_none() {
            return Ok(Some(0));
        }
        let declared = declare_passive(&self.names, &self.connection, &self.queue).await?;
        let held = (self.passed.len() + self.out.len()) as u64;
        Ok(Some(u64::from(declared.message_count()) + held))
    }

    async fn page(&mut self, after: Option<&Cursor>, limit: usize) -> Result<Page, TransportError> {
        if after.is_none() {
            self.start_over().await?;
        }
        let mut letters = Vec::new();
        while letters.len() < limit.max(1) {
            match self.next_letter().await? {
                Some(letter) => letters.push(letter),
                None => {
                    return Ok(Page {
                        letters,
                        next: None,
                    });
                }
            }
        }
        let read = self.passed.len() + self.out.len();
        Ok(Page {
            letters,
            next: Some(Cursor(read.to_string())),
        })
    }

    async fn redrive(&mut self, letter: &StoredLetter) -> Result<(), TransportError> {
        let tag = tag_of(letter)?;
        let properties = self.out.get(&tag).cloned().ok_or_else(|| {
            TransportError::protocol(format!("letter {} is not held by this reader", letter.id))
        })?;
        let original = letter.original_id.as_deref().unwrap_or(&letter.id);
        let key = redrive_key(&letter.headers, &self.key_scope, original);
        let copy = copy_properties(&properties, &key);
        let frame_max = self.connection.configuration().frame_max();
        fits_one_frame(&copy, frame_max, "the redriven copy stays a dead letter")?;
        self.publish_copy(&letter.body, copy).await?;
        self.acknowledge(tag).await
    }

    async fn remove(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for letter in letters {
            self.acknowledge(tag_of(letter)?).await?;
        }
        Ok(())
    }

    /// Keeps the letters held (so that the listing moves on) and forgets their properties.
    async fn release(&mut self, letters: &[StoredLetter]) -> Result<(), TransportError> {
        for letter in letters {
            let tag = tag_of(letter)?;
            if self.out.remove(&tag).is_some() {
                self.passed.push(tag);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::dead_letter::properties;
    use super::super::dead_letter::tests::{CONTEXT, letter, message, published};
    use super::*;

    /// A letter the worker wrote for a message with a `message-id`, a user header, RabbitMQ's
    /// count and an earlier redrive's key.
    fn written() -> (BasicProperties, Vec<u8>) {
        let mut headers = FieldTable::default();
        headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        headers.insert(
            IDEMPOTENCY_KEY_HEADER.into(),
            AMQPValue::LongString("amqp:shop/orders:orders:m-0".into()),
        );
        let message = message(published(headers), "m-1", 4);
        let written = properties(&letter(&message, "not JSON"), CONTEXT);
        (written, message.body)
    }

    #[test]
    fn a_written_letter_reads_back_with_its_context_and_the_original_headers() {
        let (mut letter_properties, body) = written();
        // The dead-letter queue counted two listings.
        let mut headers = letter_properties.headers().clone().unwrap_or_default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
        letter_properties = letter_properties.with_headers(headers);
        let letter = stored_letter("orders.dlq", 7, &letter_properties, body.clone());
        assert_eq!(letter.reason.as_deref(), Some("invalid_json"));
        assert_eq!(letter.delivery_count, Some(4));
        assert_eq!(letter.last_error.as_deref(), Some("not JSON"));
        assert_eq!(letter.dead_lettered_at_ms, rfc3339_ms(CONTEXT.last_seen));
        assert_eq!(letter.original_id.as_deref(), Some("m-1"));
        assert_eq!(letter.handle, "7");
        assert_eq!(letter.id.len(), 16);
        let names: Vec<&str> = letter
            .headers
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        assert!(
            names.contains(&"tenant") && names.contains(&"routing-key"),
            "{names:?}"
        );
        assert!(
            names.iter().all(|name| !added_header(name)),
            "no letter field or counter: {names:?}"
        );
        // The same letter at another tag, read again, has the same id.
        assert_eq!(
            stored_letter("orders.dlq", 9, &letter_properties, body).id,
            letter.id
        );
    }

    #[test]
    fn a_message_rabbitmq_dead_lettered_itself_has_its_reason_and_time() {
        let mut death = FieldTable::default();
        death.insert("reason".into(), AMQPValue::LongString("expired".into()));
        death.insert("time".into(), AMQPValue::Timestamp(1_764_000_000));
        death.insert("queue".into(), AMQPValue::LongString("orders".into()));
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        let properties = BasicProperties::default().with_headers(headers);
        let letter = stored_letter("orders.dlq", 1, &properties, b"{}".to_vec());
        assert_eq!(letter.reason.as_deref(), Some("expired"));
        assert_eq!(letter.dead_lettered_at_ms, Some(1_764_000_000_000));
        assert!(letter.headers.iter().all(|(name, _)| name != "x-death"));
    }

    #[test]
    fn a_copy_carries_the_original_properties_and_only_the_key_added() {
        let (letter_properties, body) = written();
        let letter = stored_letter("orders.dlq", 1, &letter_properties, body);
        let key = redrive_key(&letter.headers, "amqp:shop/orders:orders", "m-1");
        assert_eq!(key, "amqp:shop/orders:orders:m-0", "an earlier key is kept");
        let copy = copy_properties(&letter_properties, &key);
        assert_eq!(
            copy.message_id().as_ref().map(|id| id.as_str()),
            Some("m-1")
        );
        assert_eq!(
            copy.content_type().as_ref().map(|t| t.as_str()),
            Some("application/json")
        );
        let headers = copy.headers().clone().unwrap_or_default();
        let mut names: Vec<&str> = headers.inner().keys().map(|name| name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["tenant", IDEMPOTENCY_KEY_HEADER]);
        assert_eq!(
            header_text(Some(&headers), IDEMPOTENCY_KEY_HEADER).as_deref(),
            Some(key.as_str())
        );
    }
}
