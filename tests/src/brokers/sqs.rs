//! A real ElasticMQ (an SQS-compatible server written for tests) as a child process on a random
//! loopback port, and an `aws-sdk-sqs` client with helpers to produce messages and inspect queues.
//!
//! ElasticMQ's `ApproximateNumberOf*` counts are exact and immediate: a message sent, received,
//! purged or delayed is counted correctly by the very next `GetQueueAttributes` (unlike AWS,
//! where they are eventually consistent), so tests may assert them with `==` right away.
//! `PurgeQueue` can also be repeated at once (no 60 s `PurgeQueueInProgress` as on AWS).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{Credentials, SharedCredentialsProvider};
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{
    Message, MessageSystemAttributeName, QueueAttributeName, SendMessageBatchRequestEntry,
};
use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::BrokerFixture;
use crate::Fixture;
use crate::servers::stop_child;
use crate::wait::wait_until;

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
    /// Starts a server on a port it picks itself, waiting until it accepts requests. Fails when
    /// the jars are not installed (`make sqs-server`).
    pub fn start() -> Result<Self> {
        let lib = lib_dir()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-elasticmq-")
            .tempdir()?;
        let (child, port) = spawn(dir.path(), &lib, 0)?;
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

/// The configuration BROKERS.md settled on; `port` 0 lets the server pick a free one. Queues
/// and messages are persisted in `dir` (queue definitions in a file, messages in an H2
/// database), so a restart keeps them like a real broker's restart does.
fn config(dir: &Path, port: u16) -> String {
    let dir = dir.display();
    format!(
        "include classpath(\"application.conf\")\n\
         node-address {{ protocol = http, host = 127.0.0.1, port = {port}, context-path = \"\" }}\n\
         rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = \"127.0.0.1\", sqs-limits = strict }}\n\
         rest-stats {{ enabled = false }}\n\
         generate-node-address = true\n\
         queues-storage {{ enabled = true, path = \"{dir}/queues.conf\" }}\n\
         messages-storage {{ enabled = true, uri = \"jdbc:h2:{dir}/messages\" }}\n"
    )
}

/// Starts the JVM with the config for `port` (0: any) and waits for the start-up line; returns
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
        .args(["-Xmx256m", "-XX:TieredStopAtLevel=1"])
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

/// A standard SQS queue of a real ElasticMQ server.
#[derive(Debug)]
pub struct SqsBroker {
    pub server: ElasticMq,
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
