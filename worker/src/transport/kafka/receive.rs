//! Receive: the records librdkafka fetched turned into messages (each offset of a partition
//! once, a record that cannot be read made undecodable), handed on once their keys are set
//! (see `incarnation.rs`) and their delivery counts decided from the partitions' marks in
//! PostgreSQL.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use rdkafka::message::{BorrowedMessage, Headers as _, Message as _};

use super::client::{Setting, classify};
use super::offsets::TopicPartition;
use super::{IncarnationOf, Kafka, Receipt};
use crate::transport::{Message, TransportError};

/// How long a blocking receive waits for records.
const RECEIVE_WAIT: Duration = Duration::from_secs(1);
/// How long a blocking receive gathers more records after its first one.
const GATHER: Duration = Duration::from_millis(100);
/// Records taken into hand ahead of the batch asked for, in batches: one topic-id read
/// (`identify`) then proves them all, so most receives read none.
const AHEAD_BATCHES: usize = 4;
/// ... and in bytes of bodies: what is taken ahead is held in the worker's memory.
const AHEAD_BYTES: usize = 4 << 20;
/// At most how many events of the consumer's queue a look for a record serves before it takes
/// librdkafka to hold none (a bound against a stream that would wake itself for ever).
const EVENTS_PER_LOOK: usize = 1_000;
/// The header holding the record's key among the event's headers.
const KEY_HEADER: &str = "kafka.key";

/// A record's own headers, read.
struct RecordHeaders {
    headers: Vec<(String, Vec<u8>)>,
    /// Which of them had no value (`null`, not empty).
    null_headers: Vec<usize>,
    /// Why the record cannot be read, if it cannot.
    undecodable: Option<String>,
}

/// A record fetched and not yet handed on.
#[derive(Debug)]
pub(super) struct Fetched {
    pub(super) message: Message<Receipt>,
    /// Whether its topic's incarnation is known (its keys are set).
    pub(super) identified: bool,
    /// Decided once the partition's mark was raised: whether the record may be a redelivery.
    pub(super) below_mark: Option<bool>,
}

/// The highest offset in hand of each partition under its epoch: a fetch restarted while its
/// records were still in hand delivers them again, and a batch never holds an offset twice.
#[derive(Debug, Default)]
pub(super) struct InHand(HashMap<TopicPartition, (u64, i64)>);

impl InHand {
    /// Whether the record at `offset` is new (past every one in hand of its partition and epoch).
    fn admit(&mut self, partition: &TopicPartition, epoch: u64, offset: i64) -> bool {
        match self.0.get_mut(partition) {
            Some((held_epoch, last)) if *held_epoch == epoch => {
                let new = offset > *last;
                *last = (*last).max(offset);
                new
            }
            _ => {
                self.0.insert(partition.clone(), (epoch, offset));
                true
            }
        }
    }
}

impl Kafka {
    /// Up to `max` records, in order, whose keys and delivery counts are set (see
    /// [`Kafka::fetch`] for `block`).
    pub(super) async fn receive_records(
        &mut self,
        max: usize,
        block: bool,
    ) -> Result<Vec<Message<Receipt>>, TransportError> {
        self.fetch(max, block).await?;
        self.drop_revoked();
        self.identify(max).await?;
        let count = self.put_identified_first(max)?;
        if count == 0 {
            return Ok(Vec::new());
        }
        self.count_deliveries(count).await?;
        let mut offsets = self.state.offsets();
        Ok(self
            .fetched
            .drain(..count)
            .map(|fetched| fetched.message)
            .filter(|message| {
                let receipt = &message.receipt;
                offsets.deliver(&receipt.partition, receipt.epoch, receipt.offset)
            })
            .collect())
    }

    /// Records of partitions revoked since they were fetched are not handed on.
    fn drop_revoked(&mut self) {
        let offsets = self.state.offsets();
        self.fetched.retain(|fetched| {
            let receipt = &fetched.message.receipt;
            offsets.epoch(&receipt.partition) == Some(receipt.epoch)
        });
    }

