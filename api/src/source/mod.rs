//! The brokers a QueueAdapter can pull from: one file per broker, each with its spec, defaults,
//! CEL rules, the Secret keys it turns into environment variables, its delivery guarantee,
//! its dead-letter target and its autoscaling trigger. The `brokers!` registry below is the one
//! place that knows which brokers exist.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::{Autoscaling, Delivery, DeliveryGuarantee, FieldError, SecretKeyRef};

/// The registry of brokers: each broker once, as its key under `spec.source` (also its module,
/// `api/src/source/<key>.rs`), its spec type and its [`BrokerSpec`] variant, after the line
/// `kubectl explain` shows for it. Everything that lists or dispatches on brokers is derived
/// from here: the `Source` fields, the CEL rules and their messages, [`BROKERS`],
/// [`Source::broker`], [`Source::spec`]. Adding a broker is one entry.
macro_rules! brokers {
    ($( $(#[doc = $doc:literal])* $key:ident: $spec:ident => $variant:ident, )*) => {
        $( pub mod $key; )*

        /// The broker to pull from: exactly one key.
        #[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
        #[x_kube(
            validation = Rule::new(exactly_one_rule()).message(exactly_one_message().as_str()),
            validation = Rule::new(immutable_kind_rule()).message("spec.source: the kind of source is immutable; create a new QueueAdapter instead")
        )]
        #[serde(rename_all = "camelCase")]
        pub struct Source {
            $(
                $(#[doc = $doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $key: Option<$key::$spec>,
            )*
        }

        /// The set broker's spec, by kind: what the worker matches on, once, to turn a spec into
        /// its running pieces.
        #[derive(Debug, Clone, Copy)]
        pub enum BrokerSpec<'a> {
            $( $variant(&'a $key::$spec), )*
        }

        /// Every broker's key under `spec.source`, in the registry's order.
        pub const BROKERS: &[&str] = &[$( stringify!($key) ),*];

        impl Source {
            /// The spec of the one broker that is set, if exactly one is.
            pub fn spec(&self) -> Option<BrokerSpec<'_>> {
                only_one([$( self.$key.as_ref().map(BrokerSpec::$variant) ),*])
            }

            /// The one broker that is set, if exactly one is.
            pub fn broker(&self) -> Option<&dyn Broker> {
                only_one([$( self.$key.as_ref().map(|b| b as &dyn Broker) ),*])
            }

            /// [`Source::broker`], mutable.
            pub fn broker_mut(&mut self) -> Option<&mut dyn Broker> {
                only_one([$( self.$key.as_mut().map(|b| b as &mut dyn Broker) ),*])
            }
        }
    };
}

brokers! {
    /// A Redis stream (consumer group), reliable list, or pub/sub channel.
    redis: RedisSource => Redis,
    /// An Amazon SQS queue (standard or FIFO), or a queue of an SQS-compatible server.
    sqs: SqsSource => Sqs,
    /// A NATS JetStream stream, read by a durable pull consumer.
    nats: NatsSource => Nats,
    /// A RabbitMQ (AMQP 0-9-1) queue, quorum or classic.
    amqp: AmqpSource => Amqp,
    /// Topics of an Apache Kafka cluster, read by a consumer group.
    kafka: KafkaSource => Kafka,
    /// An SQS queue behind an HTTP gateway that takes JWT bearer tokens.
    gateway: GatewaySource => Gateway,
}

/// The brokers' keys as people read a list of them: `redis, sqs, … or gateway` (each key
/// `wrapped`, e.g. in backticks).
pub fn broker_list(wrap: &str) -> String {
    let keys: Vec<String> = BROKERS
        .iter()
        .map(|key| format!("{wrap}{key}{wrap}"))
        .collect();
    match keys.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// What the CEL rule, the local loader and the worker say when no broker or more than one is set.
pub fn exactly_one_broker() -> String {
    format!("exactly one broker must be set ({})", broker_list(""))
}

fn exactly_one_message() -> String {
    format!("spec.source: {}", exactly_one_broker())
}

fn exactly_one_rule() -> String {
    let set: Vec<String> = BROKERS
        .iter()
        .map(|key| format!("has(self.{key})"))
        .collect();
    format!("[{}].filter(x, x).size() == 1", set.join(", "))
}

fn immutable_kind_rule() -> String {
    let same: Vec<String> = BROKERS
        .iter()
        .map(|key| format!("has(self.{key}) == has(oldSelf.{key})"))
        .collect();
    same.join(" && ")
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

impl<'a> FileSource<'a> {
    /// The CA bundle named by a `caConfigMapRef`/`caSecretRef` pair (the CRD allows one).
    pub fn ca(
        config_map: Option<&'a crate::ConfigMapKeyRef>,
        secret: Option<&'a SecretKeyRef>,
    ) -> Option<Self> {
        match (config_map, secret) {
            (Some(map), _) => Some(Self::ConfigMap {
                name: &map.name,
                key: &map.key,
            }),
            (None, Some(secret)) => Some(Self::Secret(secret)),
            (None, None) => None,
        }
    }
}

/// A Secret reference the worker needs in Kubernetes and the spec lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} is required in Kubernetes: the worker reads {env} from that Secret")]
pub struct MissingSecret {
    pub field: &'static str,
    pub env: &'static str,
}

/// KEDA's view of a broker's backlog (`spec.workload.autoscaling`).
#[derive(Debug, Clone, PartialEq)]
pub struct Triggers {
    /// The ScaledObject's triggers (without `authenticationRef`, which the operator adds).
    pub triggers: Vec<serde_json::Value>,
    /// The spec of the TriggerAuthentication the operator writes when the adapter names none of
    /// its own, if the broker has one.
    pub authentication: Option<serde_json::Value>,
}

/// Where a source's messages come from, in OpenTelemetry's messaging conventions (the worker's
/// batch spans).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Messaging {
    /// `messaging.system`: the conventions' name where they have one (`aws_sqs`, `kafka`,
    /// `rabbitmq`; the gateway fronts an SQS queue: `aws_sqs`), else the broker's (`redis`,
    /// `nats`).
    pub system: &'static str,
    /// `messaging.destination.name`: the stream, queue, subject or topics read.
    pub destination: String,
    /// `messaging.consumer.group.name`, where the broker has consumer groups.
    pub consumer_group: Option<String>,
}

/// What every broker's spec tells the operator and the worker.
pub trait Broker: std::fmt::Debug + Send + Sync {
    /// The key under `spec.source` (`redis`, `sqs`, `nats`, `amqp`, `kafka`, `gateway`): the status's `source` and the prefix of
    /// event sources and idempotency keys.
    fn kind(&self) -> &'static str;
    /// The broker-specific mode the status shows (`stream`, `fifo`, …).
    fn mode(&self) -> &'static str;
    fn guarantee(&self) -> DeliveryGuarantee;
    /// Where adapter `adapter`'s (`namespace/name`) messages come from, for traces.
    fn messaging(&self, adapter: &str) -> Messaging;
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
    /// KEDA's triggers on this broker's backlog for adapter `adapter` (`namespace/name`), as
    /// data; `None`: KEDA cannot scale on this broker.
    fn autoscaling(&self, _adapter: &str, _autoscaling: &Autoscaling) -> Option<Triggers> {
        None
    }
}

/// The one `Some` of `options`, if exactly one is.
fn only_one<T, const N: usize>(options: [Option<T>; N]) -> Option<T> {
    let mut set = options.into_iter().flatten();
    let first = set.next()?;
    set.next().is_none().then_some(first)
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::BROKERS;
    use crate::QueueAdapter;

    /// Every list of brokers a user reads in the CRD (`kubectl explain`, the CEL rules and their
    /// messages) is derived from the registry: each broker is in each of them.
    #[test]
    fn every_broker_of_the_registry_is_in_every_list_the_crd_shows() {
        let crd = serde_json::to_value(QueueAdapter::crd()).expect("the CRD serializes");
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
        let source = &spec["spec"]["properties"]["source"];
        let rules = source["x-kubernetes-validations"].to_string();
        let described = [
            source["description"].to_string(),
            spec["status"]["properties"]["source"]["description"].to_string(),
        ];
        let message = super::exactly_one_message();
        assert!(rules.contains(&message), "{message} in {rules}");
        let (_, list) = message.split_once('(').expect("a list");
        let named: Vec<&str> = list
            .trim_end_matches(')')
            .split([',', ' '])
            .filter(|word| !word.is_empty() && *word != "or")
            .collect();
        assert_eq!(named, BROKERS, "{message}");
        for key in BROKERS {
            assert!(source["properties"][key].is_object(), "field {key}");
            assert!(
                rules.contains(&format!("has(self.{key}) == has(oldSelf.{key})")),
                "{rules}"
            );
            assert!(
                rules.contains(&format!("has(self.{key}),"))
                    || rules.contains(&format!("has(self.{key})]")),
                "{rules}"
            );
            for description in &described {
                assert!(
                    description.contains(&format!("`{key}`")),
                    "{key} in {description}"
                );
            }
        }
    }
}
