//! A real Apache Kafka (single node, KRaft: broker and controller in one JVM) as a child process
//! on random loopback ports, and librdkafka clients to create topics, produce records and read
//! what a consumer group committed and what was dead-lettered.
//!
//! The storage directory is formatted once ([`KafkaServer::start`]); [`KafkaServer::restart`]
//! stops the JVM with SIGTERM (a controlled shutdown) and [`KafkaServer::crash`] with SIGKILL,
//! then starts it again on the same ports and log directory, so topics, acknowledged records and
//! committed offsets survive and running workers reconnect by themselves.
//!
//! Kafka clients connect to the addresses the brokers *advertise* once bootstrapped, so a proxy
//! in front of the bootstrap address would see only the first connection. The node has a
//! second listener, `PROXIED`, which advertises a port of its own where a connection-cutting
//! proxy may listen ([`BrokerFixture::address`] declares that route): a client bootstrapped
//! through the proxy makes every connection through it.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use nix::sys::signal::Signal;
use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{Offset, TopicPartitionList};
use tempfile::TempDir;

use super::BrokerFixture;
use crate::Fixture;
use crate::servers::{free_ports, stop_child};
use crate::wait::wait_until;

/// The Kafka version `scripts/kafka.sh` installs and this harness looks for.
pub const KAFKA_VERSION: &str = "4.4.0";

const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const LOG_FILE: &str = "kafka.log";
/// Logged once the broker serves clients.
const STARTED_LINE: &str = "Kafka Server started";

/// One record of a dead-letter topic, as it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    /// The value of header `name`, as text.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(header, _)| header == name)
            .and_then(|(_, value)| value.as_deref())
            .map(|value| String::from_utf8_lossy(value).into_owned())
    }
}

/// A Kafka node of our own, bound to 127.0.0.1.
#[derive(Debug)]
pub struct KafkaServer {
    dir: TempDir,
    lib: PathBuf,
    port: u16,
    /// The `PROXIED` listener's port, which advertises `proxy_port`.
    proxied_port: u16,
    /// Where a proxy in front of the `PROXIED` listener listens (nothing listens there
    /// otherwise).
    proxy_port: u16,
    child: Option<Child>,
}

impl KafkaServer {
    /// Formats a fresh storage directory and starts the node, waiting until it serves clients.
    /// Fails when the jars are not installed (`make kafka-server`).
    pub fn start() -> Result<Self> {
        let lib = lib_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-kafka-")
            .tempdir()?;
        let [port, controller, proxied_port, proxy_port] = free_ports()?;
        let properties = dir.path().join("server.properties");
        std::fs::write(
            &properties,
            server_properties(
                dir.path(),
                Ports {
                    port,
                    controller,
                    proxied: proxied_port,
                    proxy: proxy_port,
                },
            ),
        )?;
        std::fs::write(dir.path().join("log4j2.properties"), LOG4J)?;
        let format = java(dir.path(), &lib)
            .arg("kafka.tools.StorageTool")
            // `=`: a base64url id may start with `-`, which would read as an option.
            .args(["format", "--ignore-formatted"])
            .arg(format!("--cluster-id={}", cluster_id()))
            .arg("-c")
            .arg(&properties)
            .output()
            .context("running Kafka's StorageTool; install java with `apt-get install -y --no-install-recommends openjdk-17-jre-headless`")?;
        ensure!(
            format.status.success(),
            "formatting Kafka's storage failed: {}{}",
            String::from_utf8_lossy(&format.stdout),
            String::from_utf8_lossy(&format.stderr)
        );
        let child = spawn(dir.path(), &lib)?;
        Ok(Self {
            dir,
            lib,
            port,
            proxied_port,
            proxy_port,
            child: Some(child),
        })
    }

    /// `127.0.0.1:PORT`; the same across restarts.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Routes the proxy for [`KafkaServer::bootstrap`] through the `PROXIED` listener, whose
    /// metadata sends clients back to the proxy.
    pub fn route_proxy(&self) {
        crate::proxy::route(
            &self.bootstrap(),
            self.proxy_port,
            &format!("127.0.0.1:{}", self.proxied_port),
        );
    }