    /// Orders the first `max` records in hand with those whose keys are set first, and returns
    /// how many they are. Records whose keys are not set (their topic is not described now)
    /// stay in hand, in order, behind those handed on; when they are all there is, the error
    /// says so.
    fn put_identified_first(&mut self, max: usize) -> Result<usize, TransportError> {
        let window = self.fetched.len().min(max);
        let (ready, held): (Vec<Fetched>, Vec<Fetched>) = self
            .fetched
            .drain(..window)
            .partition(|fetched| fetched.identified);
        let count = ready.len();
        let held_topics: BTreeSet<Arc<str>> = held
            .iter()
            .map(|fetched| fetched.message.receipt.partition.topic.clone())
            .collect();
        for fetched in held.into_iter().rev().chain(ready.into_iter().rev()) {
            self.fetched.push_front(fetched);
        }
        if count == 0 && !held_topics.is_empty() {
            return Err(TransportError::protocol(format!(
                "the brokers do not describe topic(s) {held_topics:?} (deleted?): their \
                 records in hand are held until their incarnation is known"
            )));
        }
        Ok(count)
    }

    /// Sets the delivery counts of the first `count` records in hand: 1, or, for a record
    /// below its partition's mark (it may have been delivered before), the deliveries counted
    /// under its key.
    async fn count_deliveries(&mut self, count: usize) -> Result<(), TransportError> {
        if self
            .fetched
            .iter()
            .take(count)
            .any(|f| f.below_mark.is_none())
        {
            self.raise_marks(count).await?;
        }
        let redelivered: Vec<usize> = (0..count)
            .filter(|&index| self.fetched[index].below_mark == Some(true))
            .collect();
        if redelivered.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = redelivered
            .iter()
            .map(|&index| self.fetched[index].message.idempotency_key.as_str())
            .collect();
        let counts = self
            .store
            .count_redeliveries(&self.source, &keys)
            .await
            .map_err(|err| TransportError::database("could not count the redeliveries", err))?;
        for (index, count) in redelivered.into_iter().zip(counts) {
            self.fetched[index].message.delivery_count = count;
        }
        Ok(())
    }

    /// Raises the marks of the partitions of the first `count` records in hand and decides which
    /// of them may be redeliveries.
    async fn raise_marks(&mut self, count: usize) -> Result<(), TransportError> {
        // Per partition incarnation: the highest offset in hand + 1, and a record naming it.
        let mut marks: BTreeMap<IncarnationOf<'_>, (i64, &Receipt)> = BTreeMap::new();
        for fetched in self.fetched.iter().take(count) {
            let receipt = &fetched.message.receipt;
            let (mark, _) = marks
                .entry(receipt.incarnation_of())
                .or_insert((0, receipt));
            *mark = (*mark).max(receipt.offset + 1);
        }
        let names: Vec<String> = marks
            .values()
            .map(|(_, receipt)| receipt.incarnation())
            .collect();
        let pairs: Vec<(&str, i64)> = names
            .iter()
            .zip(marks.values())
            .map(|(name, (mark, _))| (name.as_str(), *mark))
            .collect();
        let previous = self
            .store
            .raise_delivery_marks(&self.source, &pairs)
            .await
            .map_err(|err| TransportError::database("could not raise the delivery marks", err))?;
        let previous: BTreeMap<_, Option<i64>> = marks.into_keys().zip(previous).collect();
        let below: Vec<Option<bool>> = self
            .fetched
            .iter()
            .take(count)
            .map(|fetched| {
                let receipt = &fetched.message.receipt;
                let mark = previous.get(&receipt.incarnation_of()).copied().flatten();
                fetched
                    .below_mark
                    .or(Some(mark.is_some_and(|mark| receipt.offset < mark)))
            })
            .collect();
        for (fetched, below) in self.fetched.iter_mut().zip(below) {
            fetched.below_mark = below;
        }
        Ok(())
    }

