//! A real ElasticMQ (an SQS-compatible server written for tests) as a child process on a random
//! loopback port, and an `aws-sdk-sqs` client with helpers to produce messages and inspect queues.
//!
//! ElasticMQ's `ApproximateNumberOf*` counts are exact and immediate: a message sent, received,
//! purged or delayed is counted correctly by the very next `GetQueueAttributes` (unlike AWS,
//! where they are eventually consistent), so tests may assert them with `==` right away.
//! `PurgeQueue` can also be repeated at once (no 60 s `PurgeQueueInProgress` as on AWS).

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{Credentials, SharedCredentialsProvider};
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, MessageSystemAttributeNameForSends,
    MessageSystemAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry,
};
use nix::sys::signal::Signal;
use tempfile::TempDir;
use tokio::sync::oneshot;

use super::BrokerFixture;
use crate::Fixture;
use crate::servers::{free_port, stop_child};
use crate::wait::{wait_for, wait_until};

/// The ElasticMQ version `scripts/elasticmq.sh` installs and this harness looks for.
pub const ELASTICMQ_VERSION: &str = "1.7.1";

const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const LOG_FILE: &str = "elasticmq.log";
/// The start of the line ElasticMQ logs once it accepts requests, followed by `PORT, visible …`.
const STARTED_LINE: &str = "Started SQS rest server, bind address 127.0.0.1:";
/// Logged when the port is taken; the JVM then keeps running without serving anything.
const BIND_FAILED_LINE: &str = "Cannot start SQS rest server";
/// The most entries SQS accepts in one batch request.
const BATCH_LIMIT: usize = 10;
/// How long [`ElasticMq::receive_all`] hides what it read: longer than any test looks at it.
const DRAIN_VISIBILITY_TIMEOUT_SECS: i32 = 300;

/// The three counts of a queue, from `GetQueueAttributes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueCounts {
    /// `ApproximateNumberOfMessages`: ready to be received.
    pub visible: u64,
    /// `ApproximateNumberOfMessagesNotVisible`: received and neither deleted nor visible again.
    pub in_flight: u64,
    /// `ApproximateNumberOfMessagesDelayed`: sent with a delay that has not passed yet.
    pub delayed: u64,
}

/// An ElasticMQ server of our own, bound to 127.0.0.1, with strict SQS limits.
///
/// Queues and messages are persisted in the server's temporary directory: after
/// [`ElasticMq::restart`] (or a kill and restart) they are back, un-acknowledged messages visible
/// again with their receive counts kept.
#[derive(Debug)]
pub struct ElasticMq {
    dir: TempDir,
    lib: PathBuf,
    port: u16,
    child: Option<Child>,
    client: Client,
}

impl ElasticMq {
    /// Starts a server on a reserved free port, waiting until it accepts requests. Fails when
    /// the jars are not installed (`make sqs-server`).
    pub fn start() -> Result<Self> {
        let lib = lib_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-elasticmq-")
            .tempdir()?;
        let (child, port) = spawn(dir.path(), &lib, free_port()?)?;
        Ok(Self {
            client: sqs_client(&format!("http://127.0.0.1:{port}"), "us-east-1"),
            dir,
            lib,
            port,
            child: Some(child),
        })
    }

