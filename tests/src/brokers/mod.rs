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
pub mod sqs;

use anyhow::{Context, Result};
use base64::Engine as _;

use crate::Fixture;
pub use gateway::GatewayBroker;
use kafka::KafkaServer;
use nats::NatsServer;
use rabbitmq::{QueueType, RabbitMq};
use sqs::ElasticMq;

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

    /// Messages of `name` not acknowledged yet: waiting, or delivered and un-acknowledged.
    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64>;

    /// The bodies of the dead letters of `name`, byte-for-byte, with each one's reason. Reading
    /// leaves them in place.
    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>>;

    /// Restarts the broker's server: what it persists survives, connections are cut.
    async fn restart(&mut self, fx: &mut Fixture) -> Result<()>;
}

/// A Redis stream read by a consumer group (the fixture's Redis).
#[derive(Debug)]
pub struct RedisStreamBroker;

/// A Redis reliable list (the fixture's Redis).
#[derive(Debug)]
pub struct RedisListBroker;

/// A standard SQS queue of a real ElasticMQ server.
#[derive(Debug)]
pub struct SqsBroker {
    pub server: ElasticMq,
}

/// A NATS JetStream stream of a real nats-server, read by a durable pull consumer.
#[derive(Debug)]
pub struct NatsBroker {
    pub server: NatsServer,
}

/// Topics of a real Kafka node (three partitions each), read by one consumer group.
#[derive(Debug)]
pub struct KafkaBroker {
    pub server: KafkaServer,
}

const GROUP: &str = "switchboard";

/// `$SWITCHBOARD_CACHE`, else `~/.cache/switchboard`: where the scripts install servers.
pub(crate) fn cache_dir() -> Result<std::path::PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    Ok(match var("SWITCHBOARD_CACHE") {
        Some(dir) => dir.into(),
        None => std::path::PathBuf::from(var("HOME").context("HOME is not set")?)
            .join(".cache/switchboard"),
    })
}

impl BrokerFixture for RedisStreamBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Ok((Self, Vec::new()))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        Ok(format!("redis: {{mode: stream, stream: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        fx.produce(name, bodies).map(drop)
    }

    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64> {
        let mut conn = fx.redis.connection()?;
        let groups: redis::Value =
            match redis::cmd("XINFO").arg("GROUPS").arg(name).query(&mut conn) {
                Ok(groups) => groups,
                // No stream yet: nothing produced.
                Err(err) if err.code() == Some("ERR") => return Ok(0),
                Err(err) => return Err(err.into()),
            };
        let lag = group_field(&groups, "lag");
        match lag {
            Some(lag) => Ok(lag + fx.pending(name, GROUP)?),
            // No group yet: every entry is waiting.
            None => fx.xlen(name),
        }
    }

    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        fx.stream_entries(&format!("{name}.dlq"))?
            .into_iter()
            .map(|letter| {
                let body = letter.get("body").context("dead letter without a body")?;
                Ok((body.clone(), crate::field(&letter, "reason")?))
            })
            .collect()
    }

    async fn restart(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.restart_empty()
    }
}

/// `field` of the consumer group [`GROUP`] in an XINFO GROUPS reply.
fn group_field(groups: &redis::Value, field: &str) -> Option<u64> {
    let redis::Value::Array(groups) = groups else {
        return None;
    };
    groups.iter().find_map(|group| {
        let redis::Value::Array(pairs) = group else {
            return None;
        };
        let text = |value: &redis::Value| match value {
            redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            redis::Value::SimpleString(text) => Some(text.clone()),
            _ => None,
        };
        let named = pairs.chunks_exact(2).any(|pair| {
            text(&pair[0]).as_deref() == Some("name") && text(&pair[1]).as_deref() == Some(GROUP)
        });
        if !named {
            return None;
        }
        pairs.chunks_exact(2).find_map(|pair| {
            (text(&pair[0]).as_deref() == Some(field)).then_some(())?;
            match &pair[1] {
                redis::Value::Int(n) => u64::try_from(*n).ok(),
                _ => None,
            }
        })
    })
}

impl BrokerFixture for RedisListBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Ok((Self, Vec::new()))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        Ok(format!("redis: {{mode: list, list: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        fx.push(name, bodies)
    }

    async fn unacknowledged(&self, fx: &Fixture, name: &str) -> Result<u64> {
        Ok(fx.llen(name)? + fx.processing_items(name)?)
    }

    async fn dead_letters(&self, fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        let mut conn = fx.redis.connection()?;
        let records: Vec<String> = redis::cmd("LRANGE")
            .arg(format!("{name}.dlq"))
            .arg(0)
            .arg(-1)
            .query(&mut conn)?;
        records
            .iter()
            .map(|record| {
                let record: serde_json::Value = serde_json::from_str(record)?;
                let body = match (record["body"].as_str(), record["body_base64"].as_str()) {
                    (Some(body), _) => body.as_bytes().to_vec(),
                    (None, Some(encoded)) => {
                        base64::engine::general_purpose::STANDARD.decode(encoded)?
                    }
                    (None, None) => anyhow::bail!("dead letter without a body: {record}"),
                };
                let reason = record["reason"].as_str().unwrap_or_default().to_owned();
                Ok((body, reason))
            })
            .collect()
    }

    async fn restart(&mut self, fx: &mut Fixture) -> Result<()> {
        fx.redis.restart_empty()
    }
}