    /// Turns a fetched record into a message, under the epoch of its partition's assignment.
    /// `None`: the partition is no longer owned.
    fn convert(&self, record: &BorrowedMessage<'_>) -> Option<Message<Receipt>> {
        // The topic's name shared with the incarnation known for it, when one is.
        let topic = self
            .topic_ids
            .get_key_value(record.topic())
            .map_or_else(|| Arc::from(record.topic()), |(topic, _)| topic.clone());
        let partition = TopicPartition {
            topic,
            partition: record.partition(),
        };
        let epoch = self.state.offsets().epoch(&partition)?;
        let key = record.key().map(<[u8]>::to_vec);
        let RecordHeaders {
            mut headers,
            null_headers,
            mut undecodable,
        } = read_headers(record);
        let record_headers = headers.len();
        if let Some(key) = &key {
            headers.push((KEY_HEADER.to_owned(), key.clone()));
        }
        let has_value = record.payload().is_some();
        if !has_value && undecodable.is_none() {
            undecodable = Some("the record has no value (a tombstone)".to_owned());
        }
        Some(Message {
            // Set once the topic's incarnation is known (`identify`).
            idempotency_key: String::new(),
            // The group's committed offsets are the checkpoint. A position in the database
            // would be read by nothing, and its per-partition row, updated by every batch, would
            // make the batches being stored wait for each other's commits.
            position: None,
            external_id: String::new(),
            body: record.payload().unwrap_or_default().to_vec(),
            headers,
            delivery_count: 1,
            enqueued_at_ms: record
                .timestamp()
                .to_millis()
                .and_then(|ms| u64::try_from(ms).ok()),
            undecodable,
            receipt: Receipt {
                partition,
                topic_id: None,
                offset: record.offset(),
                epoch,
                key,
                has_value,
                record_headers,
                null_headers,
            },
        })
    }

    /// Fetches what librdkafka holds, up to `max` records in hand, and more ahead of the
    /// next batches while under [`AHEAD_BATCHES`] batches and [`AHEAD_BYTES`]. With `block` (the pipeline
    /// has nothing in flight), waits a bounded time for the first record, then gathers more for
    /// up to [`GATHER`]: partitions start fetching at different moments, and records of a
    /// partition that come a moment later would otherwise wait behind a whole batch. An error is
    /// returned only when nothing is in hand.
    async fn fetch(&mut self, max: usize, block: bool) -> Result<(), TransportError> {
        let consumer = self.consumer.clone();
        let mut stream = consumer.stream();
        let mut gather_until = None;
        if self.fetched.is_empty() && block {
            gather_until = Some(tokio::time::Instant::now() + RECEIVE_WAIT);
        }
        let mut bytes: usize = self.fetched.iter().map(|f| f.message.body.len()).sum();
        while self.fetched.len() < max
            || (self.fetched.len() < max * AHEAD_BATCHES && bytes < AHEAD_BYTES)
        {
            let next = match gather_until {
                Some(until) => match tokio::time::timeout_at(until, stream.next()).await {
                    Ok(next) => next,
                    Err(_elapsed) => break,
                },
                None => next_now(&mut stream),
            };
            let Some(next) = next else { break };
            match next {
                Ok(record) => {
                    let Some(message) = self.convert(&record) else {
                        continue;
                    };
                    let receipt = &message.receipt;
                    if !self
                        .in_hand
                        .admit(&receipt.partition, receipt.epoch, receipt.offset)
                    {
                        continue;
                    }
                    if block && self.fetched.is_empty() {
                        gather_until = Some(tokio::time::Instant::now() + GATHER);
                    }
                    bytes += message.body.len();
                    self.fetched.push_back(Fetched {
                        message,
                        identified: false,
                        below_mark: None,
                    });
                }
                Err(err) => {
                    if self.fetched.is_empty() {
                        return Err(classify(err, "could not fetch records", Setting::Topics));
                    }
                    tracing::debug!(error = %err, "fetch error after records in hand");
                    break;
                }
            }
        }
        Ok(())
    }
}