    /// `http://127.0.0.1:PORT`, the SQS endpoint; it stays the same across restarts.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The port it serves on; the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's (the JVM's) process id, for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// An SQS client for [`ElasticMq::endpoint`]: region us-east-1, static credentials, nothing
    /// read from the environment or `~/.aws`.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Graceful shutdown (SIGTERM, about 2 s), then SIGKILL if it takes longer than 10 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGTERM, STOP_TIMEOUT);
        }
    }

    /// SIGKILL: the server dies at once, in-flight requests fail.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        }
    }

    /// Stops the server (if running) and starts it again on the same port, waiting until it
    /// accepts requests. Queues and messages survive (they are persisted).
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let (child, port) = spawn(self.dir.path(), &self.lib, self.port)?;
        self.child = Some(child);
        ensure!(
            port == self.port,
            "ElasticMQ came back on port {port}, not {}",
            self.port
        );
        Ok(())
    }

    /// Creates a standard queue (or a FIFO one, given the attributes) and returns its URL,
    /// `http://127.0.0.1:PORT/000000000000/{name}`.
    pub async fn create_queue(
        &self,
        name: &str,
        attributes: &[(QueueAttributeName, &str)],
    ) -> Result<String> {
        let mut request = self.client.create_queue().queue_name(name);
        for (attribute, value) in attributes {
            request = request.attributes(attribute.clone(), *value);
        }
        let output = request
            .send()
            .await
            .map_err(|err| sqs_error(&format!("CreateQueue {name}"), err))?;
        output
            .queue_url
            .with_context(|| format!("CreateQueue {name} returned no QueueUrl"))
    }

    /// Creates a FIFO queue with content-based deduplication (identical bodies sent within five
    /// minutes are stored once); `name` must end with `.fifo`.
    pub async fn create_fifo_queue(&self, name: &str) -> Result<String> {
        ensure!(
            name.ends_with(".fifo"),
            "a FIFO queue's name must end with .fifo: {name}"
        );
        self.create_queue(
            name,
            &[
                (QueueAttributeName::FifoQueue, "true"),
                (QueueAttributeName::ContentBasedDeduplication, "true"),
            ],
        )
        .await
    }

    /// The queue's ARN, e.g. for another queue's `RedrivePolicy` (`deadLetterTargetArn`).
    pub async fn queue_arn(&self, queue_url: &str) -> Result<String> {
        let output = self
            .client
            .get_queue_attributes()
            .queue_url(queue_url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("GetQueueAttributes {queue_url}"), err))?;
        output
            .attributes
            .and_then(|mut attributes| attributes.remove(&QueueAttributeName::QueueArn))
            .with_context(|| format!("GetQueueAttributes {queue_url} returned no QueueArn"))
    }

    /// Sends every body to a standard queue with `SendMessageBatch`, ten per request, and returns
    /// the message ids in the order of the bodies. SQS bodies are text: each must be UTF-8.
    pub async fn send_bodies(
        &self,
        queue_url: &str,
        bodies: impl IntoIterator<Item = Vec<u8>>,
    ) -> Result<Vec<String>> {
        let bodies = bodies
            .into_iter()
            .map(|body| String::from_utf8(body).context("an SQS message body must be UTF-8"))
            .collect::<Result<Vec<_>>>()?;
        let mut ids = Vec::with_capacity(bodies.len());
        for chunk in bodies.chunks(BATCH_LIMIT) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(index, body)| {
                    SendMessageBatchRequestEntry::builder()
                        .id(index.to_string())
                        .message_body(body)
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()?;
            let output = self
                .client
                .send_message_batch()
                .queue_url(queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|err| sqs_error(&format!("SendMessageBatch {queue_url}"), err))?;
            if let Some(failed) = output.failed().first() {
                bail!(
                    "SendMessageBatch {queue_url} refused {} of {} entries, e.g. {}: {}",
                    output.failed().len(),
                    chunk.len(),
                    failed.code(),
                    failed.message().unwrap_or_default()
                );
            }
            let mut sent = output
                .successful()
                .iter()
                .map(|entry| Ok((entry.id().parse::<usize>()?, entry.message_id().to_owned())))
                .collect::<Result<Vec<_>>>()?;
            ensure!(
                sent.len() == chunk.len(),
                "SendMessageBatch {queue_url} confirmed {} of {} entries",
                sent.len(),
                chunk.len()
            );
            sent.sort_unstable();
            ids.extend(sent.into_iter().map(|(_, id)| id));
        }
        Ok(ids)
    }

    /// Sends one body to a FIFO queue in message group `group` and returns its message id.
    pub async fn send_fifo(&self, queue_url: &str, group: &str, body: &str) -> Result<String> {
        let output = self
            .client
            .send_message()
            .queue_url(queue_url)
            .message_group_id(group)
            .message_body(body)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("SendMessage {queue_url}"), err))?;
        output
            .message_id
            .with_context(|| format!("SendMessage {queue_url} returned no MessageId"))
    }

    /// Visible, in-flight and delayed messages of a queue (exact on ElasticMQ, see the module).
    pub async fn count(&self, queue_url: &str) -> Result<QueueCounts> {
        let output = self
            .client
            .get_queue_attributes()
            .queue_url(queue_url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("GetQueueAttributes {queue_url}"), err))?;
        let attributes = output.attributes.unwrap_or_default();
        let read = |name: QueueAttributeName| -> Result<u64> {
            let value = attributes.get(&name).with_context(|| {
                format!(
                    "GetQueueAttributes {queue_url} returned no {}",
                    name.as_str()
                )
            })?;
            value
                .parse()
                .with_context(|| format!("{} is not a count: {value:?}", name.as_str()))
        };
        Ok(QueueCounts {
            visible: read(QueueAttributeName::ApproximateNumberOfMessages)?,
            in_flight: read(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)?,
            delayed: read(QueueAttributeName::ApproximateNumberOfMessagesDelayed)?,
        })
    }

    /// Receives every visible message of a queue (e.g. a dead-letter queue) with all message and
    /// system attributes, deleting nothing: they stay in flight for five minutes. Meant for
    /// standard queues: on a FIFO queue a group's later messages stay blocked behind the ones
    /// already received, so only the first batch of each group comes back.
    pub async fn receive_all(&self, queue_url: &str) -> Result<Vec<Message>> {
        let mut messages = Vec::new();
        loop {
            let output = self
                .client
                .receive_message()
                .queue_url(queue_url)
                .max_number_of_messages(BATCH_LIMIT as i32)
                .wait_time_seconds(0)
                .visibility_timeout(DRAIN_VISIBILITY_TIMEOUT_SECS)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .map_err(|err| sqs_error(&format!("ReceiveMessage {queue_url}"), err))?;
            match output.messages {
                Some(batch) if !batch.is_empty() => messages.extend(batch),
                // A short poll on ElasticMQ sees the whole queue: empty means drained.
                _ => return Ok(messages),
            }
        }
    }

    /// Deletes a queue and its messages.
    pub async fn delete_queue(&self, queue_url: &str) -> Result<()> {
        self.client
            .delete_queue()
            .queue_url(queue_url)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("DeleteQueue {queue_url}"), err))?;
        Ok(())
    }

    /// Sends one UTF-8 body with message attributes (name, data type, value: a `Binary…` type
    /// carries the bytes, any other the text); returns its message id.
    pub async fn send_with_attributes(
        &self,
        queue_url: &str,
        body: Vec<u8>,
        attributes: Vec<(&str, &str, Vec<u8>)>,
    ) -> Result<String> {
        let mut send = self
            .client
            .send_message()
            .queue_url(queue_url)
            .message_body(String::from_utf8(body).context("an SQS message body must be UTF-8")?);
        for (name, data_type, value) in attributes {
            let attribute = MessageAttributeValue::builder().data_type(data_type);
            let attribute = if data_type.starts_with("Binary") {
                attribute.binary_value(aws_sdk_sqs::primitives::Blob::new(value))
            } else {
                attribute.string_value(String::from_utf8(value)?)
            };
            send = send.message_attributes(name, attribute.build()?);
        }
        let output = send
            .send()
            .await
            .map_err(|err| sqs_error(&format!("SendMessage {queue_url}"), err))?;
        output
            .message_id
            .with_context(|| format!("SendMessage {queue_url} returned no MessageId"))
    }

    /// Deletes every message of a queue, in flight and delayed ones included.
    pub async fn purge(&self, queue_url: &str) -> Result<()> {
        self.client
            .purge_queue()
            .queue_url(queue_url)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("PurgeQueue {queue_url}"), err))?;
        Ok(())
    }
}

