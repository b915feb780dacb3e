//! Real message brokers other than Redis, as child processes, with clients to produce and inspect.

pub mod sqs;