/// The stream's next item if it has one now, without waiting. `rdkafka`'s stream serves one
/// event of the consumer's queue per poll (a commit's result — one per batch —, a rebalance) and
/// then says "not ready" after waking its task at once: only a "not ready" without that wake
/// means that nothing is there.
fn next_now<S: Stream + Unpin>(stream: &mut S) -> Option<S::Item> {
    let woken = Arc::new(Woken::default());
    let waker = Waker::from(woken.clone());
    let mut context = Context::from_waker(&waker);
    for _ in 0..EVENTS_PER_LOOK {
        woken.0.store(false, Ordering::SeqCst);
        match stream.poll_next_unpin(&mut context) {
            Poll::Ready(item) => return item,
            Poll::Pending if woken.0.load(Ordering::SeqCst) => continue,
            Poll::Pending => return None,
        }
    }
    None
}

/// Whether a task was woken.
#[derive(Debug, Default)]
struct Woken(AtomicBool);

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The record's headers, in order. rdkafka panics on a header name that is not UTF-8: that
/// record is undecodable.
fn read_headers(record: &BorrowedMessage<'_>) -> RecordHeaders {
    let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut headers = Vec::new();
        let mut null_headers = Vec::new();
        if let Some(list) = record.headers() {
            for (index, header) in list.iter().enumerate() {
                if header.value.is_none() {
                    null_headers.push(index);
                }
                headers.push((
                    header.key.to_owned(),
                    header.value.unwrap_or_default().to_vec(),
                ));
            }
        }
        (headers, null_headers)
    }));
    match read {
        Ok((headers, null_headers)) => RecordHeaders {
            headers,
            null_headers,
            undecodable: None,
        },
        Err(_) => RecordHeaders {
            headers: Vec::new(),
            null_headers: Vec::new(),
            undecodable: Some("a header name of the record is not UTF-8".to_owned()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_named_by_its_topic_incarnation_partition_and_offset() {
        let mut receipt = Receipt {
            partition: TopicPartition {
                topic: Arc::from("orders"),
                partition: 2,
            },
            topic_id: Some(Arc::from("Xq3b")),
            offset: 17,
            epoch: 1,
            key: None,
            has_value: true,
            record_headers: 0,
            null_headers: Vec::new(),
        };
        assert_eq!(receipt.incarnation(), "orders:Xq3b:2");
        assert_eq!(receipt.external_id(), "orders:Xq3b:2:17");
        receipt.topic_id = None;
        receipt.offset = i64::MAX;
        assert_eq!(receipt.external_id(), format!("orders:2:{}", i64::MAX));
    }

    #[test]
    fn a_look_serves_the_events_ahead_of_a_record_and_stops_where_nothing_is_ready() {
        // Three events served (each "not ready" after waking the task), a record, then nothing.
        let mut polls = 0;
        let mut stream = futures::stream::poll_fn(|context: &mut Context<'_>| {
            polls += 1;
            match polls {
                1..=3 => {
                    context.waker().wake_by_ref();
                    Poll::Pending
                }
                4 => Poll::Ready(Some("record")),
                _ => Poll::Pending,
            }
        });
        assert_eq!(next_now(&mut stream), Some("record"));
        assert_eq!(next_now(&mut stream), None);
        drop(stream);
        assert_eq!(polls, 5, "one look past the record");
    }

    #[test]
    fn a_record_fetched_again_while_in_hand_is_not_taken_twice() {
        let partition = TopicPartition {
            topic: Arc::from("orders"),
            partition: 0,
        };
        let mut in_hand = InHand::default();
        for offset in 5..8 {
            assert!(in_hand.admit(&partition, 1, offset));
        }
        // The fetch restarted from 5 while 5..8 were still in hand.
        for offset in 5..8 {
            assert!(!in_hand.admit(&partition, 1, offset), "{offset} twice");
        }
        assert!(in_hand.admit(&partition, 1, 8));
        // A new assignment (or a re-created topic) reads from wherever it starts.
        assert!(in_hand.admit(&partition, 2, 0));
    }
}