impl Drop for ElasticMq {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The directory holding ElasticMQ's jars: `$ELASTICMQ_LIB`, else the cache that
/// `scripts/elasticmq.sh` fills (complete once its marker file exists).
fn lib_dir() -> Result<PathBuf> {
    if let Some(dir) = non_empty_env("ELASTICMQ_LIB") {
        let dir = PathBuf::from(dir);
        ensure!(
            has_server_jar(&dir),
            "ELASTICMQ_LIB={} holds no elasticmq-server_2.13-*.jar; unset it to use the cache \
             that `make sqs-server` (scripts/elasticmq.sh) fills",
            dir.display()
        );
        return Ok(dir);
    }
    let install = super::cache_dir()?.join(format!("elasticmq-{ELASTICMQ_VERSION}"));
    ensure!(
        install.join(".complete").is_file(),
        "ElasticMQ {ELASTICMQ_VERSION} is not installed in {}: run `make sqs-server` (or \
         `scripts/elasticmq.sh`), or set ELASTICMQ_LIB to a directory holding its jars",
        install.display()
    );
    Ok(install.join("lib"))
}

fn non_empty_env(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

fn has_server_jar(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| {
            entry.file_name().to_str().is_some_and(|name| {
                name.starts_with("elasticmq-server_2.13-") && name.ends_with(".jar")
            })
        })
}

/// The configuration BROKERS.md settled on, serving `port`. Queues
/// and messages are persisted in `dir` (queue definitions in a file, messages in an H2
/// database), so a restart keeps them like a real broker's restart does.
///
/// `WRITE_DELAY=0`: ElasticMQ answers a send once H2 has committed the message, but H2 keeps
/// commits in memory for up to 500 ms by default, so a SIGKILL lost messages ElasticMQ had
/// confirmed (2,000 sent, 1,849 back after a SIGKILL; the chaos run lost the last 75 and 264
/// messages sent before each kill). With it, every commit is written before the answer, as
/// SQS keeps what it confirmed (2,000 of 2,000, three times).
fn config(dir: &Path, port: u16) -> String {
    let dir = dir.display();
    format!(
        "include classpath(\"application.conf\")\n\
         node-address {{ protocol = http, host = 127.0.0.1, port = {port}, context-path = \"\" }}\n\
         rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = \"127.0.0.1\", sqs-limits = strict }}\n\
         rest-stats {{ enabled = false }}\n\
         generate-node-address = true\n\
         queues-storage {{ enabled = true, path = \"{dir}/queues.conf\" }}\n\
         messages-storage {{ enabled = true, uri = \"jdbc:h2:{dir}/messages;WRITE_DELAY=0\" }}\n"
    )
}

/// Starts the JVM with the config for `port` and waits for the start-up line; returns
/// the child and the port it serves. The log file is appended to, so a restart keeps the
/// previous run's lines.
fn spawn(dir: &Path, lib: &Path, port: u16) -> Result<(Child, u16)> {
    let config_file = dir.join("elasticmq.conf");
    std::fs::write(&config_file, config(dir, port))?;
    let log_path = dir.join(LOG_FILE);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let offset = log.metadata()?.len();
    let mut child = Command::new("java")
        .arg("-Xmx256m")
        .args(crate::servers::jvm_jit_args())
        .arg(format!("-Dconfig.file={}", config_file.display()))
        .arg("-cp")
        .arg(format!("{}/*", lib.display()))
        .arg("org.elasticmq.server.Main")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context(
            "starting java for ElasticMQ; install it with \
             `apt-get install -y --no-install-recommends openjdk-17-jre-headless`",
        )?;
    let mut outcome = None;
    let started = wait_until(
        STARTUP_TIMEOUT,
        "ElasticMQ logs that its SQS rest server started",
        || {
            outcome = startup_outcome(&log_path, offset, &mut child);
            outcome.is_some()
        },
    )
    .and_then(|()| outcome.expect("the wait ends early only with an outcome"));
    match started {
        Ok(port) => Ok((child, port)),
        Err(err) => {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
            Err(err.context(log_tail(&log_path)))
        }
    }
}

/// `Some` once this run's log (from `offset`) shows how start-up ended, or the JVM has exited.
fn startup_outcome(log_path: &Path, offset: u64, child: &mut Child) -> Option<Result<u16>> {
    let log = std::fs::read(log_path).unwrap_or_default();
    let run = log.get(usize::try_from(offset).ok()?..).unwrap_or_default();
    // Complete lines only: a half-written start-up line could end in a truncated port.
    let complete = &run[..run
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |end| end + 1)];
    for line in String::from_utf8_lossy(complete).lines() {
        if let Some((_, rest)) = line.split_once(STARTED_LINE) {
            let port = rest.split(',').next().unwrap_or_default();
            return Some(
                port.parse()
                    .with_context(|| format!("no port in ElasticMQ's start-up line: {line}")),
            );
        }
        if line.contains(BIND_FAILED_LINE) {
            return Some(Err(anyhow!("ElasticMQ could not bind its port: {line}")));
        }
    }
    match child.try_wait() {
        Ok(None) => None,
        Ok(Some(status)) => Some(Err(anyhow!("ElasticMQ exited during start-up: {status}"))),
        Err(err) => Some(Err(anyhow::Error::new(err).context("waiting for ElasticMQ"))),
    }
}