    /// The node's (the JVM's) process id, for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Controlled shutdown (SIGTERM, a few seconds), then SIGKILL after 30 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGTERM, STOP_TIMEOUT);
        }
    }

    /// Stops the node and starts it again on the same ports and log directory.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.child = Some(spawn(self.dir.path(), &self.lib)?);
        Ok(())
    }

    /// Kills the node with SIGKILL, whatever it is doing, and starts it again on the same ports
    /// and log directory (what it acknowledged is in the page cache, which survives the JVM).
    pub fn crash(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        }
        self.child = Some(spawn(self.dir.path(), &self.lib)?);
        Ok(())
    }

    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", self.bootstrap());
        config
    }

    /// Creates `topic` with `partitions` partitions (replication factor 1).
    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let results = admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
            )
            .await
            .with_context(|| format!("creating topic {topic}"))?;
        for result in results {
            result.map_err(|(topic, code)| anyhow!("creating topic {topic}: {code}"))?;
        }
        Ok(())
    }

    /// Deletes `topics`.
    pub async fn delete_topics(&self, topics: &[&str]) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let results = admin
            .delete_topics(
                topics,
                &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
            )
            .await
            .context("deleting topics")?;
        for result in results {
            result.map_err(|(topic, code)| anyhow!("deleting topic {topic}: {code}"))?;
        }
        Ok(())
    }

    /// Deletes `topic` and creates it again with `partitions` partitions, waiting until the old
    /// one is gone from the metadata and every partition of the new one has a leader (its
    /// watermarks can be read).
    pub async fn recreate_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.delete_topics(&[topic]).await?;
        let consumer = self.consumer("switchboard-tests-metadata")?;
        let name = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            wait_until(
                REQUEST_TIMEOUT,
                "the deleted topic leaves the metadata",
                || {
                    consumer
                        .fetch_metadata(Some(&name), REQUEST_TIMEOUT)
                        .is_ok_and(|metadata| {
                            metadata.topics().iter().all(|topic| {
                                topic.error().is_some() || topic.partitions().is_empty()
                            })
                        })
                },
            )
        })
        .await??;
        self.create_topic(topic, partitions).await?;
        let consumer = self.consumer("switchboard-tests-metadata")?;
        let name = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            wait_until(
                REQUEST_TIMEOUT,
                "every partition of the new topic has a leader",
                || {
                    (0..partitions).all(|partition| {
                        consumer
                            .fetch_watermarks(&name, partition, Duration::from_secs(2))
                            .is_ok()
                    })
                },
            )
        })
        .await?
    }

    /// Sets topic configuration `key` of `topic` to `value`.
    pub async fn set_topic_config(&self, topic: &str, key: &str, value: &str) -> Result<()> {
        self.set_topic_configs(topic, &[(key, value)]).await
    }

    /// Sets the topic's own configuration to `entries` (AlterConfigs: every other topic
    /// setting goes back to the broker's default).
    pub async fn set_topic_configs(&self, topic: &str, entries: &[(&str, &str)]) -> Result<()> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let mut alter = AlterConfig::new(ResourceSpecifier::Topic(topic));
        for (key, value) in entries {
            alter = alter.set(key, value);
        }
        let results = admin
            .alter_configs(
                &[alter],
                &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
            )
            .await
            .with_context(|| format!("setting {entries:?} of topic {topic}"))?;
        for result in results {
            result.map_err(|(_, code)| anyhow!("setting {entries:?} of topic {topic}: {code}"))?;
        }
        Ok(())
    }

    /// The value of topic configuration `key` of `topic` (DescribeConfigs).
    pub async fn topic_config(&self, topic: &str, key: &str) -> Result<Option<String>> {
        let admin: AdminClient<DefaultClientContext> = self.config().create()?;
        let results = admin
            .describe_configs(
                &[ResourceSpecifier::Topic(topic)],
                &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
            )
            .await
            .with_context(|| format!("describing topic {topic}"))?;
        let config = results
            .into_iter()
            .next()
            .context("DescribeConfigs answered nothing")?
            .map_err(|code| anyhow!("describing topic {topic}: {code}"))?;
        Ok(config.get(key).and_then(|entry| entry.value.clone()))
    }

    /// Produces one record per body (no key: librdkafka spreads them over the partitions),
    /// waiting for every acknowledgement (`acks=all`).
    pub async fn produce(&self, topic: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        self.produce_records(
            topic,
            bodies
                .into_iter()
                .map(|value| Record {
                    key: None,
                    value: Some(value),
                    headers: Vec::new(),
                })
                .collect(),
        )
        .await
    }

    /// Produces one record per body, all with `key`: one partition, so one fetch returns them
    /// together (spread over several, a worker whose store blocks may receive one partition's
    /// records and, receiving ahead only what is already buffered, never the others).
    pub async fn produce_keyed(&self, topic: &str, key: &[u8], bodies: Vec<Vec<u8>>) -> Result<()> {
        let records = bodies
            .into_iter()
            .map(|value| Record {
                key: Some(key.to_vec()),
                value: Some(value),
                headers: Vec::new(),
            })
            .collect();
        self.produce_records(topic, records).await
    }

    /// Produces `records` as they are (key, value, headers), waiting for every acknowledgement.
    pub async fn produce_records(&self, topic: &str, records: Vec<Record>) -> Result<()> {
        let producer: FutureProducer = self
            .config()
            .set("acks", "all")
            .set("linger.ms", "5")
            // Up to the broker's own limit (`message.max.bytes` 1048588): records above the
            // producer's default 1,000,000 bytes, as other clients may send.
            .set("message.max.bytes", "1048576")
            .create()?;
        let sends = records.iter().map(|record| {
            let mut headers = rdkafka::message::OwnedHeaders::new();
            for (key, value) in &record.headers {
                headers = headers.insert(rdkafka::message::Header {
                    key,
                    value: value.as_deref(),
                });
            }
            let mut future = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
            if let Some(key) = &record.key {
                future = future.key(key.as_slice());
            }
            if let Some(value) = &record.value {
                future = future.payload(value.as_slice());
            }
            producer.send(future, REQUEST_TIMEOUT)
        });
        for result in futures::future::join_all(sends).await {
            result.map_err(|(err, _)| anyhow!("producing to {topic}: {err}"))?;
        }
        Ok(())
    }

    /// Produces one record per body in a transaction that is then aborted: the records and
    /// the transaction markers take offsets, and a `read_committed` consumer never sees them.
    pub async fn produce_aborted(&self, topic: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let producer: FutureProducer = self
            .config()
            .set("transactional.id", format!("switchboard-tests-{topic}"))
            .create()?;
        producer.init_transactions(REQUEST_TIMEOUT)?;
        producer.begin_transaction()?;
        let sends = bodies.iter().map(|body| {
            producer.send(
                FutureRecord::<[u8], [u8]>::to(topic).payload(body),
                REQUEST_TIMEOUT,
            )
        });
        for result in futures::future::join_all(sends).await {
            result.map_err(|(err, _)| anyhow!("producing to {topic}: {err}"))?;
        }
        producer.abort_transaction(REQUEST_TIMEOUT)?;
        Ok(())
    }

    fn consumer(&self, group: &str) -> Result<BaseConsumer> {
        Ok(self
            .config()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()?)
    }

    /// Per partition of `topic`: (partition, committed offset of `group` if any, high watermark).
    pub async fn group_offsets(
        &self,
        topic: &str,
        group: &str,
    ) -> Result<Vec<(i32, Option<i64>, i64)>> {
        let consumer = self.consumer(group)?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let metadata = consumer.fetch_metadata(Some(&topic), REQUEST_TIMEOUT)?;
            let mut list = TopicPartitionList::new();
            for partition in metadata
                .topics()
                .iter()
                .flat_map(|topic| topic.partitions())
            {
                list.add_partition(&topic, partition.id());
            }
            let committed = consumer.committed_offsets(list, REQUEST_TIMEOUT)?;
            committed
                .elements()
                .iter()
                .map(|element| {
                    let (_, high) =
                        consumer.fetch_watermarks(&topic, element.partition(), REQUEST_TIMEOUT)?;
                    let committed = match element.offset() {
                        Offset::Offset(offset) => Some(offset),
                        _ => None,
                    };
                    Ok((element.partition(), committed, high))
                })
                .collect()
        })
        .await?
    }

    /// Records of `topic` past `group`'s committed offsets (all of them without commits).
    pub async fn lag(&self, topic: &str, group: &str) -> Result<u64> {
        Ok(self
            .group_offsets(topic, group)
            .await?
            .into_iter()
            .map(|(_, committed, high)| u64::try_from(high - committed.unwrap_or(0)).unwrap_or(0))
            .sum())
    }

    /// The records `topic` holds: its partitions' high − low watermarks summed, nothing read
    /// (0 for a topic without partitions).
    pub async fn depth(&self, topic: &str) -> Result<u64> {
        let consumer = self.consumer("switchboard-tests-reader")?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let depth: i64 = partition_depths(&consumer, &topic)?
                .into_iter()
                .map(|(_, depth)| depth)
                .sum();
            Ok(u64::try_from(depth)?)
        })
        .await?
    }

    /// Every record of `topic`, read from the beginning (no group, nothing committed).
    pub async fn read_all(&self, topic: &str) -> Result<Vec<Record>> {
        let consumer = self.consumer("switchboard-tests-reader")?;
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut list = TopicPartitionList::new();
            let mut expected = 0;
            for (partition, depth) in partition_depths(&consumer, &topic)? {
                expected += depth;
                list.add_partition_offset(&topic, partition, Offset::Beginning)?;
            }
            consumer.assign(&list)?;
            let mut records = Vec::new();
            let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
            while (records.len() as i64) < expected {
                if std::time::Instant::now() > deadline {
                    bail!("read {} of {expected} records of {topic}", records.len());
                }
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(message)) => records.push(Record {
                        key: message.key().map(<[u8]>::to_vec),
                        value: message.payload().map(<[u8]>::to_vec),
                        headers: message
                            .headers()
                            .map(|headers| {
                                headers
                                    .iter()
                                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                    .collect()
                            })
                            .unwrap_or_default(),
                    }),
                    Some(Err(err)) => return Err(err.into()),
                    None => {}
                }
            }
            Ok(records)
        })
        .await?
    }
}

