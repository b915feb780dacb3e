//! The brokers a QueueAdapter can pull from: one file per broker, each with its spec, defaults,
//! CEL rules, the Secret keys it turns into environment variables, its delivery guarantee and
//! its dead-letter target. [`Source::broker`] is the one place that knows which brokers exist.

pub mod amqp;
pub mod gateway;
pub mod kafka;
pub mod nats;
pub mod redis;
pub mod sqs;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::{Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};
use amqp::AmqpSource;
use gateway::GatewaySource;
use kafka::KafkaSource;
use nats::NatsSource;
use redis::RedisSource;
use sqs::SqsSource;

/// The broker to pull from: exactly one key.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[x_kube(
    validation = Rule::new("[has(self.redis), has(self.sqs), has(self.nats), has(self.amqp), has(self.kafka), has(self.gateway)].filter(x, x).size() == 1").message("spec.source: exactly one broker must be set (redis, sqs, nats, amqp, kafka or gateway)"),
    validation = Rule::new("has(self.redis) == has(oldSelf.redis) && has(self.sqs) == has(oldSelf.sqs) && has(self.nats) == has(oldSelf.nats) && has(self.amqp) == has(oldSelf.amqp) && has(self.kafka) == has(oldSelf.kafka) && has(self.gateway) == has(oldSelf.gateway)").message("spec.source: the kind of source is immutable; create a new QueueAdapter instead")
)]
#[serde(rename_all = "camelCase")]
pub struct Source {
    /// A Redis stream (consumer group), reliable list, or pub/sub channel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisSource>,
    /// An Amazon SQS queue (standard or FIFO), or a queue of an SQS-compatible server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sqs: Option<SqsSource>,
    /// A NATS JetStream stream, read by a durable pull consumer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsSource>,
    /// A RabbitMQ (AMQP 0-9-1) queue, quorum or classic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amqp: Option<AmqpSource>,
    /// Topics of an Apache Kafka cluster, read by a consumer group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kafka: Option<KafkaSource>,
    /// An SQS queue behind an HTTP gateway that takes JWT bearer tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewaySource>,
}

/// A Secret key the worker reads from its environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SecretEnv<'a> {
    /// The environment variable the worker reads (`REDIS_URL`, `AWS_ACCESS_KEY_ID`, …).
    pub env: &'static str,
    pub secret: &'a SecretKeyRef,
}

/// A file the worker reads, mounted read-only from a ConfigMap or Secret key (a CA bundle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MountedFile<'a> {
    /// The environment variable holding the file's path.
    pub env: &'static str,
    /// The pod volume's name.
    pub volume: &'static str,
    /// Where the volume is mounted, and the file's name in it.
    pub dir: &'static str,
    pub file: &'static str,
    pub source: FileSource<'a>,
}

/// Where a [`MountedFile`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileSource<'a> {
    ConfigMap { name: &'a str, key: &'a str },
    Secret(&'a SecretKeyRef),
}

/// A Secret reference the worker needs in Kubernetes and the spec lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} is required in Kubernetes: the worker reads {env} from that Secret")]
pub struct MissingSecret {
    pub field: &'static str,
    pub env: &'static str,
}

/// What every broker's spec tells the operator and the worker.
pub trait Broker: std::fmt::Debug + Send + Sync {
    /// The key under `spec.source` (`redis`, `sqs`, `nats`, `amqp`, `kafka`, `gateway`): the status's `source` and the prefix of
    /// event sources and idempotency keys.
    fn kind(&self) -> &'static str;
    /// The broker-specific mode the status shows (`stream`, `fifo`, …).
    fn mode(&self) -> &'static str;
    fn guarantee(&self) -> DeliveryGuarantee;
    /// The Secret keys the worker reads, each with the environment variable it becomes.
    /// Fails when a reference the worker needs in Kubernetes is missing.
    fn secret_env(&self) -> Result<Vec<SecretEnv<'_>>, MissingSecret>;
    /// The files the worker reads, mounted from ConfigMap or Secret keys.
    fn mounted_files(&self) -> Vec<MountedFile<'_>> {
        Vec::new()
    }
    /// Removes every Secret reference (for copies kept outside Kubernetes, such as the
    /// `adapters.config` row).
    fn strip_secrets(&mut self);
    /// The rules of the CRD schema and CEL for this broker, checked in Rust.
    fn validate(&self, delivery: &Delivery, fail: &mut dyn FnMut(FieldError));
}

impl Source {
    /// The one broker that is set, if exactly one is.
    pub fn broker(&self) -> Option<&dyn Broker> {
        let brokers: [Option<&dyn Broker>; 6] = [
            self.redis.as_ref().map(|b| b as &dyn Broker),
            self.sqs.as_ref().map(|b| b as &dyn Broker),
            self.nats.as_ref().map(|b| b as &dyn Broker),
            self.amqp.as_ref().map(|b| b as &dyn Broker),
            self.kafka.as_ref().map(|b| b as &dyn Broker),
            self.gateway.as_ref().map(|b| b as &dyn Broker),
        ];
        only_one(brokers)
    }

    /// [`Source::broker`], mutable.
    pub fn broker_mut(&mut self) -> Option<&mut dyn Broker> {
        let brokers: [Option<&mut dyn Broker>; 6] = [
            self.redis.as_mut().map(|b| b as &mut dyn Broker),
            self.sqs.as_mut().map(|b| b as &mut dyn Broker),
            self.nats.as_mut().map(|b| b as &mut dyn Broker),
            self.amqp.as_mut().map(|b| b as &mut dyn Broker),
            self.kafka.as_mut().map(|b| b as &mut dyn Broker),
            self.gateway.as_mut().map(|b| b as &mut dyn Broker),
        ];
        only_one(brokers)
    }
}

/// The one `Some` of `options`, if exactly one is.
fn only_one<T, const N: usize>(options: [Option<T>; N]) -> Option<T> {
    let mut set = options.into_iter().flatten();
    let first = set.next()?;
    set.next().is_none().then_some(first)
}