fn log_tail(log_path: &Path) -> String {
    let log = std::fs::read_to_string(log_path).unwrap_or_default();
    let tail: Vec<&str> = log
        .lines()
        .rev()
        .filter(|line| !line.trim_start().starts_with("at "))
        .take(20)
        .collect();
    format!(
        "ElasticMQ log {} (last lines without Java stack frames, newest first):\n{}",
        log_path.display(),
        tail.join("\n")
    )
}

/// A client that reads nothing from the environment: fixed credentials, the given endpoint and
/// region.
pub fn sqs_client(endpoint: &str, region: &str) -> Client {
    let config = SdkConfig::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(Region::new(region.to_owned()))
        .credentials_provider(SharedCredentialsProvider::new(Credentials::new(
            "x",
            "x",
            None,
            None,
            "switchboard-tests",
        )))
        .build();
    Client::new(&config)
}

/// An SDK error with its whole cause chain (its `Display` alone says only "service error").
pub fn sqs_error(operation: &str, err: impl std::error::Error) -> anyhow::Error {
    anyhow!("{operation}: {}", DisplayErrorContext(err))
}

/// A standard SQS queue of a real ElasticMQ server, which the worker reaches through an
/// [`SqsProxy`] (to refuse dead letters as SQS can, and to hang receives).
#[derive(Debug)]
pub struct SqsBroker {
    pub server: ElasticMq,
    pub proxy: SqsProxy,
}

