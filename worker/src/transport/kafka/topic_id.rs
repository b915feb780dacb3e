//! Topic ids (KIP-516, Kafka ≥ 2.8): the incarnation of a topic. A topic deleted and created
//! again under the same name starts its offsets at 0 again; its id is new.
//!
//! librdkafka 2.12 returns the id from its `DescribeTopics` admin call, which the `rdkafka` crate
//! does not wrap (its `Metadata` has no id either), so this module calls it through the bindings
//! `rdkafka` re-exports (with [`super::async_commit`], the only places the worker uses
//! `unsafe`). Every pointer comes from librdkafka, is used only while the object owning it
//! lives, and every object created here is destroyed by a guard, whatever path is taken.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::client::{Client, ClientContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// The id of a broker that has none (before Kafka 2.8), as librdkafka prints it.
const NO_TOPIC_ID: &str = "AAAAAAAAAAAAAAAAAAAAAA";

/// What `DescribeTopics` says of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Described {
    /// The topic exists; its id (base64, as Kafka's tools print it), `None` where the brokers
    /// keep none.
    Exists(Option<String>),
    /// The brokers answered with this error for the topic (it does not exist, access denied…).
    Failed(RDKafkaErrorCode),
}

/// Destroys what librdkafka allocated, on every path.
struct Owned<T> {
    ptr: *mut T,
    destroy: unsafe extern "C" fn(*mut T),
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` was returned by the librdkafka constructor matching `destroy` and is
            // destroyed once, here.
            unsafe { (self.destroy)(self.ptr) }
        }
    }
}

/// Describes `topics` on `client`'s connections, waiting at most `timeout` (a blocking call:
/// run it off the async runtime).
pub fn describe_topics<C: ClientContext>(
    client: &Client<C>,
    topics: &[String],
    timeout: Duration,
) -> Result<HashMap<String, Described>, KafkaError> {
    let names: Vec<CString> = topics
        .iter()
        .map(|topic| CString::new(topic.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|_| admin_error(RDKafkaErrorCode::InvalidTopic))?;
    let mut pointers: Vec<*const c_char> = names.iter().map(|name| name.as_ptr()).collect();
    let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let rk = client.native_ptr();
    // SAFETY: `rk` is the live client `client` owns; the names outlive the collection, which
    // copies them; each object is destroyed by its guard after its last use.
    unsafe {
        let collection = Owned {
            ptr: rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len()),
            destroy: rd::rd_kafka_TopicCollection_destroy,
        };
        let queue = Owned {
            ptr: rd::rd_kafka_queue_new(rk),
            destroy: rd::rd_kafka_queue_destroy,
        };
        let options = Owned {
            ptr: rd::rd_kafka_AdminOptions_new(
                rk,
                rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
            ),
            destroy: rd::rd_kafka_AdminOptions_destroy,
        };
        let mut errstr = [0 as c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(
            options.ptr,
            timeout_ms,
            errstr.as_mut_ptr(),
            errstr.len(),
        );
        rd::rd_kafka_DescribeTopics(rk, collection.ptr, options.ptr, queue.ptr);
        let event = Owned {
            ptr: rd::rd_kafka_queue_poll(queue.ptr, timeout_ms),
            destroy: rd::rd_kafka_event_destroy,
        };
        if event.ptr.is_null() {
            return Err(admin_error(RDKafkaErrorCode::OperationTimedOut));
        }
        read_result(event.ptr)
    }
}

fn admin_error(code: RDKafkaErrorCode) -> KafkaError {
    KafkaError::AdminOp(code)
}

/// What the `DescribeTopics` result `event` says of each topic.
///
/// # Safety
///
/// `event` is the live event `rd_kafka_DescribeTopics` delivered, for the whole call.
unsafe fn read_result(
    event: *mut rd::rd_kafka_event_t,
) -> Result<HashMap<String, Described>, KafkaError> {
    // SAFETY: `event` is live (the caller's promise); the descriptions belong to it.
    unsafe {
        let code = RDKafkaErrorCode::from(rd::rd_kafka_event_error(event));
        if code != RDKafkaErrorCode::NoError {
            return Err(admin_error(code));
        }
        let result = rd::rd_kafka_event_DescribeTopics_result(event);
        if result.is_null() {
            return Err(admin_error(RDKafkaErrorCode::BadMessage));
        }
        let mut count = 0;
        let descriptions = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
        let mut described = HashMap::with_capacity(count);
        for index in 0..count {
            let (name, state) = read_description(*descriptions.add(index));
            described.insert(name, state);
        }
        Ok(described)
    }
}

/// One topic's name and what its description says.
///
/// # Safety
///
/// `description` belongs to a live `DescribeTopics` result, for the whole call.
unsafe fn read_description(
    description: *const rd::rd_kafka_TopicDescription_t,
) -> (String, Described) {
    // SAFETY: `description` is live (the caller's promise); the strings, error and id belong to
    // it and are copied before it goes.
    unsafe {
        let name = CStr::from_ptr(rd::rd_kafka_TopicDescription_name(description))
            .to_string_lossy()
            .into_owned();
        let error = rd::rd_kafka_TopicDescription_error(description);
        let code = if error.is_null() {
            RDKafkaErrorCode::NoError
        } else {
            RDKafkaErrorCode::from(rd::rd_kafka_error_code(error))
        };
        if code != RDKafkaErrorCode::NoError {
            return (name, Described::Failed(code));
        }
        let id = rd::rd_kafka_TopicDescription_topic_id(description);
        let id = (!id.is_null())
            .then(|| {
                CStr::from_ptr(rd::rd_kafka_Uuid_base64str(id))
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|id| id != NO_TOPIC_ID);
        (name, Described::Exists(id))
    }
}
