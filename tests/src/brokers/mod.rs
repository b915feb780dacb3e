//! Every broker behind one trait, so that one contract suite (tests/tests/contract.rs) runs the
//! same behaviours against each: start the real server, create a queue, produce, count what is
//! not acknowledged yet, read the dead letters, restart. The servers are real child processes;
//! PostgreSQL (and the Redis the harness always has) come from the [`Fixture`].

pub mod envelope;
pub mod gateway;
pub mod hydra;
pub mod kafka;
pub mod moto;
pub mod nats;
pub mod rabbitmq;
pub mod redis;
pub mod sqs;

use anyhow::{Context, Result};

use crate::Fixture;
pub use gateway::GatewayBroker;
pub use kafka::{KAFKA_PARTITIONS, KafkaBroker, kafka_group};
pub use nats::NatsBroker;
pub use rabbitmq::{AmqpBroker, AmqpClassicBroker, AmqpQuorumBroker};
pub use redis::{RedisListBroker, RedisStreamBroker};
pub use sqs::SqsBroker;

/// One broker (and mode) as the contract suite drives it.
#[allow(async_fn_in_trait)]
pub trait BrokerFixture: Sized {
    /// Starts the broker's server, if it is not the fixture's Redis, and returns the
    /// environment every worker needs to reach it.
    async fn start(fx: &Fixture) -> Result<(Self, Vec<(String, String)>)>;

    /// Creates queue `name` and its dead-letter destination; returns the body of
    /// `spec.source` (a YAML flow mapping such as `redis: {mode: stream, stream: orders}`).
    async fn create(&self, fx: &Fixture, name: &str) -> Result<String>;

    /// `spec.delivery` settings the broker needs in tests (short reclaim times, …), as the start
    /// of a YAML flow mapping body.
    fn delivery(&self) -> &'static str;

    /// Adds one message per body.
    async fn produce(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()>;

    /// Adds one message per body where one receive finds them all, for a test whose worker
    /// must hold every message at once: a broker that spreads messages over places fetched
    /// apart (Kafka's partitions) puts them in one.
    async fn produce_together(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.produce(fx, name, bodies).await
    }

    /// Messages of `name` not acknowledged yet: waiting, or delivered and un-acknowledged.
    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64>;

    /// The bodies of the dead letters of `name`, byte-for-byte, with each one's reason. Reading
    /// leaves them in place.
    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>>;

    /// Restarts the broker's server: what it persists survives, connections are cut.
    async fn restart(&mut self, fx: &mut Fixture) -> Result<()>;

    /// Kills the broker's server with SIGKILL, whatever it is doing, and starts it again on the
    /// same data and ports: what it confirmed to a producer or consumer survives (the server
    /// runs with the durability a production server has), connections are cut mid-operation.
    async fn crash(&mut self, fx: &mut Fixture) -> Result<()>;

    /// Deletes source `name` (stream, topic, queue) and creates it again, empty, with the
    /// same settings, as an operator does after an incident: the broker may re-use positions
    /// (sequences, offsets) its earlier incarnation gave out.
    async fn recreate(&self, fx: &Fixture, name: &str) -> Result<()>;

    /// Adds one message with `body` and a part that the broker's ordinary client cannot take as
    /// text (a header value that is not UTF-8, a binary key holding a NUL byte, an attribute
    /// that is not a string). The worker stores it (that part encoded) or dead-letters it
    /// byte-identical; either way its neighbours are stored and no connection is dropped.
    async fn produce_undecodable(&self, fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()>;

    /// Adds one message with `body` and `headers` in the broker's native headers (stream
    /// fields beside the body field, SQS or gateway `String` message attributes, NATS headers,
    /// AMQP `headers` table entries as long strings, Kafka record headers). A broker without
    /// headers (a Redis list) fails naming that.
    async fn produce_with_headers(
        &self,
        fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()>;

    /// `host:port` of the server every worker connection goes to (the contract suite puts a
    /// connection-cutting proxy there, tests/src/proxy.rs).
    fn address(&self, fx: &Fixture) -> Result<String>;

    /// Makes the dead-letter destination of `name` refuse every letter for good (a size
    /// limit, a key of the wrong type, …), as a broker's own limits can.
    async fn refuse_dead_letters(&self, fx: &Fixture, name: &str) -> Result<()>;
}

/// The consumer group (Redis) or consumer (NATS) the contract suite's workers share.
pub(crate) const GROUP: &str = "switchboard";

/// `$SWITCHBOARD_CACHE`, else `~/.cache/switchboard`: where the scripts install servers.
pub(crate) fn cache_dir() -> Result<std::path::PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    Ok(match var("SWITCHBOARD_CACHE") {
        Some(dir) => dir.into(),
        None => std::path::PathBuf::from(var("HOME").context("HOME is not set")?)
            .join(".cache/switchboard"),
    })
}