/// The attributes of every queue the contract suite reads: short visibility, so that a killed
/// worker's messages come back quickly.
const CONTRACT_QUEUE: [(QueueAttributeName, &str); 1] =
    [(QueueAttributeName::VisibilityTimeout, "2")];

/// How long [`SqsBroker::recreate_after`] waits for a worker call to find the deleted queue
/// missing (a hung long poll on the deleted queue ends after the worker's 11 s deadline).
const RECREATE_TIMEOUT: Duration = Duration::from_secs(60);

impl BrokerFixture for SqsBroker {
    async fn start(_fx: &Fixture) -> Result<(Self, Vec<(String, String)>)> {
        let server = ElasticMq::start()?;
        let proxy = SqsProxy::start(server.port())?;
        let env = [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_REGION", "us-east-1"),
        ]
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .to_vec();
        Ok((Self { server, proxy }, env))
    }

    async fn create(&self, _fx: &Fixture, name: &str) -> Result<String> {
        let url = self.server.create_queue(name, &CONTRACT_QUEUE).await?;
        self.server
            .create_queue(&format!("{name}-dlq"), &[])
            .await?;
        Ok(format!(
            "sqs: {{queueUrl: \"{url}\", endpoint: \"{}\", waitTimeSeconds: 1}}",
            self.proxy.endpoint()
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

    /// The proxy's: the worker reaches ElasticMQ through it.
    fn address(&self, _fx: &Fixture) -> Result<String> {
        Ok(format!("127.0.0.1:{}", self.proxy.port))
    }

    /// SIGKILL, then a start on the same port and data: ElasticMQ keeps queues and messages
    /// in its directory (see [`ElasticMq`]).
    async fn crash(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.kill();
        self.server.restart()
    }

    /// `DeleteQueue`, then `CreateQueue` with the same name and attributes once a worker's
    /// receive, delete or visibility change through the proxy found the queue missing (see [`SqsBroker::recreate_after`]). SQS
    /// MessageIds are unique per send, so the new queue's messages can never take an old
    /// one's id.
    async fn recreate(&self, _fx: &Fixture, name: &str) -> Result<()> {
        let seen = self.proxy.missing_queue_calls();
        self.recreate_after(name, || self.proxy.missing_queue_calls() > seen)
            .await
    }

    /// A message whose headers are `String` message attributes.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let attributes = string_attributes(headers);
        self.server
            .send_with_attributes(&self.url(name), body, attributes)
            .await
            .map(drop)
    }

    /// Message attributes that are not plain text: a `Binary` value holding NUL (UTF-8, but
    /// PostgreSQL's jsonb refuses `\u0000`), a `Binary.gif` value that is not UTF-8, a custom
    /// `Number.float` type.
    async fn produce_undecodable(&self, _fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        self.server
            .send_with_attributes(&self.url(name), body, odd_attributes())
            .await
            .map(drop)
    }

    /// ElasticMQ 1.7.1 takes any message on any queue (it ignores `MaximumMessageSize`, and no
    /// queue setting of it refuses a short letter), so the proxy refuses every send to the
    /// dead-letter queue the way SQS refuses a letter it will never take: each entry failed
    /// with `SenderFault` (tests/tests/sqs.rs shows the same against moto's real
    /// `MaximumMessageSize`).
    async fn refuse_dead_letters(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.proxy.refuse_sends_to(&format!("{name}-dlq"));
        Ok(())
    }
}

/// The attributes [`SqsBroker::produce_undecodable`] sends (name, data type, value).
pub fn odd_attributes() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    vec![
        ("nul", "Binary", b"a\x00b".to_vec()),
        ("gif", "Binary.gif", vec![0xff, 0x00, 0xfe]),
        ("ratio", "Number.float", b"1.5".to_vec()),
    ]
}

/// `headers` as `String` message attributes (name, data type, value).
pub(crate) fn string_attributes<'a>(
    headers: &[(&'a str, &str)],
) -> Vec<(&'a str, &'static str, Vec<u8>)> {
    headers
        .iter()
        .map(|(header, value)| (*header, "String", value.as_bytes().to_vec()))
        .collect()
}

impl SqsBroker {
    /// Adds one message with `body` and the `AWSTraceHeader` *system* attribute (X-Ray's
    /// `Root=1-…;Parent=…;Sampled=1`), as AWS SDKs with X-Ray send it.
    pub async fn produce_with_trace_header(
        &self,
        name: &str,
        body: &str,
        trace_header: &str,
    ) -> Result<()> {
        let url = self.url(name);
        let value = MessageSystemAttributeValue::builder()
            .data_type("String")
            .string_value(trace_header)
            .build()?;
        self.server
            .client()
            .send_message()
            .queue_url(&url)
            .message_body(body)
            .message_system_attributes(MessageSystemAttributeNameForSends::AwsTraceHeader, value)
            .send()
            .await
            .map_err(|err| sqs_error(&format!("SendMessage {url}"), err))?;
        Ok(())
    }

    /// Deletes queue `name` and creates it again with the contract queues' attributes once
    /// `found_missing` says a worker call found it missing: the worker meets the deleted queue
    /// whatever the timing, as it would on AWS, which asks for 60 s between the two (ElasticMQ
    /// allows none).
    pub async fn recreate_after(&self, name: &str, found_missing: impl Fn() -> bool) -> Result<()> {
        self.server.delete_queue(&self.url(name)).await?;
        wait_for(
            RECREATE_TIMEOUT,
            &format!("a worker call finds queue {name} missing"),
            || std::future::ready(Ok(found_missing())),
        )
        .await?;
        self.server
            .create_queue(name, &CONTRACT_QUEUE)
            .await
            .map(drop)
    }

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

/// An HTTP proxy on a loopback port in front of ElasticMQ, on its own thread and runtime (the
/// tests block their own at times). It forwards every call, except that it can refuse sends to
/// chosen queues as SQS refuses a message it will never take, and hold receives or deletes
/// unanswered (a hung server).
pub struct SqsProxy {
    port: u16,
    state: Arc<ProxyState>,
    stop: Option<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl std::fmt::Debug for SqsProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsProxy")
            .field("port", &self.port)
            .finish()
    }
}

#[derive(Debug, Default)]
struct ProxyState {
    upstream_port: u16,
    /// Names of queues whose sends are refused.
    refused: Mutex<HashSet<String>>,
    /// Receives are held unanswered while set.
    hang_receives: AtomicBool,
    /// `SetQueueAttributes` is answered `AccessDenied` while set.
    deny_set_attributes: AtomicBool,
    /// Receives held so far.
    hung: AtomicU64,
    /// `DeleteMessage` calls are held unanswered while set.
    hang_deletes: AtomicBool,
    /// `DeleteMessage` calls held so far.
    hung_deletes: AtomicU64,
    /// Receives, deletes and visibility changes ElasticMQ answered `QueueDoesNotExist`.
    missing_queue: AtomicU64,
}

type ProxyClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<axum::body::Bytes>,
>;

impl SqsProxy {
    /// Starts forwarding a free loopback port to ElasticMQ's `upstream_port`.
    pub fn start(upstream_port: u16) -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let state = Arc::new(ProxyState {
            upstream_port,
            ..ProxyState::default()
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sqs-proxy-{port}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("proxy listener");
                    let client: ProxyClient = hyper_util::client::legacy::Client::builder(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .build_http();
                    let app = axum::Router::new()
                        .fallback(forward)
                        .with_state((shared, client));
                    tokio::select! {
                        _ = axum::serve(listener, app) => {}
                        _ = stopped => {}
                    }
                });
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Self {
            port,
            state,
            stop: Some((stop, thread)),
        })
    }

    /// `http://127.0.0.1:PORT`, the endpoint a worker is given.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// From now on, every `SendMessage`/`SendMessageBatch` to queue `name` is refused as SQS
    /// refuses a message it will never take (the sender's fault), and nothing is written.
    pub fn refuse_sends_to(&self, name: &str) {
        lock(&self.state.refused).insert(name.to_owned());
    }

    /// Answers every `SetQueueAttributes` `AccessDenied` (`true`), as SQS does for a role
    /// without `sqs:SetQueueAttributes`, or forwards them again (`false`).
    pub fn deny_set_attributes(&self, deny: bool) {
        self.state.deny_set_attributes.store(deny, Ordering::SeqCst);
    }

    /// Holds every `ReceiveMessage` unanswered (`true`), or forwards them again (`false`).
    pub fn hang_receives(&self, hang: bool) {
        self.state.hang_receives.store(hang, Ordering::SeqCst);
    }

    /// How many receives were held so far.
    pub fn hung_receives(&self) -> u64 {
        self.state.hung.load(Ordering::SeqCst)
    }

    /// Holds every `DeleteMessage` unanswered (`true`), or forwards them again (`false`).
    pub fn hang_deletes(&self, hang: bool) {
        self.state.hang_deletes.store(hang, Ordering::SeqCst);
    }

    /// How many `DeleteMessage` calls were held so far.
    pub fn hung_deletes(&self) -> u64 {
        self.state.hung_deletes.load(Ordering::SeqCst)
    }

    /// How many receives, deletes and visibility changes ElasticMQ answered
    /// `QueueDoesNotExist` so far (the worker's probe reads queue attributes too, and its
    /// failures matter to nobody: not counted).
    pub fn missing_queue_calls(&self) -> u64 {
        self.state.missing_queue.load(Ordering::SeqCst)
    }
}

impl Drop for SqsProxy {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.stop.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The refusal of a send to a refused queue, in the AWS JSON protocol: `SendMessageBatch`
/// answers 200 with every entry failed as the sender's fault (as ElasticMQ and SQS do for a
/// letter they will never take), `SendMessage` a 400 `InvalidParameterValue`.
fn refusal(target: &str, request: &serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    const WHY: &str = "One or more parameters are invalid. Reason: this queue refuses every message (switchboard test proxy).";
    let json = [(
        axum::http::header::CONTENT_TYPE,
        "application/x-amz-json-1.0",
    )];
    if target.ends_with("SendMessageBatch") {
        let failed: Vec<serde_json::Value> = request["Entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|entry| {
                serde_json::json!({"Id": entry["Id"], "SenderFault": true,
                    "Code": "InvalidParameterValue", "Message": WHY})
            })
            .collect();
        let body = serde_json::json!({"Successful": [], "Failed": failed});
        return (axum::http::StatusCode::OK, json, body.to_string()).into_response();
    }
    let body =
        serde_json::json!({"__type": "com.amazonaws.sqs#InvalidParameterValue", "message": WHY});
    (
        axum::http::StatusCode::BAD_REQUEST,
        [
            (
                axum::http::header::CONTENT_TYPE,
                "application/x-amz-json-1.0",
            ),
            (
                axum::http::HeaderName::from_static("x-amzn-query-error"),
                "InvalidParameterValue;Sender",
            ),
        ],
        body.to_string(),
    )
        .into_response()
}

/// SQS's answer to a call the credentials are not allowed to make (AWS JSON protocol).
fn access_denied() -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let body = serde_json::json!({"__type": "com.amazonaws.sqs#AccessDenied",
        "message": "Access to the resource is denied (switchboard test proxy)."});
    (
        axum::http::StatusCode::FORBIDDEN,
        [
            (
                axum::http::header::CONTENT_TYPE,
                "application/x-amz-json-1.0",
            ),
            (
                axum::http::HeaderName::from_static("x-amzn-query-error"),
                "AccessDenied;Sender",
            ),
        ],
        body.to_string(),
    )
        .into_response()
}