impl Drop for KafkaServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        }
    }
}

/// The directory holding Kafka's jars: `$KAFKA_LIB`, else the cache that `scripts/kafka.sh`
/// fills (complete once its marker file exists).
fn lib_dir() -> Result<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = env("KAFKA_LIB") {
        return Ok(PathBuf::from(dir));
    }
    let cache = match env("SWITCHBOARD_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env("HOME").context("HOME is not set")?).join(".cache/switchboard"),
    };
    let install = cache.join(format!("kafka-{KAFKA_VERSION}"));
    ensure!(
        install.join(".complete").is_file(),
        "Kafka {KAFKA_VERSION} is not installed in {}: run `make kafka-server` (or \
         `scripts/kafka.sh`), or set KAFKA_LIB to a directory holding its jars",
        install.display()
    );
    Ok(install.join("lib"))
}

/// A 22-character base64url UUID, as `kafka-storage.sh random-uuid` prints.
fn cluster_id() -> String {
    use base64::Engine as _;
    let bytes: [u8; 16] = std::array::from_fn(|_| fastrand::u8(..));
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// The node's ports: clients', the controller's, and the `PROXIED` listener's with the proxy's
/// port it advertises.
struct Ports {
    port: u16,
    controller: u16,
    proxied: u16,
    proxy: u16,
}

/// Single node, combined broker and controller, replication factor 1 for the internal topics,
/// no initial rebalance delay (BROKERS.md §4).
fn server_properties(dir: &Path, ports: Ports) -> String {
    let Ports {
        port,
        controller,
        proxied,
        proxy,
    } = ports;
    format!(
        "process.roles=broker,controller\n\
         node.id=1\n\
         controller.quorum.voters=1@127.0.0.1:{controller}\n\
         listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller},PROXIED://127.0.0.1:{proxied}\n\
         advertised.listeners=PLAINTEXT://127.0.0.1:{port},PROXIED://127.0.0.1:{proxy}\n\
         controller.listener.names=CONTROLLER\n\
         inter.broker.listener.name=PLAINTEXT\n\
         listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,PROXIED:PLAINTEXT\n\
         log.dirs={}/data\n\
         num.partitions=1\n\
         auto.create.topics.enable=false\n\
         offsets.topic.replication.factor=1\n\
         offsets.topic.num.partitions=1\n\
         transaction.state.log.replication.factor=1\n\
         transaction.state.log.min.isr=1\n\
         share.coordinator.state.topic.replication.factor=1\n\
         share.coordinator.state.topic.min.isr=1\n\
         group.initial.rebalance.delay.ms=0\n\
         group.min.session.timeout.ms=1000\n",
        dir.display()
    )
}

/// Without a configuration log4j2 prints only errors, and the readiness line is lost.
const LOG4J: &str = "appender.console.type=Console\n\
appender.console.name=STDOUT\n\
appender.console.layout.type=PatternLayout\n\
appender.console.layout.pattern=[%d] %p %m (%c)%n\n\
rootLogger.level=info\n\
rootLogger.appenderRef.stdout.ref=STDOUT\n";

fn java(dir: &Path, lib: &Path) -> Command {
    let mut command = Command::new("java");
    command
        .args(["-Xms256m", "-Xmx512m", "-XX:+UseG1GC"])
        .args(crate::servers::jvm_jit_args())
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            dir.join("log4j2.properties").display()
        ))
        .arg("-cp")
        .arg(format!("{}/*", lib.display()))
        .current_dir(dir)
        .stdin(Stdio::null());
    command
}