impl BrokerFixture for SqsBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        let server = ElasticMq::start()?;
        let env = [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ]
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .to_vec();
        Ok((Self { server }, env))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        use aws_sdk_sqs::types::QueueAttributeName;
        // Short visibility: a killed worker's messages come back quickly.
        let visibility = [(QueueAttributeName::VisibilityTimeout, "2")];
        let url = self.server.create_queue(name, &visibility).await?;
        self.server
            .create_queue(&format!("{name}-dlq"), &[])
            .await?;
        Ok(format!(
            "sqs: {{queueUrl: \"{url}\", endpoint: \"{}\", waitTimeSeconds: 1}}",
            self.server.endpoint()
        ))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let url = self.url(name);
        self.server.send_bodies(&url, bodies).await.map(drop)
    }

    async fn unacknowledged(&self, _fx: &Fixture, name: &str) -> Result<u64> {
        let counts = self.server.count(&self.url(name)).await?;
        Ok(counts.visible + counts.in_flight + counts.delayed)
    }

    async fn dead_letters(&self, _fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.dead_letter_messages(name)
            .await?
            .into_iter()
            .map(|letter| {
                let reason = SqsBroker::attribute(&letter, "x-dlq-reason");
                let body = letter.body().context("dead letter without a body")?;
                Ok((body.as_bytes().to_vec(), reason))
            })
            .collect()
    }

    async fn restart(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.restart()
    }
}

impl SqsBroker {
    /// The URL of queue `name` (ElasticMQ's account is `000000000000`).
    pub fn url(&self, name: &str) -> String {
        format!("{}/000000000000/{name}", self.server.endpoint())
    }

    /// The dead letters of `name` with their attributes. Reading leaves them in place.
    pub async fn dead_letter_messages(
        &self,
        name: &str,
    ) -> Result<Vec<aws_sdk_sqs::types::Message>> {
        let url = self.url(&format!("{name}-dlq"));
        let letters = self.server.receive_all(&url).await?;
        // Visible again at once: reading dead letters must not hide them from the next read.
        for letter in &letters {
            if let Some(receipt) = letter.receipt_handle() {
                self.server
                    .client()
                    .change_message_visibility()
                    .queue_url(&url)
                    .receipt_handle(receipt)
                    .visibility_timeout(0)
                    .send()
                    .await?;
            }
        }
        Ok(letters)
    }

    /// The text of message attribute `name` of `letter`, or `""`.
    pub fn attribute(letter: &aws_sdk_sqs::types::Message, name: &str) -> String {
        letter
            .message_attributes()
            .and_then(|attributes| attributes.get(name))
            .and_then(|value| value.string_value())
            .unwrap_or_default()
            .to_owned()
    }
}

impl NatsBroker {
    /// The stream of queue `name` (`CHAOS` for `chaos`).
    pub fn stream(name: &str) -> String {
        name.to_uppercase()
    }

    /// The subject messages of queue `name` are published to.
    pub fn subject(name: &str) -> String {
        format!("{name}.orders")
    }

    /// Each dead letter of queue `name` with the text of its header `header` (`""` without).
    pub async fn dead_letters_with(
        &self,
        name: &str,
        header: &str,
    ) -> Result<Vec<(Vec<u8>, String)>> {
        let letters = self
            .server
            .stream_messages(&format!("{}_DLQ", Self::stream(name)))
            .await?
            .unwrap_or_default();
        Ok(letters
            .into_iter()
            .map(|letter| {
                let value = letter
                    .headers
                    .get(header)
                    .map(|value| value.as_str().to_owned())
                    .unwrap_or_default();
                (letter.payload.to_vec(), value)
            })
            .collect())
    }
}

impl BrokerFixture for NatsBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        let server = NatsServer::start().await?;
        let env = vec![("NATS_URL".to_owned(), server.url())];
        Ok((Self { server }, env))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        let stream = Self::stream(name);
        self.server
            .create_stream(&stream, &[format!("{name}.>")])
            .await?;
        // Short AckWait: a killed worker's messages come back quickly.
        Ok(format!(
            "nats: {{stream: {stream}, consumer: {GROUP}, ackWaitSeconds: 2}}"
        ))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.server.publish(&Self::subject(name), bodies).await
    }

    async fn unacknowledged(&self, _fx: &Fixture, name: &str) -> Result<u64> {
        let stream = Self::stream(name);
        match self.server.consumer_info(&stream, GROUP).await? {
            Some(info) => Ok(info.num_pending + info.num_ack_pending as u64),
            // No consumer yet: every message is waiting.
            None => Ok(self
                .server
                .jetstream()
                .get_stream(&stream)
                .await?
                .info()
                .await?
                .state
                .messages),
        }
    }

    async fn dead_letters(&self, _fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.dead_letters_with(name, "Switchboard-Reason").await
    }

    async fn restart(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.restart().await
    }
}