/// Forwards one call to ElasticMQ, unless it is refused or held.
async fn forward(
    axum::extract::State((state, client)): axum::extract::State<(Arc<ProxyState>, ProxyClient)>,
    request: axum::extract::Request,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    use http_body_util::BodyExt as _;
    let (mut parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|collected| collected.to_bytes()) else {
        return axum::http::StatusCode::BAD_REQUEST.into_response();
    };
    let target = parts
        .headers
        .get("x-amz-target")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if target.ends_with(".ReceiveMessage") && state.hang_receives.load(Ordering::SeqCst) {
        state.hung.fetch_add(1, Ordering::SeqCst);
        // A hung server: the caller's own deadline is all that ends this call.
        std::future::pending::<()>().await;
    }
    if target.ends_with(".DeleteMessage") && state.hang_deletes.load(Ordering::SeqCst) {
        state.hung_deletes.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<()>().await;
    }
    if target.ends_with(".SetQueueAttributes") && state.deny_set_attributes.load(Ordering::SeqCst) {
        return access_denied();
    }
    if target.ends_with(".SendMessage") || target.ends_with(".SendMessageBatch") {
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let queue = request["QueueUrl"]
            .as_str()
            .and_then(|url| url.rsplit('/').next())
            .unwrap_or_default();
        if lock(&state.refused).contains(queue) {
            return refusal(&target, &request);
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |path| path.as_str())
        .to_owned();
    parts.uri = match format!("http://127.0.0.1:{}{path}", state.upstream_port).parse() {
        Ok(uri) => uri,
        Err(_) => return axum::http::StatusCode::BAD_REQUEST.into_response(),
    };
    let upstream = axum::http::Request::from_parts(parts, http_body_util::Full::new(body));
    match client.request(upstream).await {
        Ok(response) => {
            let (parts, body) = response.into_parts();
            match body.collect().await {
                Ok(collected) => {
                    let body = collected.to_bytes();
                    let worker_call = [
                        ".ReceiveMessage",
                        ".DeleteMessageBatch",
                        ".ChangeMessageVisibilityBatch",
                    ]
                    .iter()
                    .any(|call| target.ends_with(call));
                    if worker_call
                        && parts.status.is_client_error()
                        && body.windows(17).any(|w| w == b"QueueDoesNotExist")
                    {
                        state.missing_queue.fetch_add(1, Ordering::SeqCst);
                    }
                    axum::response::Response::from_parts(parts, axum::body::Body::from(body))
                }
                Err(_) => axum::http::StatusCode::BAD_GATEWAY.into_response(),
            }
        }
        // ElasticMQ is down (killed, restarting): what a client of a dead server sees.
        Err(_) => axum::http::StatusCode::BAD_GATEWAY.into_response(),
    }
}