/// Starts the node and waits for its start-up line. The log is appended to, so a restart keeps
/// the previous run's lines.
fn spawn(dir: &Path, lib: &Path) -> Result<Child> {
    let log_path = dir.join(LOG_FILE);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let offset = usize::try_from(log.metadata()?.len())?;
    let mut child = java(dir, lib)
        .arg("kafka.Kafka")
        .arg(dir.join("server.properties"))
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting java for Kafka; install it with `apt-get install -y --no-install-recommends openjdk-17-jre-headless`")?;
    let mut exited = None;
    let started = wait_until(STARTUP_TIMEOUT, "Kafka logs that it started", || {
        if let Ok(Some(status)) = child.try_wait() {
            exited = Some(status);
            return true;
        }
        let log = std::fs::read(&log_path).unwrap_or_default();
        String::from_utf8_lossy(log.get(offset..).unwrap_or_default()).contains(STARTED_LINE)
    });
    let failed = match (started, exited) {
        (Ok(()), None) => return Ok(child),
        (Ok(()), Some(status)) => anyhow!("Kafka exited during start-up: {status}"),
        (Err(err), _) => err,
    };
    stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    Err(failed.context(format!(
        "Kafka log {} (last lines, newest first):\n{}",
        log_path.display(),
        tail.join("\n")
    )))
}

