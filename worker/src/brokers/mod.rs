//! The worker's registry of brokers: the one match that turns a broker's spec into its running
//! pieces. Each broker's file here implements [`Plugin`] for its spec: the transport the run
//! loop drives, the reader `switchboard-worker dlq` uses, and `switchboard-worker send` (which
//! `dlq redrive` also puts the letters kept in PostgreSQL back with). The
//! commands above (the run loop in `lib.rs`, `dlq`, `send`) are generic: each hands a [`Use`] to
//! [`with_plugin`] and never names a broker.
//!
//! Adding a broker here is its file and one entry in `plugins!`; the match is exhaustive over
//! `switchboard_api::BrokerSpec`, so a broker of the API's registry without an entry here does
//! not compile.

use std::time::Duration;

use prometheus_client::registry::Registry;
use switchboard_api::{Broker, BrokerSpec, DeadLetter, QueueAdapter, Source};
use switchboard_store::Store;

use crate::WorkerError;
use crate::transport::reader::{DeadLetterReader, StoredLetter};
use crate::transport::{IDEMPOTENCY_KEY_HEADER, Transport};

/// What a broker's spec turns into in the worker.
pub(crate) trait Plugin: Broker {
    /// The broker as messages name it (`NATS JetStream`, `Redis pub/sub`).
    fn title(&self) -> &'static str;

    /// Builds the broker's transport for `context`, its metrics in `run`'s registry, and hands
    /// it to `run`.
    async fn run<L: Loop>(&self, context: Context<'_>, run: L) -> Result<(), WorkerError>;

    /// Opens the broker's dead-letter reader for `adapter` and hands it to `letters`; without
    /// one (the default), `letters` reads only what PostgreSQL keeps.
    async fn read_letters<D: Letters>(
        &self,
        _adapter: &QueueAdapter,
        letters: D,
    ) -> Result<(), WorkerError> {
        letters.unread(self.title()).await
    }

    /// Sends one message to the source: `body` with `headers` (stream fields, attributes,
    /// headers, as the broker has them), and returns its id once the broker confirmed it
    /// (`switchboard-worker send`).
    async fn send(
        &self,
        adapter: &QueueAdapter,
        body: &[u8],
        headers: &[(String, Vec<u8>)],
    ) -> Result<String, WorkerError>;

    /// Puts `letter`, a dead letter kept in PostgreSQL, back on the source with the idempotency
    /// key `key` (`dlq redrive`), and returns once the broker confirmed it: by default
    /// [`Plugin::send`] of its body and headers, `key` in [`IDEMPOTENCY_KEY_HEADER`] (an older
    /// key among them dropped).
    async fn resend(
        &self,
        adapter: &QueueAdapter,
        letter: &StoredLetter,
        key: &str,
    ) -> Result<(), WorkerError> {
        let mut headers: Vec<(String, Vec<u8>)> = letter
            .headers
            .iter()
            .filter(|(name, _)| name != IDEMPOTENCY_KEY_HEADER)
            .cloned()
            .collect();
        headers.push((IDEMPOTENCY_KEY_HEADER.to_owned(), key.as_bytes().to_vec()));
        self.send(adapter, &letter.body, &headers).await.map(drop)
    }
}

/// The value of header `name` among `headers`, if it is there and UTF-8 (where a message
/// names what the spec does not: a subject, a channel, a topic).
fn header_text(headers: &[(String, Vec<u8>)], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|(header, _)| header == name)
        .and_then(|(_, value)| String::from_utf8(value.clone()).ok())
}

/// The run loop, as a plugin sees it: it drives the transport the plugin built.
pub(crate) trait Loop {
    /// Where the transport registers its own metrics.
    fn registry(&mut self) -> &mut Registry;
    /// Runs the loop over `transport`.
    async fn drive<T: Transport>(
        self,
        transport: T,
        broker: &dyn Broker,
    ) -> Result<(), WorkerError>;
}

/// `switchboard-worker dlq`, as a plugin sees it.
pub(crate) trait Letters {
    /// Runs the command over the broker's reader.
    async fn read<R: DeadLetterReader>(self, reader: R) -> Result<(), WorkerError>;
    /// Runs the command without a reader at the broker (`broker`: whose letters, for people).
    async fn unread(self, broker: &'static str) -> Result<(), WorkerError>;
}

/// Something to do with the set broker's plugin, whichever it is.
pub(crate) trait Use {
    type Output;
    async fn with<P: Plugin>(self, plugin: &P) -> Self::Output;
}

/// What the transport of an adapter is built from.
pub(crate) struct Context<'a> {
    pub adapter: &'a QueueAdapter,
    /// `namespace/name`.
    pub name: String,
    pub consumer: String,
    pub store: Store,
}

impl<'a> Context<'a> {
    pub fn batch_size(&self) -> usize {
        self.adapter.spec.delivery.batch_size as usize
    }

    pub fn max_deliveries(&self) -> u64 {
        u64::from(self.adapter.spec.delivery.max_deliveries)
    }

    pub fn claim_idle(&self) -> Duration {
        Duration::from_secs(u64::from(self.adapter.spec.delivery.claim_idle_seconds))
    }

    pub fn dead_letter(&self) -> &'a DeadLetter {
        &self.adapter.spec.delivery.dead_letter
    }
}

/// The registry: each broker's module here and its `BrokerSpec` variant, once.
macro_rules! plugins {
    ($( $module:ident: $variant:ident, )*) => {
        $( mod $module; )*

        /// Does `user` with the plugin of `source`'s broker; `None` when not exactly one is set.
        pub(crate) async fn with_plugin<U: Use>(source: &Source, user: U) -> Option<U::Output> {
            Some(match source.spec()? {
                $( BrokerSpec::$variant(spec) => user.with(spec).await, )*
            })
        }
    };
}

plugins! {
    redis: Redis,
    sqs: Sqs,
    nats: Nats,
    amqp: Amqp,
    kafka: Kafka,
    gateway: Gateway,
}
