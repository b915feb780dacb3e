//! Asynchronous offset commits whose result reaches the consumer's commit callback.
//!
//! `rdkafka` 0.39 commits asynchronously with `rd_kafka_commit(…, async)`, which names no queue
//! for the result, and it sets no native commit callback: librdkafka then drops the result
//! (fede1024/rust-rdkafka#856). A commit the broker refused (`REBALANCE_IN_PROGRESS` while a
//! member joins, …) was neither counted nor sent again, and a partition with no later record to
//! carry a new commit kept its lag for good. Committing with `rd_kafka_commit_queue` onto the
//! consumer's own queue, which the stream consumer polls, makes the result an `OFFSET_COMMIT`
//! event that `rdkafka` hands to `ConsumerContext::commit_callback`. Like [`super::topic_id`],
//! this calls the bindings `rdkafka` re-exports, so it uses `unsafe`.
#![allow(unsafe_code)]

use std::ptr;

use rdkafka::TopicPartitionList;
use rdkafka::bindings as rd;
use rdkafka::consumer::{Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};

/// Sends a commit of `offsets` without waiting for it; its result is delivered to `consumer`'s
/// context when the consumer is next polled.
pub fn commit<C: ConsumerContext>(
    consumer: &StreamConsumer<C>,
    offsets: &TopicPartitionList,
) -> KafkaResult<()> {
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the live client `consumer` owns and `offsets` a live list, which
    // librdkafka copies; the queue handle taken here is released here, after the commit took
    // its own reference to the queue for the result.
    let code = unsafe {
        let queue = rd::rd_kafka_queue_get_consumer(rk);
        if queue.is_null() {
            return Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::UnknownGroup));
        }
        let code = rd::rd_kafka_commit_queue(rk, offsets.ptr(), queue, None, ptr::null_mut());
        rd::rd_kafka_queue_destroy(queue);
        code
    };
    match RDKafkaErrorCode::from(code) {
        RDKafkaErrorCode::NoError => Ok(()),
        error => Err(KafkaError::ConsumerCommit(error)),
    }
}