/// Topics of a real Kafka node (three partitions each), read by one consumer group.
#[derive(Debug)]
pub struct KafkaBroker {
    pub server: KafkaServer,
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

    /// One key for all: one partition, fetched at once ([`KafkaServer::produce_keyed`]).
    async fn produce_together(
        &self,
        _fx: &Fixture,
        name: &str,
        bodies: Vec<Vec<u8>>,
    ) -> Result<()> {
        self.server.produce_keyed(name, b"together", bodies).await
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

    async fn crash(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.crash()
    }

    async fn recreate(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.server.recreate_topic(name, KAFKA_PARTITIONS).await
    }

    /// The bootstrap address; the proxy started for it listens where the `PROXIED` listener
    /// sends its clients.
    fn address(&self, _fx: &Fixture) -> Result<String> {
        self.server.route_proxy();
        Ok(self.server.bootstrap())
    }

    /// A record without a key whose headers are record headers.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let record = Record {
            key: None,
            value: Some(body),
            headers: headers
                .iter()
                .map(|(header, value)| ((*header).to_owned(), Some(value.as_bytes().to_vec())))
                .collect(),
        };
        self.server.produce_records(name, vec![record]).await
    }

    /// A record whose key is an `IntegerSerializer` 300 (`00 00 01 2c`: NUL bytes) and whose
    /// header `trace` is not UTF-8.
    async fn produce_undecodable(&self, _fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        self.server
            .produce_records(name, vec![undecodable_record(body)])
            .await
    }

    /// The dead-letter topic takes no record larger than 64 bytes: every dead letter (its
    /// `x-dlq-*` headers alone are larger) is refused with `MESSAGE_TOO_LARGE`, for good.
    async fn refuse_dead_letters(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.server
            .set_topic_config(&format!("{name}.dlq"), "max.message.bytes", "64")
            .await
    }
}

/// A record with `body`, a binary key holding NUL bytes (an `IntegerSerializer` 300) and a
/// header value that is not UTF-8.
/// Each partition of `topic` with the records it holds (high − low watermark).
fn partition_depths(consumer: &BaseConsumer, topic: &str) -> Result<Vec<(i32, i64)>> {
    let metadata = consumer.fetch_metadata(Some(topic), REQUEST_TIMEOUT)?;
    metadata
        .topics()
        .iter()
        .flat_map(|topic| topic.partitions())
        .map(|partition| {
            let (low, high) = consumer.fetch_watermarks(topic, partition.id(), REQUEST_TIMEOUT)?;
            Ok((partition.id(), high - low))
        })
        .collect()
}

pub fn undecodable_record(body: Vec<u8>) -> Record {
    Record {
        key: Some(300_i32.to_be_bytes().to_vec()),
        value: Some(body),
        headers: vec![("trace".to_owned(), Some(b"\xff\x00\xfe".to_vec()))],
    }
}

/// The default consumer group of adapter `test/{name}`.
pub fn kafka_group(name: &str) -> String {
    format!("switchboard-test-{name}")
}