/// A durable RabbitMQ queue of a real node, quorum (`CLASSIC = false`) or classic.
#[derive(Debug)]
pub struct AmqpBroker<const CLASSIC: bool> {
    pub server: RabbitMq,
}

/// A quorum queue: RabbitMQ counts deliveries (`x-delivery-count`).
pub type AmqpQuorumBroker = AmqpBroker<false>;
/// A classic queue: the worker counts redeliveries itself.
pub type AmqpClassicBroker = AmqpBroker<true>;

impl<const CLASSIC: bool> AmqpBroker<CLASSIC> {
    pub const QUEUE_TYPE: QueueType = if CLASSIC {
        QueueType::Classic
    } else {
        QueueType::Quorum
    };

    /// Properties with a `message-id` of their own, as a producer would set.
    pub fn properties() -> lapin::BasicProperties {
        let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        lapin::BasicProperties::default().with_message_id(id.into())
    }

    /// Each dead letter of queue `name` with the text of its header `header` (`""` without).
    pub async fn dead_letters_with(
        &self,
        name: &str,
        header: &str,
    ) -> Result<Vec<(Vec<u8>, String)>> {
        let letters = self.server.peek(&format!("{name}.dlq")).await?;
        Ok(letters
            .into_iter()
            .map(|(body, properties)| {
                let value = rabbitmq::header(&properties, header).unwrap_or_default();
                (body, value)
            })
            .collect())
    }
}

impl<const CLASSIC: bool> BrokerFixture for AmqpBroker<CLASSIC> {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        let server = RabbitMq::start()?;
        let env = vec![("AMQP_URL".to_owned(), server.url())];
        Ok((Self { server }, env))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        let arguments = rabbitmq::queue_arguments(Self::QUEUE_TYPE, &[]);
        self.server.declare(name, arguments.clone()).await?;
        self.server
            .declare(&format!("{name}.dlq"), arguments)
            .await?;
        Ok(format!("amqp: {{queue: {name}}}"))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    /// Each message with a `message-id` of its own, as a producer would set.
    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let messages = bodies.into_iter().map(|body| (body, Self::properties()));
        self.server.publish(name, messages).await
    }

    async fn unacknowledged(&self, _fx: &Fixture, name: &str) -> Result<u64> {
        self.server.messages(name).await
    }

    async fn dead_letters(&self, _fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.dead_letters_with(name, "x-switchboard-reason").await
    }

    async fn restart(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.restart()
    }
}

/// Partitions of every topic the contract suite reads from Kafka.
pub const KAFKA_PARTITIONS: i32 = 3;

impl KafkaBroker {
    /// Each dead letter of topic `name` with the text of its header `header` (`""` without).
    pub async fn dead_letters_with(
        &self,
        name: &str,
        header: &str,
    ) -> Result<Vec<(Vec<u8>, String)>> {
        Ok(self
            .server
            .read_all(&format!("{name}.dlq"))
            .await?
            .into_iter()
            .map(|letter| {
                let value = letter.header(header).unwrap_or_default();
                (letter.value.unwrap_or_default(), value)
            })
            .collect())
    }
}

impl BrokerFixture for KafkaBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        Ok((
            Self {
                server: KafkaServer::start()?,
            },
            Vec::new(),
        ))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        self.server.create_topic(name, KAFKA_PARTITIONS).await?;
        self.server.create_topic(&format!("{name}.dlq"), 1).await?;
        // A short session: a killed worker's partitions move to the next one within seconds.
        Ok(format!(
            "kafka: {{bootstrapServers: \"{}\", topics: [{name}], sessionTimeoutSeconds: 6}}",
            self.server.bootstrap()
        ))
    }

    fn delivery(&self) -> &'static str {
        "claimIdleSeconds: 2"
    }

    async fn produce(&self, _fx: &Fixture, name: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.server.produce(name, bodies).await
    }

    async fn unacknowledged(&self, _fx: &Fixture, name: &str) -> Result<u64> {
        self.server.lag(name, &kafka_group(name)).await
    }

    async fn dead_letters(&self, _fx: &Fixture, name: &str) -> Result<Vec<(Vec<u8>, String)>> {
        self.dead_letters_with(name, "x-dlq-reason").await
    }

    async fn restart(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.restart()
    }
}

/// The default consumer group of adapter `test/{name}`.
pub fn kafka_group(name: &str) -> String {
    format!("switchboard-test-{name}")
}
