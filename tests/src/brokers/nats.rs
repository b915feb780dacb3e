//! A real nats-server with JetStream as a child process on loopback ports it picks itself, and
//! an `async-nats` client with helpers to create streams, publish and inspect consumers.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use async_nats::jetstream::{self, consumer, stream};
use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::cache_dir;
use super::{BrokerFixture, GROUP};
use crate::Fixture;
use crate::servers::stop_child;
use crate::wait::wait_for;

/// The nats-server version `scripts/nats-server.sh` builds and this harness looks for.
pub const NATS_SERVER_VERSION: &str = "2.15.2";
/// How it gets installed (`make test` runs it).
pub const NATS_SERVER_INSTALL: &str = "scripts/nats-server.sh (make nats-server)";

const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const LOG_FILE: &str = "nats-server.log";
/// How many PubAcks a produce call waits for at once.
const PUBLISH_WINDOW: usize = 512;

/// A nats-server of our own with JetStream, bound to 127.0.0.1, its store in a temporary
/// directory: after [`NatsServer::restart`] streams, consumers and messages are back.
#[derive(Debug)]
pub struct NatsServer {
    dir: TempDir,
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
    client: async_nats::Client,
}

impl NatsServer {
    /// Starts a server on a port it picks itself, waiting until JetStream answers. Fails when
    /// nats-server is not built (`make nats-server`).
    pub async fn start() -> Result<Self> {
        let bin = server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("switchboard-nats-")
            .tempdir()?;
        let (child, port) = spawn(&bin, dir.path(), None).await?;
        let client = connect(port).await?;
        Ok(Self {
            dir,
            bin,
            port,
            child: Some(child),
            client,
        })
    }

    /// `nats://127.0.0.1:PORT`; it stays the same across restarts.
    pub fn url(&self) -> String {
        format!("nats://{}", self.address())
    }

    /// `127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The server's process id, for CPU accounting.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `127.0.0.1:PORT` of the server's HTTP monitoring endpoint (`/jsz`, which KEDA reads), from
    /// the ports file of the running process (the port changes across restarts).
    pub fn monitoring_address(&self) -> Result<String> {
        let pid = self.pid().context("nats-server is not running")?;
        let ports =
            std::fs::read_to_string(self.dir.path().join(format!("nats-server_{pid}.ports")))?;
        let ports: serde_json::Value = serde_json::from_str(&ports)?;
        let url = ports["monitoring"][0]
            .as_str()
            .with_context(|| format!("no monitoring port in {ports}"))?;
        Ok(url.trim_start_matches("http://").to_owned())
    }

    pub fn client(&self) -> async_nats::Client {
        self.client.clone()
    }

    pub fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.client.clone())
    }

    /// SIGTERM (the server flushes its store), then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGTERM, STOP_TIMEOUT);
        }
    }

    /// Stops the server and starts it again on the same port with the same store, so running
    /// clients reconnect; waits until JetStream answers.
    pub async fn restart(&mut self) -> Result<()> {
        self.stop();
        self.start_again().await
    }

    /// SIGKILLs the server, whatever it is doing, and starts it again on the same port and
    /// store (what it wrote survives: a process kill, not a power loss).
    pub async fn crash(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        }
        self.start_again().await
    }

    async fn start_again(&mut self) -> Result<()> {
        let (child, port) = spawn(&self.bin, self.dir.path(), Some(self.port)).await?;
        self.child = Some(child);
        ensure!(port == self.port, "nats-server came back on port {port}");
        self.client = connect(port).await?;
        Ok(())
    }

    /// Creates stream `stream` holding `subjects` (file storage).
    pub async fn create_stream(&self, stream: &str, subjects: &[String]) -> Result<()> {
        self.create_stream_with(stream::Config {
            name: stream.to_owned(),
            subjects: subjects.to_vec(),
            ..Default::default()
        })
        .await
    }

    /// Creates the stream `config` describes, with file storage.
    pub async fn create_stream_with(&self, config: stream::Config) -> Result<()> {
        let name = config.name.clone();
        self.jetstream()
            .create_stream(stream::Config {
                storage: stream::StorageType::File,
                ..config
            })
            .await
            .with_context(|| format!("creating stream {name}"))?;
        Ok(())
    }

    /// Deletes stream `stream` and creates it again, empty, with the same configuration.
    pub async fn recreate_stream(&self, stream: &str) -> Result<()> {
        let js = self.jetstream();
        let config = js.get_stream(stream).await?.info().await?.config.clone();
        js.delete_stream(stream)
            .await
            .with_context(|| format!("deleting stream {stream}"))?;
        self.create_stream_with(config).await
    }

    /// Publishes one message to `subject` whose header `trace` is not UTF-8, as a Go producer
    /// can (see [`Self::publish_raw`]).
    pub async fn publish_non_utf8_header(&self, subject: &str, body: &[u8]) -> Result<()> {
        self.publish_raw(
            subject.as_bytes(),
            b"NATS/1.0\r\ntrace: \xff\xfe binary\r\n\r\n",
            body,
        )
        .await
    }

    /// Publishes one message as raw bytes, as a Go or C producer can (`async-nats` builds
    /// neither a subject nor a header block that is not UTF-8): an `HPUB` on a connection of
    /// its own, waiting for the stream's PubAck.
    pub async fn publish_raw(&self, subject: &[u8], headers: &[u8], body: &[u8]) -> Result<()> {
        use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
        let mut frame =
            b"CONNECT {\"verbose\":false,\"headers\":true}\r\nSUB _INBOX.raw 1\r\nHPUB ".to_vec();
        frame.extend_from_slice(subject);
        frame.extend_from_slice(
            format!(
                " _INBOX.raw {} {}\r\n",
                headers.len(),
                headers.len() + body.len()
            )
            .as_bytes(),
        );
        frame.extend_from_slice(headers);
        frame.extend_from_slice(body);
        frame.extend_from_slice(b"\r\n");
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let (read, mut write) = stream.into_split();
        write.write_all(&frame).await?;
        let mut lines = BufReader::new(read).lines();
        let answer = tokio::time::timeout(STARTUP_TIMEOUT, async {
            while let Some(line) = lines.next_line().await? {
                if line.starts_with("PING") {
                    write.write_all(b"PONG\r\n").await?;
                } else if line.starts_with("-ERR") || line.contains("\"seq\"") {
                    return Ok(line);
                }
            }
            bail!("the server closed the connection")
        })
        .await
        .context("no PubAck for the raw HPUB")??;
        ensure!(
            answer.contains("\"seq\"") && !answer.contains("\"error\""),
            "the stream refused the message: {answer}"
        );
        Ok(())
    }

    /// Publishes every body to `subject`, waiting for each PubAck.
    pub async fn publish(&self, subject: &str, bodies: Vec<Vec<u8>>) -> Result<()> {
        let js = self.jetstream();
        for chunk in bodies.chunks(PUBLISH_WINDOW) {
            let mut acks = Vec::with_capacity(chunk.len());
            for body in chunk {
                acks.push(
                    js.publish(subject.to_owned(), body.clone().into())
                        .await
                        .with_context(|| format!("publishing to {subject}"))?,
                );
            }
            for ack in acks {
                ack.await.with_context(|| format!("PubAck for {subject}"))?;
            }
        }
        Ok(())
    }

    /// The consumer's figures, `None` when it does not exist (yet).
    pub async fn consumer_info(&self, stream: &str, name: &str) -> Result<Option<consumer::Info>> {
        let stream = self.jetstream().get_stream_no_info(stream).await?;
        match stream.consumer_info(name).await {
            Ok(info) => Ok(Some(info)),
            Err(err)
                if matches!(
                    err.kind(),
                    jetstream::context::ConsumerInfoErrorKind::NotFound
                ) =>
            {
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Messages the stream holds, `None` when it does not exist.
    pub async fn stream_messages(
        &self,
        stream: &str,
    ) -> Result<Option<Vec<jetstream::message::StreamMessage>>> {
        let mut handle = match self.jetstream().get_stream(stream).await {
            Ok(handle) => handle,
            Err(err) if err.to_string().contains("stream not found") => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        let state = handle.info().await?.state.clone();
        let mut messages = Vec::new();
        if state.messages == 0 {
            return Ok(Some(messages));
        }
        for seq in state.first_sequence..=state.last_sequence {
            match handle.get_raw_message(seq).await {
                Ok(message) => messages.push(message),
                Err(err) if err.to_string().contains("no message found") => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(Some(messages))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        }
    }
}

/// `$NATS_SERVER_BIN`, else the binary `scripts/nats-server.sh` builds into the cache.
pub fn server_bin() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN").filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        ensure!(
            bin.is_file(),
            "NATS_SERVER_BIN={} is not a file; unset it to use the cache that `{NATS_SERVER_INSTALL}` fills",
            bin.display()
        );
        return Ok(bin);
    }
    let bin = cache_dir()?.join(format!("nats-server-{NATS_SERVER_VERSION}/bin/nats-server"));
    ensure!(
        bin.is_file(),
        "nats-server {NATS_SERVER_VERSION} is not built in {}: run `{NATS_SERVER_INSTALL}`, or set NATS_SERVER_BIN",
        bin.display()
    );
    Ok(bin)
}

/// Starts nats-server in `dir` (store in `dir/js`) on `port`, or one it picks; returns the
/// child and its client port, read from the ports file it writes.
async fn spawn(bin: &Path, dir: &Path, port: Option<u16>) -> Result<(Child, u16)> {
    let log_path = dir.join(LOG_FILE);
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let port_arg = port.map_or_else(|| "-1".to_owned(), |p| p.to_string());
    let mut child = Command::new(bin)
        .args(["-a", "127.0.0.1", "-p", &port_arg, "-m", "-1", "-js", "-sd"])
        .arg(dir.join("js"))
        .arg("--ports_file_dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let ports_file = dir.join(format!("nats-server_{}.ports", child.id()));
    let mut found = None;
    let waited = wait_for(STARTUP_TIMEOUT, "nats-server writes its ports file", || {
        let exited = child.try_wait().ok().flatten();
        let read = std::fs::read_to_string(&ports_file).ok();
        found = read.as_deref().and_then(client_port);
        let done = found.is_some();
        async move {
            if let Some(status) = exited {
                bail!("nats-server exited with {status}");
            }
            Ok(done)
        }
    })
    .await;
    if let Err(err) = waited {
        stop_child(&mut child, Signal::SIGKILL, STOP_TIMEOUT);
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(err.context(format!("nats-server log:\n{log}")));
    }
    let port = found.context("no client port")?;
    Ok((child, port))
}

/// The client port in a ports file (`{"nats":["nats://127.0.0.1:4222"],…}`).
fn client_port(ports: &str) -> Option<u16> {
    let ports: serde_json::Value = serde_json::from_str(ports).ok()?;
    let url = ports["nats"].as_array()?.first()?.as_str()?;
    url.rsplit(':').next()?.parse().ok()
}

/// A client once JetStream answers.
async fn connect(port: u16) -> Result<async_nats::Client> {
    let url = format!("nats://127.0.0.1:{port}");
    wait_for(STARTUP_TIMEOUT, "JetStream answers", || {
        let url = url.clone();
        async move {
            let client = async_nats::connect(&url).await?;
            jetstream::new(client).query_account().await?;
            Ok(true)
        }
    })
    .await?;
    Ok(async_nats::connect(&url).await?)
}

#[cfg(test)]
mod tests {
    use super::client_port;

    #[test]
    fn client_port_is_read_from_the_ports_file() {
        assert_eq!(
            client_port(
                r#"{"nats":["nats://127.0.0.1:39857"],"monitoring":["http://127.0.0.1:41709"]}"#
            ),
            Some(39857)
        );
        assert_eq!(client_port("{}"), None);
    }
}

/// A NATS JetStream stream of a real nats-server, read by a durable pull consumer.
#[derive(Debug)]
pub struct NatsBroker {
    pub server: NatsServer,
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

    async fn crash(&mut self, _fx: &mut Fixture) -> Result<()> {
        self.server.crash().await
    }

    fn address(&self, _fx: &Fixture) -> Result<String> {
        Ok(self.server.address())
    }

    async fn recreate(&self, _fx: &Fixture, name: &str) -> Result<()> {
        self.server.recreate_stream(&Self::stream(name)).await
    }

    /// A message whose headers are NATS headers, published to the queue's subject.
    async fn produce_with_headers(
        &self,
        _fx: &Fixture,
        name: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> Result<()> {
        let mut map = async_nats::HeaderMap::new();
        for (header, value) in headers {
            map.insert(*header, *value);
        }
        let subject = Self::subject(name);
        self.server
            .jetstream()
            .publish_with_headers(subject.clone(), map, body.into())
            .await
            .with_context(|| format!("publishing to {subject}"))?
            .await
            .with_context(|| format!("PubAck for {subject}"))?;
        Ok(())
    }

    /// A header value that is not UTF-8 (`async-nats` cannot decode the delivery).
    async fn produce_undecodable(&self, _fx: &Fixture, name: &str, body: Vec<u8>) -> Result<()> {
        self.server
            .publish_non_utf8_header(&Self::subject(name), &body)
            .await
    }

    /// The dead-letter stream the worker would create, made first with a maximum message
    /// size no letter fits in.
    async fn refuse_dead_letters(&self, _fx: &Fixture, name: &str) -> Result<()> {
        let stream = Self::stream(name);
        self.server
            .create_stream_with(stream::Config {
                name: format!("{stream}_DLQ"),
                subjects: vec![format!("{stream}.dlq.>")],
                max_message_size: 16,
                ..Default::default()
            })
            .await
    }
}
